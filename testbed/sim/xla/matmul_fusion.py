"""XLA:TPU's matmul fusions in a traced program: the memory-bound ops that run inside a matmul's kernel.

XLA:TPU fuses a matmul's elementwise producers and consumers into its convolution fusion: on the chip's per-op
profiles of users' programs (benchmarks/tpu_chip/programs.json) 85-98% of a step's XLA time is in fusions whose
body holds the convolution, with the bias adds, activations, norms' scalings and SGD/Adam updates beside it, and
the memory-bound fusions left on their own take 1-13%. Such a kernel is priced by the rule that prices a plan's fused
kernels too (testbed.sim.price.compute.fused_kernel_seconds): the longer of its math and its HBM traffic, its operands
and result with what is fused into it (epilogue_bytes), but for its consumers' bytes past two passes the size of its
result (trailing_bytes: an optimizer update's further state), of which only a fitted share runs beside the math; the
value a fused consumer reads from the matmul never reaches HBM.

The rule, on devices whose compiler does this (``DeviceSpec.fuses_into_matmuls``) and whose calibration prices
memory-bound kernels apart (an ``elementwise`` group: one chip; without it each segment between collectives is one
roofline, which hides all its traffic under its matmuls, as the TPU slices' fit has it): a memory-bound op fuses into a
matmul it reads (the last such, as a consumer; its bytes less the matmul's result it reads) or, when matmuls are all
that read it, into the first of them (as a producer; its bytes), where that matmul runs in the same segment of the
program (between the same collectives: a kernel waits for every collective what it fuses reads). The tracer's fusion estimate counts each op's
reads and writes of materialized values (testbed.runner.program.compile), so these are the bytes the fused kernel
adds to the matmul's own operands and result; a matmul whose result only its fused consumers read writes none of
it (``MatmulFusions.on_chip``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from testbed.model.gemm import trailing_bytes
from testbed.sim.xla.workload import OpKind, Workload, element_bytes

__all__ = ["MatmulFusions", "matmul_fusions"]


@dataclass(frozen=True, slots=True)
class MatmulFusions:
    """``bytes``: matmul op -> the HBM bytes of the memory-bound ops fused into it; ``fused``: those ops;
    ``on_chip``: the matmul ops whose result only ops fused into their own kernel read (it never reaches HBM);
    ``trailing``: matmul op -> the part of its ``bytes`` past the kernel's streams (testbed.model.gemm.
    trailing_bytes of its consumers')."""

    bytes: dict[int, float] = field(default_factory=dict)
    fused: frozenset[int] = frozenset()
    on_chip: frozenset[int] = frozenset()
    trailing: dict[int, float] = field(default_factory=dict)


def _result_bytes(workload: Workload, gemm_op: int) -> float:
    op = workload.ops[gemm_op]
    size = element_bytes(workload.dtype)
    return op.count * sum(g.m * g.n * g.batch * g.count for g in op.gemms) * size


def matmul_fusions(workload: Workload, segment: list[int], readers: list[list[int]]) -> MatmulFusions:
    """The memory-bound ops of ``segment`` (op indices of ``workload``, whose :meth:`Workload.readers` are
    ``readers``) fused into its matmuls, and the bytes each matmul's kernel gains."""
    ops, inside = workload.ops, set(segment)
    gained: dict[int, float] = {}
    consumed: dict[int, int] = {}  # a consumer fused into the matmul it reads -> that matmul
    fused: set[int] = set()
    for i in segment:
        op = ops[i]
        if op.kind is not OpKind.MEMORY:
            continue
        read = [d for d in op.deps if ops[d].kind is OpKind.GEMM and d in inside]
        if read:
            gemm, nbytes = read[-1], max(0.0, op.hbm_bytes * op.count - _result_bytes(workload, read[-1]))
            consumed[i] = gemm
        elif readers[i] and readers[i][0] in inside and all(ops[r].kind is OpKind.GEMM for r in readers[i]):
            gemm, nbytes = readers[i][0], op.hbm_bytes * op.count
        else:
            continue
        gained[gemm] = gained.get(gemm, 0.0) + nbytes
        fused.add(i)
    on_chip = frozenset(g for g in set(consumed.values()) if all(consumed.get(r) == g for r in readers[g]))
    consumers: dict[int, float] = {}
    for i, gemm in consumed.items():
        consumers[gemm] = consumers.get(gemm, 0.0) + max(0.0, ops[i].hbm_bytes * ops[i].count
                                                         - _result_bytes(workload, gemm))
    trailing = {g: trailing_bytes(nbytes, _result_bytes(workload, g)) for g, nbytes in consumers.items()}
    return MatmulFusions(gained, frozenset(fused), on_chip, {g: b for g, b in trailing.items() if b > 0})

