"""What XLA:TPU keeps in the chip's on-chip vector memory (VMEM) instead of HBM: a layer's attention scores.

XLA:TPU's memory-space assignment places some buffers in VMEM (their layout marked ``S(1)`` in the compiled HLO),
where the passes over them cost no HBM traffic. Outside a fused kernel, the attention score matrix of one layer
and microbatch (``[batch, heads, rows, keys]`` in the compute dtype) is the largest buffer a step's memory-bound
products write and read. Deviceless compiles of the runner's single-chip steps for a v5e chip at eleven microbatch
sizes (benchmarks/tpu_chip/vmem_scores.json, benchmarks/tpu_vmem_scores.py; libtpu 0.0.42.1) made every top-level
read and write of it in VMEM up to 48 MiB, 73-75% of them from 64 to 96 MiB, none at 120 MiB or more, of the chip's
128 MiB (jax-ml/scaling-book, "How to Think About TPUs"): all while two score matrices fit 3/4 of the VMEM,
:data:`PARTIAL_ON_CHIP` while one does (:func:`score_on_chip_share`). The rest of a step's arrays kept the same
53-66% share of their top-level traffic in VMEM at every recorded microbatch, so only the scores' share moves with
the microbatch. Priced where the traffic is: the share of the score-sized operand or output of each attention
product leaves the product's HBM operand bytes (testbed.sim.price.compute; both simulator tiers price products there).
Devices without a ``vmem`` (every GPU, and TPU topologies that do not declare it) price every operand in HBM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from testbed.model.gemm import Gemm
    from testbed.topology.parts import DeviceSpec

__all__ = ["SCORE_SHARE", "PARTIAL_ON_CHIP", "score_on_chip_share", "on_chip_bytes"]

#: The largest score matrix XLA:TPU placed in VMEM, over the VMEM's size: 96 of 128 MiB (vmem_scores.json: placed
#: at 48, 64 and 96 MiB; not at 120, 128, 144, 192 MiB).
SCORE_SHARE = 0.75
#: The share of a score matrix's top-level reads and writes XLA:TPU makes in VMEM when one score matrix fits
#: :data:`SCORE_SHARE` of the VMEM but two do not: the mean of vmem_scores.json's ``traffic.scores.on_chip`` over
#: its rows of that kind (64, 72 and 96 MiB of a 128 MiB VMEM: 0.73-0.75; tests/test_vmem.py holds it to the record).
PARTIAL_ON_CHIP = 0.74


def score_on_chip_share(device: "DeviceSpec", score_bytes: float) -> float:
    """The share of the passes over a layer's score matrix of ``score_bytes`` (one microbatch, one device) that
    XLA:TPU makes in ``device``'s VMEM: all when two such matrices fit :data:`SCORE_SHARE` of it (a layer's
    scores and their gradient or probabilities live at once), :data:`PARTIAL_ON_CHIP` when one does, else none
    (and none on a device without a ``vmem``)."""
    budget = SCORE_SHARE * device.vmem_bytes
    if budget <= 0 or score_bytes > budget:
        return 0.0
    return 1.0 if 2 * score_bytes <= budget else PARTIAL_ON_CHIP


def on_chip_bytes(device: "DeviceSpec", gemm: "Gemm", read: int, write: int) -> float:
    """The bytes of ``gemm``'s HBM operands (all ``batch`` products) that stay in VMEM: its score-sized operand or
    output times :func:`score_on_chip_share` of the score matrix, 0 for other products."""
    cells = gemm.score_cells
    if not cells:
        return 0.0
    sides = ((gemm.lhs_elements, read), (gemm.k * gemm.n, read), (gemm.m * gemm.n, write))
    size = next((elements * width for elements, width in sides if elements == cells), 0)
    share = score_on_chip_share(device, gemm.batch * cells * write) if size else 0.0
    return float(gemm.batch * size) * share
