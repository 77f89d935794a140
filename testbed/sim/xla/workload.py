"""A traced program's per-device work, as plain data: the simulator's input for a user's own JAX step.

testbed.runner.program traces a user's jitted, shard_map or pmap step on an abstract mesh and describes what
one device runs as a :class:`Workload`: in program order, every matmul or convolution (its FLOPs and
GEMM shape), every memory-bound op (the bytes it moves through HBM), every collective (kind, the mesh
axes its groups span, bytes per device in the DESIGN.md convention) and the data-flow dependencies
between them. This module holds only that description and its checks; it imports no JAX, so the
simulator core prices it (testbed.sim.graph.traced) like a plan's task graph.

An op inside a loop that was not unrolled carries the loop's trip count in ``count``: its FLOPs,
bytes and executions are per execution, and the op runs ``count`` times back to back. An op inside a loop
carries the loop iteration it runs in (``iteration``): XLA keeps a ``lax.scan``'s while loop and runs its
body one iteration at a time, so what orders and merges the ops (testbed.sim.xla.combine, testbed.sim.xla.overlap)
moves and merges none across an iteration's start or end (docs/program.md, "Gradient accumulation").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import StrEnum

from testbed.errors import InputError
from testbed.model.gemm import Gemm

__all__ = ["OpKind", "TracedOp", "Workload", "CompiledTransposes", "COLLECTIVE_KINDS", "element_bytes"]

#: Collective kinds (DESIGN.md / testbed.collectives spelling) a workload may hold.
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")


def element_bytes(element: str) -> int:
    """Bytes of one element of a StableHLO or HLO element type (``bf16`` 2, ``f32`` 4, ``f8E4M3FN`` 1; a sub-byte
    type, ``i1`` or HLO's ``pred`` counts 1 byte, no type 4): the tracer's reading of a value's bytes."""
    if element == "pred":
        return 1
    bits = re.search(r"(\d+)", element)
    return max(1, int(bits.group(1)) // 8) if bits else 4


class OpKind(StrEnum):
    """What prices an op: its matmuls (``gemm``), its HBM bytes (``memory``) or the network (``collective``)."""

    GEMM = "gemm"
    MEMORY = "memory"
    COLLECTIVE = "collective"


@dataclass(frozen=True, slots=True, kw_only=True)
class TracedOp:
    """One op of one device's program (per execution; ``count`` executions back to back).

    ``gemm`` ops carry ``gemms`` (a dot is one GEMM, a convolution its implicit GEMM) and ``flops``;
    ``memory`` ops ``hbm_bytes`` (reads and writes the fused kernels around it make, as the tracer
    approximates them); ``collective`` ops ``collective`` (a :data:`COLLECTIVE_KINDS` entry),
    ``axes`` (the mesh axes its device groups span, in mesh order), ``group`` (devices in one group)
    ``nbytes`` per device and ``element``, the element type of the buffer it moves as traced (StableHLO's spelling,
    ``bf16``; empty where unknown): the compiler may move another (testbed.sim.graph.traced.device_collectives).
    ``deps`` index earlier ops of the workload whose results it reads.
    ``iteration``: 0 outside loops; inside one, the innermost loop iteration the op runs in, a number of its own
    per iteration walked (increasing in program order; an op after an inner loop has its enclosing iteration's).
    ``combiner``: the collectives a compiler's combiner merges it with beyond its kind and axes (empty: all of
    them; ``gather``: an all-gather XLA:TPU lowers as an all-reduce merges with such ones only,
    testbed.sim.xla.xla_tpu.lowered_gathers). ``vector``: for an all-gather or reduce-scatter of rank-1 buffers,
    the elements of each device's shard (0: not rank-1), which XLA:TPU's rules read
    (testbed.sim.xla.xla_tpu.vector_gather_lowers). ``sequence``: a reduce-scatter of an activation of one sequence a
    device along its positions (testbed.sim.xla.xla_tpu.scatters_whole_sequence's case). ``again``: the collectives
    among ``deps`` whose result the op reads
    as a checkpoint's recomputation does, the same collective of the same values behind the checkpoint's optimization
    barrier, which XLA:CPU's common-subexpression elimination merges with the earlier one (the tracer's program)
    and XLA:TPU issues again (testbed.sim.xla.xla_tpu.regathered, a pass of testbed.sim.graph.traced's
    compiled_collectives, which spends it: the passes that renumber the ops after it keep none); ``barrier``: with
    ``again``, the earlier ops that barrier waits for (its operands' producers), which a collective issued again waits
    for too. ``held``: a collective the compiler runs blocking, in program order with the compute, whatever its kind
    (testbed.sim.graph.traced_graph; a gather issued again, testbed.sim.xla.xla_tpu.regathered).
    """

    name: str
    kind: OpKind
    deps: tuple[int, ...] = ()
    flops: float = 0.0
    gemms: tuple[Gemm, ...] = ()
    hbm_bytes: float = 0.0
    collective: str = ""
    axes: tuple[str, ...] = ()
    group: int = 1
    nbytes: float = 0.0
    element: str = ""
    count: int = 1
    iteration: int = 0
    combiner: str = ""
    vector: int = 0
    sequence: bool = False
    again: tuple[int, ...] = ()
    barrier: tuple[int, ...] = ()
    held: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", OpKind(self.kind))
        if self.count < 1:
            raise ValueError(f"{self.name}: count must be >= 1, got {self.count}")
        if self.iteration < 0:
            raise ValueError(f"{self.name}: iteration must be >= 0, got {self.iteration}")
        if min(self.flops, self.hbm_bytes, self.nbytes) < 0 or not all(
                math.isfinite(x) for x in (self.flops, self.hbm_bytes, self.nbytes)):
            raise ValueError(f"{self.name}: flops, hbm_bytes and nbytes must be finite and >= 0")
        if self.held and self.kind is not OpKind.COLLECTIVE:
            raise ValueError(f"{self.name}: only a collective is held")
        if not set(self.again) <= set(self.deps):
            raise ValueError(f"{self.name}: again {self.again} must be among its deps {self.deps}")
        if self.kind is OpKind.COLLECTIVE and self.collective not in COLLECTIVE_KINDS:
            raise ValueError(f"{self.name}: collective must be one of {COLLECTIVE_KINDS}, got {self.collective!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CompiledTransposes:
    """The transposing kernels of one device's step as its compiler wrote them (testbed.runner.hlo_transposes reads
    XLA:CPU's compiled HLO), per step: ``moved_bytes`` (read and written) and ``kernels`` (executions) of those that
    only move data, which the fusion estimate prices as free (a transpose folded into its consumer); ``fused_bytes``
    of those whose bytes the fusion estimate prices as a plain pass (they also compute, or hold a move the tracer
    prices: a weight's ``reverse``)."""

    moved_bytes: float = 0.0
    kernels: int = 0
    fused_bytes: float = 0.0

    def __post_init__(self) -> None:
        if min(self.moved_bytes, self.fused_bytes) < 0 or self.kernels < 0 or not all(
                math.isfinite(x) for x in (self.moved_bytes, self.fused_bytes)):
            raise ValueError(f"transposes' bytes and kernels must be finite and >= 0, got {self}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """A traced step: the mesh it was partitioned for, one device's ops, and what the tracer assumed.

    ``mesh`` maps axis names to sizes in mesh order (device ``i`` is the ``i``-th coordinate in
    row-major order, as ``jax.make_mesh`` numbers them). ``dtype`` is the compute dtype the matmuls
    run in (the most common operand type of the dots). ``assumptions`` are the tracer's stated
    approximations of ops it could not price exactly; ``memory`` its per-device memory estimate
    (bytes; ``method`` names how it was made); ``buffers`` the device buffers one dispatch of the step
    passes (its argument arrays, for a controller's calibrated per-buffer cost); ``loops`` each loop the tracer
    unrolled, its iterations' ``TracedOp.iteration`` numbers in order (XLA runs one iteration's body at a time:
    testbed.sim.graph.traced_graph starts an iteration once the one before it, inner loops included, has ended);
    ``transposes`` the transposing kernels of the compiled step where it was compiled (None: not read, priced free).
    """

    name: str
    mesh: dict[str, int]
    ops: tuple[TracedOp, ...]
    dtype: str = "fp32"
    assumptions: tuple[str, ...] = ()
    memory: dict = field(default_factory=dict)
    buffers: int = 0
    loops: tuple[tuple[int, ...], ...] = ()
    transposes: CompiledTransposes | None = None

    def __post_init__(self) -> None:
        if self.transposes is not None and not isinstance(self.transposes, CompiledTransposes):
            raise TypeError(f"workload {self.name!r}: transposes must be CompiledTransposes or None")
        if not self.mesh or any(int(n) < 1 for n in self.mesh.values()):
            raise InputError(f"workload {self.name!r}: mesh must map axis names to sizes >= 1, got {self.mesh}")
        for i, op in enumerate(self.ops):
            if any(not 0 <= d < i for d in (*op.deps, *op.barrier)):
                raise ValueError(f"op {i} ({op.name}) depends on a later or missing op: {op.deps}")
            if op.kind is OpKind.COLLECTIVE and not set(op.axes) <= set(self.mesh):
                raise ValueError(f"op {i} ({op.name}) runs over axes {op.axes} not all in the mesh {list(self.mesh)}")
        for loop in self.loops:
            if min(loop, default=1) < 1 or list(loop) != sorted(set(loop)):
                raise ValueError(f"a loop's iterations must be increasing numbers >= 1, got {loop}")

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    def readers(self) -> list[list[int]]:
        """Per op, the ops that read its result, in program order (what the ordering passes and the tracer's
        segments follow)."""
        out: list[list[int]] = [[] for _ in self.ops]
        for i, op in enumerate(self.ops):
            for d in op.deps:
                out[d].append(i)
        return out

    def flops(self) -> float:
        """Matmul and convolution FLOPs of one device's step."""
        return sum(op.flops * op.count for op in self.ops)

    def collective_bytes(self) -> dict[str, dict[str, float]]:
        """Per axes label (``data+fsdp``) and kind: bytes per device per step (executions x bytes)."""
        out: dict[str, dict[str, float]] = {}
        for op in self.ops:
            if op.kind is OpKind.COLLECTIVE and op.group > 1:
                row = out.setdefault("+".join(op.axes), {})
                row[op.collective] = row.get(op.collective, 0.0) + op.nbytes * op.count
        return out

    def summary(self) -> dict:
        """JSON-ready totals: ops by kind, FLOPs, HBM bytes, collective bytes per axis, assumptions."""
        kinds = {k.value: sum(op.count for op in self.ops if op.kind is k) for k in OpKind}
        return {"name": self.name, "mesh": dict(self.mesh), "devices": self.devices, "dtype": self.dtype,
                "ops": kinds, "flops_per_device": self.flops(),
                "hbm_bytes_per_device": sum(op.hbm_bytes * op.count for op in self.ops),
                "collective_bytes": self.collective_bytes(), "assumptions": list(self.assumptions),
                "memory": dict(self.memory)}
