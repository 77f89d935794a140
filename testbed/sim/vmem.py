"""What XLA:TPU keeps in the chip's on-chip vector memory (VMEM) instead of HBM: a layer's attention scores.

XLA:TPU's memory-space assignment places some buffers in VMEM (their layout marked ``S(1)`` in the compiled HLO),
where the passes over them cost no HBM traffic. Outside a fused kernel, the attention score matrix of one layer
and microbatch (``[batch, heads, rows, keys]`` in the compute dtype) is the largest buffer a step's memory-bound
products write and read. Deviceless compiles of the runner's single-chip steps for a v5e chip
(benchmarks/tpu_chip/vmem_scores.json, benchmarks/tpu_vmem_scores.py; libtpu 0.0.42.1) placed it in VMEM at 48 and
96 MiB and never at 120 MiB or more, of the chip's 128 MiB (jax-ml/scaling-book, "How to Think About TPUs"); the
chip's steps agree (benchmarks/tpu_chip/runs.json: 48 and 96 MiB scores 20-30% faster than HBM pricing). So a
score matrix up to :data:`SCORE_SHARE` of the device's ``vmem`` is priced on chip: the score-sized operand or
output of each attention product leaves the product's HBM operand bytes (testbed.sim.compute). Devices without a
``vmem`` (every GPU, and TPU topologies that do not declare it) price every operand in HBM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from testbed.model.gemm import Gemm
    from testbed.topology.parts import DeviceSpec

__all__ = ["SCORE_SHARE", "scores_on_chip", "on_chip_bytes"]

#: The largest score matrix XLA:TPU placed in VMEM, over the VMEM's size: 96 of 128 MiB (vmem_scores.json: placed
#: at 48 and 96 MiB; not at 120, 128, 144, 192 MiB).
SCORE_SHARE = 0.75


def scores_on_chip(device: "DeviceSpec", score_bytes: float) -> bool:
    """Whether a layer's score matrix of ``score_bytes`` (one microbatch, one device) stays in ``device``'s VMEM."""
    return device.vmem_bytes > 0 and score_bytes <= SCORE_SHARE * device.vmem_bytes


def on_chip_bytes(device: "DeviceSpec", gemm: "Gemm", read: int, write: int) -> float:
    """The bytes of ``gemm``'s HBM operands (all ``batch`` products) that stay in VMEM: its score-sized operand or
    output when the score matrix fits (:func:`scores_on_chip`), else 0."""
    cells = gemm.score_cells
    if not cells:
        return 0.0
    sides = ((gemm.lhs_elements, read), (gemm.k * gemm.n, read), (gemm.m * gemm.n, write))
    size = next((elements * width for elements, width in sides if elements == cells), 0)
    return float(gemm.batch * size) if size and scores_on_chip(device, gemm.batch * cells * write) else 0.0
