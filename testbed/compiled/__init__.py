"""XLA:TPU's compiles of plans, recorded (``benchmarks/xla_tpu/``), and testbed's predictions beside them."""

from testbed.compiled.records import XlaCollective, XlaMemory, XlaRecord, load_record, load_records

__all__ = ["XlaCollective", "XlaMemory", "XlaRecord", "load_record", "load_records"]
