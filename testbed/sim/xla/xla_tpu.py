"""What XLA:TPU does to a step's collectives that the plan's own program does not say: rules keyed by the compiler.

Each rule holds where the topology's device follows XLA:TPU (``device.buffer_rules: xla-tpu``) and is read from
XLA:TPU's own compiles (libtpu 0.0.42): the probes of benchmarks/xla_tpu_probes/ and the recorded plans of
benchmarks/xla_tpu/ (testbed.compiled.compare sets the task graph's collectives beside theirs). The probes and
recorded plans behind each rule: docs/xla_tpu.md, "XLA:TPU's collectives, probed".

- :func:`scatters_as_allreduce`: a reduce-scatter over every chip of a v5e 4x4 or 8x8 slice (a 1-D or a 2-D mesh)
  or of a v5p 2x2x2 slice is an all-reduce of the whole buffer (the same bytes per device), merged by the
  all-reduce combiner; over part of a slice and over every chip of a v5e 2x4 slice it stays a reduce-scatter (a
  v5e 2x2 slice's choice depends on the operand: not modelled).
- :func:`packs_allreduces` (testbed.model.block_scatters' ``packed``, testbed.sim.xla.combine's ``packs``): the
  gradients' all-reduces are walked in the parameters' pytree order and each merge takes every next gradient that
  still fits 120 MiB, passing over those that do not; one over the bound alone is never merged.
- :func:`merges_shard_sums`, :func:`merged_shard_sums`, :func:`shard_sum_count` (HSDP): the all-reduces of the
  reduce-scattered gradient shards over the axes the optimizer state is replicated on (data beside fsdp) are merged
  by the all-reduce combiner across the whole backward, packed to its bound: one all-reduce after the last
  gradient's reduce-scatter where the plan's buckets would issue one each (llama2k-data8-fsdp8-selective on v5p
  4x4x4: one data all-reduce of the 54.5 MB of shards, against 15 buckets).
- :func:`merges_loss`: an fp32 loss rides in the gradients' all-reduce where that is one over the loss's axes.
- :func:`gather_allreduce_bytes`, :func:`gather_lowering`: a whole slice's all-gather of a small buffer is an
  all-reduce of the zero-padded buffer, merged by the all-reduce combiner as testbed.model.gather_lowering says:
  over every chip of a v5e 8x8, 8x16 or 16x16 slice up to 16 MiB (as the buffer's tiles hold it), of a v5p 4x4x4,
  4x4x8 or 8x8x16 slice any size probed (to 256 MiB); over a v5e 4x4 or 4x8, a v5p 2x4x4 or 2x2x4, or part of a
  slice, none.
- :func:`regathers_for_recompute`: under ``remat: full`` a layer's backward gathers the leaves its recomputed
  forward reads, apart from those its gradients read: every leaf but ``mlp/w2`` and ``mlp/b2``, whose output only
  joins the residual sum (the recomputation stops before it).
- :func:`narrows_gathers`, :func:`matmul_gather_bytes`: under fp32 a weight read only by default-precision matmuls
  is gathered in bf16 (testbed.model.blocks.narrowed: every weight matrix of a layer, the head's in the backward);
  the norms' scales, the token table and the head's forward gather (whose copy the loss's piece also reads:
  testbed.runner.param_shards' corner) stay fp32.
- :func:`sequence_gather_bytes`: so is an fp32 activation every reader of which is a default-precision matmul
  (benchmarks/xla_tpu_narrowing.py): sequence parallelism's all-gathers (testbed.sim.step.action_work
  .tensor_transfers) but the embedding backward's (the lookup's cotangent) and the position table's gradient's.
- :func:`vector_gather_lowers`, :func:`lowers_vectors`: a rank-1 reduce-scatter, and a rank-1 all-gather whose
  shard is not whole 128-lane rows (64 or 96 elements a device; 128 and 256 stay all-gathers), is an all-reduce
  over a whole slice or part of one, merged by the all-reduce combiner (benchmarks/xla_tpu_vectors.py). A plan's
  rank-1 leaves and those held flat (ParamSpec.padded) follow it: their gathers merged as the whole slice's small
  gathers are, their gradients' reduce-scatters one all-reduce at the backward's end
  (testbed.model.block_scatters.scatter_ops). So do the weight matrices whose gradient's shard is not whole tiles
  of its layout (testbed.model.scatter_lowering: one 128-lane bf16 row, or a few rows), merged with them.
- :func:`scatters_whole_sequence`: a sequence-parallel reduce-scatter over tensor of an activation holding one
  sequence a device (``[1, seq, d]`` split along the sequence) is an all-reduce of the whole activation, of two
  sequences a reduce-scatter, on every slice probed (4 of a v5e 2x2, 4 of 4x4, 4 of 8x8, 4 of 16x16, 8 of a v5p
  4x4x4: ``benchmarks/xla_tpu_sequence_scatters.py``'s 13 probes; gpt2k-fsdp8-tensor8-sp,
  llama4k-fsdp64-tensor4-sp), and over every chip of a slice :func:`scatters_as_allreduce` names an all-reduce
  at any batch (v5p 2x2x2, v5e 4x4; v5e 2x4 and 2x2 stay reduce-scatters). A traced program's by their shapes
  (``TracedOp.sequence``, :func:`lowered_scatters`).
- :func:`keeps_recomputed_gathers` (:func:`regathers_sequence` for a plan, :func:`regathered` for a traced program):
  where a checkpoint recomputes layers, the backward gathers each of the forward's activation all-gathers again (the
  recomputation's inputs sit behind an optimization barrier); a parameter's gather is not repeated. The copies run
  blocking, in program order with the compute.

A traced program (testbed.sim.graph.traced) follows the gather rules by the same functions (:func:`lowered_gathers`:
:func:`gather_element_bytes` for a gather every reader of which is a matmul, :func:`lowering_of` and
testbed.model.gather_lowering.lowers for a whole slice's small gather, :func:`vector_gather_lowers` for a rank-1 one:
TracedOp.vector) and the reduce-scatter rules by :func:`lowered_scatters`.

Pure: no JAX.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from testbed.model.gather_lowering import NO_LOWERING, Lowering, lowers
from testbed.model.leaves import RECOMPUTE_SKIPS
from testbed.plan.spec import MeshSpec, Plan
from testbed.topology.parts import Form, LinkKind
from testbed.sim.xla.workload import OpKind, element_bytes
from testbed.topology.spec import Topology

if TYPE_CHECKING:
    from testbed.sim.xla.workload import Workload

__all__ = ["scatters_as_allreduce", "packs_allreduces", "merges_shard_sums", "merged_shard_sums", "shard_sum_count", "keeps_recomputed_gathers", "regathers_sequence", "regathered", "scatters_whole_sequence",
           "lowered_reductions", "accumulate_op", "lowered_scatters", "merges_loss",
           "regathers_for_recompute", "narrows_gathers", "matmul_gather_bytes", "MATMUL_GATHER_BYTES",
           "sequence_gather_bytes",
           "gather_element_bytes", "lowered_gathers",
           "gather_allreduce_bytes", "gather_lowering", "lowering_of", "V5E_GATHER_ALLREDUCE_BYTES", "RECOMPUTE_SKIPS",
           "VECTOR_LANES", "vector_gather_lowers", "lowers_vectors"]

#: Bytes per element of a weight matrix XLA:TPU gathers for matmuls of the backend's default precision (one bf16
#: pass: the operand rounded to bf16, the rounding moved before the all-gather).
MATMUL_GATHER_BYTES = 2.0

def scatters_as_allreduce(topology: Topology) -> bool:
    """Whether a reduce-scatter over every device of ``topology`` compiles to an all-reduce (module docstring): an
    XLA:TPU slice (one torus of ICI links) of a 3-D torus, or of 2-D one whose every dim spans 4+ chips."""
    if topology.device.buffer_rules != "xla-tpu" or topology.form is not Form.TORUS:
        return False
    levels = topology.levels
    if any(level.switched or level.kind is not LinkKind.ICI for level in levels):
        return False
    dims = [level.size for level in levels if level.size > 1]
    return len(dims) >= 3 or (len(dims) == 2 and min(dims) >= 4)


def packs_allreduces(topology: Topology) -> bool:
    """Whether the compiler packs the all-reduces (the gradients', the loss's) to its combiner's bound, each merge
    taking every next one that still fits in the parameters' pytree order (module docstring): where
    :func:`scatters_as_allreduce` (the recorded evidence: whole XLA:TPU slices)."""
    return scatters_as_allreduce(topology)


def keeps_recomputed_gathers(topology: Topology) -> bool:
    """Whether a checkpoint's recomputation gathers the forward's activations again rather than reuse the forward's
    all-gathers (module docstring): XLA:TPU's rule, both tiers' (:func:`regathers_sequence`, :func:`regathered`)."""
    return topology.device.buffer_rules == "xla-tpu"


def regathers_sequence(plan: Plan, xla_tpu: bool) -> bool:
    """Whether the backward gathers each of the forward's sequence-parallel all-gathers again (module docstring):
    where :func:`keeps_recomputed_gathers` (``xla_tpu``; the same test as :func:`narrows_gathers`, whose flag the
    plan's action facts carry), with sequence parallelism over 2+ tensor ranks. The runner's column-parallel maps
    run in a checkpoint that keeps only the sequence shard (testbed.runner.parallel.SequenceShards.column, as
    Megatron gathers again for the weight gradient), so every such step's backward reads its gathers through a
    checkpoint's barrier, with or without remat: the recorded plans hold them under selective and full remat and
    under fsdp without remat (gpt2k-fsdp16-tensor4-sp, gpt2k-fsdp8-tensor8-sp)."""
    return xla_tpu and plan.sequence_parallel and plan.mesh.tensor > 1


def scatters_whole_sequence(plan: Plan, xla_tpu: bool, whole_slice: bool = False) -> bool:
    """Whether sequence parallelism's reduce-scatters over tensor (testbed.sim.step.action_work.tensor_transfers: the
    row-parallel outputs' and the input gradients') are all-reduces of the whole activation (module docstring):
    where ``xla_tpu`` (the same flag as :func:`regathers_sequence`) and a device holds one sequence a microbatch, or
    the tensor axis spans every device where ``whole_slice`` (:func:`scatters_as_allreduce` of the topology)."""
    if not (xla_tpu and plan.sequence_parallel and plan.mesh.tensor > 1):
        return False
    return plan.microbatch_size == 1 or (whole_slice and plan.mesh.tensor == plan.mesh.size)


def lowered_reductions(reductions: tuple, mesh: MeshSpec, whole_slice: bool) -> tuple:
    """``reductions`` (testbed.sim.step.update_facts.Reduction) with ``scatter_op`` ``all_reduce`` where
    ``whole_slice`` (:func:`scatters_as_allreduce` of the topology) and the reduce-scatter spans every device of
    the mesh."""
    if not whole_slice:
        return reductions
    return tuple(replace(r, scatter_op="all_reduce") if accumulate_op(r.sharded, mesh, True) == "all_reduce" else r
                 for r in reductions)


def accumulate_op(axes: tuple, mesh: MeshSpec, whole_slice: bool) -> str:
    """The collective gradients are reduce-scattered with over ``axes`` (an earlier microbatch's into the sharded
    accumulator, or the step's, :func:`lowered_reductions`): ``all_reduce`` where ``whole_slice`` and ``axes`` span
    every device of the mesh, else ``reduce_scatter``."""
    spans = bool(axes) and math.prod(mesh.degree(a) for a in axes) == mesh.size
    return "all_reduce" if whole_slice and spans else "reduce_scatter"


def lowered_scatters(workload: "Workload", whole_slice: bool, vectors: bool = False,
                     sequences: bool = False) -> "Workload":
    """A traced program's ``workload`` with each reduce-scatter over every device of its mesh an all-reduce of the
    same bytes where ``whole_slice`` (:func:`scatters_as_allreduce` of the topology), each of rank-1 buffers
    where ``vectors`` (:func:`lowers_vectors`), and each of an activation of one sequence a device
    (``TracedOp.sequence``) where ``sequences`` (XLA:TPU, :func:`keeps_recomputed_gathers`): the rules
    :func:`lowered_reductions`, testbed.model.blocks.scatter_ops and :func:`scatters_whole_sequence` apply to a
    plan, for the traced tier."""
    if not whole_slice and not vectors and not sequences:
        return workload
    ops = tuple(replace(op, collective="all_reduce", name=op.name.replace("reduce_scatter", "all_reduce", 1))
                if op.collective == "reduce_scatter" and (
                    (whole_slice and op.group == workload.devices) or (vectors and op.vector)
                    or (sequences and op.sequence)) else op
                for op in workload.ops)
    return replace(workload, ops=ops) if ops != workload.ops else workload


def merges_shard_sums(topology: Topology) -> bool:
    """Whether the all-reduce combiner merges the gradient shards' all-reduces over the replicated axes (HSDP's
    data all-reduces) across the whole backward into as few as its bound holds, after the last reduce-scatter
    (module docstring): XLA:TPU's rule, where its all-reduce combiner has a bound
    (``calibration.collectives.allreduce_combine_bytes``)."""
    return (topology.device.buffer_rules == "xla-tpu"
            and topology.calibration.collectives.allreduce_combine_bytes is not None)


def merged_shard_sums(reductions: tuple, merges: bool) -> tuple:
    """``reductions`` (testbed.sim.step.update_facts.Reduction) with ``rest_merged`` where ``merges``
    (:func:`merges_shard_sums`) and the dense gradients are reduce-scattered, then their shards all-reduced over
    ``rest``: those all-reduces leave the buckets for the stage's merged ones (StepFacts.shard_sums)."""
    if not merges:
        return reductions
    return tuple(replace(r, rest_merged=True) if r.sharded and r.rest and not (r.expert or r.sequence) else r
                 for r in reductions)


def shard_sum_count(nbytes: float, allreduce_bytes: float | None) -> int:
    """How many all-reduces the combiner packs a stage's ``nbytes`` of gradient shards into (:func:`merges_shard_sums`):
    as many as its bound ``allreduce_bytes`` needs (None: one); the members (one leaf's shard each, at most the
    reduce-scatter combiner's bound over the fsdp ways) are small beside it."""
    if nbytes <= 0:
        return 0
    return 1 if allreduce_bytes is None else max(1, math.ceil(nbytes / allreduce_bytes))


def merges_loss(reductions: tuple, vectors: bool = False) -> bool:
    """Whether the dense gradients' sum is one all-reduce over the axes the loss sums over (:func:`lowered_reductions`:
    a whole slice's reduce-scatter, nothing summed after it), which the combiner lets an fp32 loss join
    (testbed.plan.sharding.loss_merged; llama2k-fsdp16-fp32-selective: the loss's 4 bytes in a gradient all-reduce);
    or, with ``vectors`` (the rank-1 gradients' reduce-scatters one all-reduce: testbed.model.block_scatters.
    scatter_ops), those sharded over every axis the loss sums over (llama2k-fsdp4-fp32 over a v5e 2x2 slice: the
    loss's 4 bytes in the norms' fp32 all-reduce over fsdp)."""
    return any((r.scatter_op == "all_reduce" or (vectors and r.sharded)) and not r.rest and not (r.expert or r.sequence)
               for r in reductions)


def narrows_gathers(topology: Topology) -> bool:
    """Whether the compiler gathers weight matrices in the dtype their matmuls read (module docstring; the bytes:
    :func:`matmul_gather_bytes`): XLA:TPU's rule."""
    return topology.device.buffer_rules == "xla-tpu"


def matmul_gather_bytes(plan: Plan, param_bytes: float) -> float:
    """Bytes per element the sharded weight matrices' all-gathers move where :func:`narrows_gathers`
    (testbed.model.blocks.narrowed; 0: the parameters' own ``param_bytes``): :func:`gather_element_bytes` at the
    plan's ``runtime.matmul_precision``."""
    return gather_element_bytes(param_bytes, plan.runtime.matmul_precision)


def sequence_gather_bytes(plan: Plan, nbytes: int, narrows: bool) -> int:
    """Bytes of each of a chunk's sequence-parallel all-gathers that only matmuls read (``nbytes``: the compute
    dtype's, ChunkCost.tensor_allreduce_bytes) where ``narrows`` (:func:`narrows_gathers`): :func:`gather_element_bytes`
    of the compute dtype at the plan's ``runtime.matmul_precision`` (module docstring); 0: not narrowed."""
    c = plan.precision.compute_bytes
    narrowed = matmul_gather_bytes(plan, float(c)) if narrows and plan.sequence_parallel else 0.0
    return int(nbytes * narrowed / c) if narrowed else 0


def gather_element_bytes(param_bytes: float, precision: str = "default") -> float:
    """Bytes per element XLA:TPU gathers a weight of ``param_bytes``-byte elements in where only matmuls at
    ``precision`` read it (0: its own): with elements wider than bf16 (fp32 training) and matmuls of the default
    precision, :data:`MATMUL_GATHER_BYTES`. The plan's gathers (:func:`matmul_gather_bytes`) and a traced
    program's (:func:`lowered_gathers`) are narrowed by this one rule."""
    if param_bytes <= MATMUL_GATHER_BYTES or precision == "highest":
        return 0.0
    return MATMUL_GATHER_BYTES


#: The largest gathered buffer (bytes per device, as its tiles hold it: rows padded to 128 lanes) an all-gather over
#: every chip of a v5e slice of 8+ chips a side compiles to an all-reduce of (benchmarks/xla_tpu_probes/
#: collectives.json: 16 MiB on 8x8, 8x16 and 16x16, 16.5 MiB not; 32 lanes wide, 4 MiB on 8x16 and 4.06 MiB not).
#: Smaller v5e slices (4x4, 2x4, 4x8 probed): none. testbed counts a leaf's own bytes, its rows a multiple of 128
#: lanes in the recorded models.
V5E_GATHER_ALLREDUCE_BYTES = 16 * 2 ** 20


def gather_allreduce_bytes(topology: Topology) -> float:
    """The largest buffer an all-gather over every device of ``topology`` compiles to an all-reduce of (module
    docstring; 0: none): on a v5e slice of 8+ chips a side :data:`V5E_GATHER_ALLREDUCE_BYTES`; on a 3-D slice every
    dim of which spans 4+ chips, any (v5p 4x4x4, 4x4x8, 8x8x16 probed up to 256 MiB; 2x2x2, 2x2x4, 2x4x4 none)."""
    if topology.device.buffer_rules != "xla-tpu" or topology.form is not Form.TORUS:
        return 0.0
    if any(level.switched or level.kind is not LinkKind.ICI for level in topology.levels):
        return 0.0
    dims = tuple(sorted(level.size for level in topology.levels if level.size > 1))
    if len(dims) >= 3:
        return math.inf if dims[0] >= 4 else 0.0
    v5e = "v5e" in topology.device.name.lower()
    return float(V5E_GATHER_ALLREDUCE_BYTES) if v5e and len(dims) == 2 and dims[0] >= 8 else 0.0


def gather_lowering(topology: Topology, plan: Plan, ways: int) -> Lowering:
    """The gathers of ``plan``'s parameters (sharded ``ways`` ways) that compile to all-reduces, merged by the
    all-reduce combiner (testbed.model.gather_lowering): over a whole slice (every device of the mesh),
    :func:`gather_allreduce_bytes`, none by size over part of one (the probes: 16 or 64 of 256 chips, 16 of 64);
    the misaligned rank-1 leaves over any part of an XLA:TPU slice (:func:`vector_gather_lowers`)."""
    return lowering_of(gather_allreduce_bytes(topology), topology.calibration.collectives.allreduce_combine_bytes,
                       ways, plan.mesh.size, VECTOR_LANES if lowers_vectors(topology) else 0)


def lowering_of(bound: float, allreduce_bytes: float | None, ways: int, devices: int, lanes: int = 0) -> Lowering:
    """:func:`gather_lowering` of gathers over ``ways`` of a mesh's ``devices`` from the topology's ``bound``
    (:func:`gather_allreduce_bytes`) and its all-reduce combiner's bound (None: unbounded): by size none unless
    ``ways`` is every device; the rank-1 leaves whose shards are not whole rows of ``lanes`` elements over any
    part of a slice (:func:`vector_gather_lowers`; 0: none)."""
    combined = math.inf if allreduce_bytes is None else float(allreduce_bytes)
    if not bound or ways != devices:
        return Lowering(0.0, combined, lanes) if lanes and ways > 1 else NO_LOWERING
    return Lowering(bound, combined, lanes)


def lowered_gathers(workload: "Workload", topology: Topology) -> "Workload":
    """A traced program's ``workload`` with its all-gathers as XLA:TPU compiles them on ``topology``: the rules the
    plan's gathers follow (module docstring), for the traced tier. Where :func:`narrows_gathers`, an all-gather
    every reader of which is a matmul moves :func:`gather_element_bytes` per element (the traced tier prices every
    matmul at the default precision: testbed.sim.graph.traced.matmul_dtype); then one over every device of the mesh
    that :func:`lowering_of` lowers (testbed.model.gather_lowering.lowers), and one of a rank-1 buffer
    :func:`vector_gather_lowers` lowers over any devices, is an all-reduce of the same bytes, which
    testbed.sim.xla.combine's all-reduce combiner merges by data flow, as XLA's does."""
    narrow, readers = narrows_gathers(topology), workload.readers()
    bound = gather_allreduce_bytes(topology)
    allreduce_bytes = topology.calibration.collectives.allreduce_combine_bytes
    ops = list(workload.ops)
    for i, op in enumerate(ops):
        if op.kind is not OpKind.COLLECTIVE or op.collective != "all_gather":
            continue
        width = element_bytes(op.element) if op.element else 0
        narrowed = gather_element_bytes(width) if narrow and width and readers[i] and all(
            workload.ops[r].kind is OpKind.GEMM for r in readers[i]) else 0.0
        if narrowed:
            op = replace(op, nbytes=op.nbytes * narrowed / width, element="bf16")
        vector = lowers_vectors(topology) and op.vector and vector_gather_lowers(op.vector)
        if vector or lowers(op.nbytes, lowering_of(bound, allreduce_bytes, op.group, workload.devices)):
            op = replace(op, collective="all_reduce", name=op.name.replace("all_gather", "all_reduce", 1),
                         combiner="gather")
        ops[i] = op
    ops_t = tuple(ops)
    return replace(workload, ops=ops_t) if ops_t != workload.ops else workload


def regathered(workload: "Workload", topology: Topology) -> "Workload":
    """A traced program's ``workload`` with, where :func:`keeps_recomputed_gathers`, each all-gather of a value the
    step computed (one with ``deps``; a parameter's is reused) that a checkpoint's recomputation reads
    (``TracedOp.again``) issued again just before the first such reader, once what that reader's optimization barrier
    waits for is done (``TracedOp.barrier``: XLA schedules nothing behind a barrier before it), those readers reading
    the copy, and held (``TracedOp.held``: it runs blocking, module docstring); elsewhere the forward's read, as traced.
    Every op's ``again`` and ``barrier`` are spent (empty) in the result: the passes after this one
    (testbed.sim.xla.combine, overlap) renumber the ops without them. It runs after testbed.sim.xla.xla_tpu's
    gather lowering (:func:`lowered_gathers`), whose narrowing reads each gather's readers by data flow: a copy's
    barrier is no reader of what it waits for."""
    ops = workload.ops
    readers: dict[int, list[int]] = {}
    for i, op in enumerate(ops):
        for f in op.again:
            if ops[f].kind is OpKind.COLLECTIVE and ops[f].collective == "all_gather" and ops[f].deps:
                readers.setdefault(f, []).append(i)
    if not any(op.again for op in ops):
        return workload
    before: dict[int, list[int]] = {}
    for f, rs in (readers.items() if keeps_recomputed_gathers(topology) else ()):
        before.setdefault(rs[0], []).append(f)
    index: dict[int, int] = {}
    again: dict[int, int] = {}  # forward gather -> its copy's index
    out: list = []
    for i, op in enumerate(ops):
        for f in sorted(before.get(i, ())):
            again[f] = len(out)
            wall = set(ops[f].deps) | set(ops[i].barrier)
            out.append(replace(ops[f], deps=tuple(sorted(index[d] for d in wall)), again=(), barrier=(), held=True))
        index[i] = len(out)
        copied = {d for d in op.again if d in again}
        out.append(replace(op, deps=tuple(sorted(again[d] if d in copied else index[d] for d in op.deps)), again=(),
                           barrier=()))
    return replace(workload, ops=tuple(out))


def regathers_for_recompute(topology: Topology) -> bool:
    """Whether a full-remat layer's backward gathers the leaves its recomputation reads apart from its gradients'
    (module docstring): XLA:TPU's rule."""
    return topology.device.buffer_rules == "xla-tpu"


#: The lanes of a TPU vector register row: a rank-1 buffer's tiles hold 128-element rows (``T(1024)(128)`` and
#: ``T(256)(128)`` layouts in the compiled HLO).
VECTOR_LANES = 128


def vector_gather_lowers(shard_elements: int) -> bool:
    """Whether XLA:TPU compiles the all-gather of a rank-1 buffer of ``shard_elements`` per device to an all-reduce
    of the zero-padded vector (merged by the all-reduce combiner; module docstring): where the shard is not a whole
    number of :data:`VECTOR_LANES` rows. benchmarks/xla_tpu_probes/vectors.json: shards of 64 and 96 elements
    all-reduced, of 128 and 256 gathered, over whole v5e 2x2 and 4x4 and v5p 2x2x2 slices and over part of v5e 4x4
    and 8x8 ones, bf16 and fp32; the recorded plans' norms (llama4k-fsdp256-tensor4: 16 elements a device) and
    biases (gpt2k-fsdp16-tensor4-sp: ``attn/b_qkv``, 96) agree."""
    return shard_elements % VECTOR_LANES != 0


def lowers_vectors(topology: Topology) -> bool:
    """Whether the compiler lowers rank-1 gathers and reduce-scatters as all-reduces (:func:`vector_gather_lowers`,
    :func:`vector_scatters_as_allreduce`): XLA:TPU's rule."""
    return topology.device.buffer_rules == "xla-tpu"
