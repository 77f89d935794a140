"""What XLA does to a program that the program's source does not say, and the program as XLA holds it.

A traced program's per-device ops as plain data (:mod:`~testbed.sim.xla.workload`, what the tracer reads
from the partitioned StableHLO), and the compiler's passes and rules the simulator applies: the
collective combiners, the scheduler's overlap, matmul fusions, on-chip VMEM, and XLA:TPU's lowering of a
step's collectives (which a plan's step facts read too). Rules keyed by the compiler, read from its
compiles; no other part of the simulator is imported here.
"""
