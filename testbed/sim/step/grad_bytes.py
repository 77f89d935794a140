"""The bytes of a chunk's gradients: how many buckets they reduce in, the bytes per value they are reduced in, what
sequence parallelism's tensor-replicated parameters add, and what adding a microbatch into the accumulator streams.

Rules of a plan's gradients that testbed.sim.step.facts works into each chunk's facts, and that the task graph
(testbed.sim.graph.program, testbed.sim.graph.grad_tasks) and the analytic tier (testbed.explore.analytic) read as they are:
one place for each, so the two tiers move the same bytes.
"""

from __future__ import annotations

import math

from dataclasses import replace

from testbed.model.costs import ChunkCost
from testbed.model.gemm import ChunkGemms
from testbed.model.layout import Part, chunk_params, tied_table
from testbed.model.leaves import NORM_PARTS, norm_elements
from testbed.model.memory import state_bytes_per_param
from testbed.plan.sharding import state_sharding
from testbed.plan.spec import Plan

__all__ = ["BUCKETS", "ACCUMULATE_PASSES", "FUSED_ACCUMULATE_PASSES", "FP32_ACCUMULATE_BYTES", "reduce_bytes", "reduced_bytes",
           "summed_after_the_loop", "summed_each_microbatch", "sequence_replicated", "sequence_apart", "sequence_reduced",
           "summed_in_the_step", "token_table_last", "without_embedding_gathers", "gradient_buckets",
           "accumulate_bytes", "accumulated_in_the_backward", "accumulated_bytes", "accumulating_gemms",
           "accumulated_elements", "in_last_span",
           "tied_copy_bytes"]

#: Most gradient buckets per chunk (split of the chunk's last backward action).
BUCKETS = 4
#: Memory passes of adding one microbatch's gradients into the step's accumulator: read both, write one (an
#: unfused add, as Megatron-LM's autograd accumulation into ``param.grad`` and XLA's accumulation loops run it).
ACCUMULATE_PASSES = 3
#: Memory passes of the add where the compiler fuses it into the weight gradient's matmul (XLA:TPU,
#: testbed.topology.DeviceSpec.fused_updates): the matmul reads the accumulator and writes the sum in place of the
#: gradient, one read more than its own. The v5e chip's compiled loop body (benchmarks/tpu_chip/accumulate.json, the
#: runner's gpt125m step at 16 microbatches): every weight gradient's matmul is a ``kOutput`` fusion of the
#: convolution and the add into the loop-carried accumulator.
FUSED_ACCUMULATE_PASSES = 1
#: Bytes per parameter of ``runtime.grad_accumulate_fp32``'s two kernels a microbatch: the fp32 copy of the
#: compute-dtype gradient (read 2, write 4) and its add into the fp32 accumulator (read 4 + 4, write 4).
FP32_ACCUMULATE_BYTES = 2 + 4 + 4 + 4 + 4


def reduce_bytes(plan: Plan, grad_bytes: float) -> float:
    """Bytes per gradient value as they are reduced (``runtime.grad_reduce_dtype``: their own, or fp32's 4)."""
    return 4.0 if plan.runtime.grad_reduce_dtype == "fp32" else float(grad_bytes)


def tied_copy_bytes(plan: Plan, reduce_b: float) -> float:
    """Bytes per device of the tied token table's gradient summed between the first stage's table and the last
    stage's copy each step, after the replicas' sums and before the optimizer (Megatron-LM
    ``finalize_model_grads._allreduce_embedding_grads``: an all-reduce over the ``embd_group`` of each pipeline's
    first and last rank); ``reduce_b`` per value, of the table's share a device holds (its tensor split, and the
    gradient's sharding where it is sharded). 0 without tied embeddings across stages."""
    if not plan.model.tied_embeddings or plan.mesh.stage == 1:
        return 0.0
    return tied_table(plan.model).device_elements(plan.mesh.tensor, state_sharding(plan).ways(plan, "grads")) * reduce_b


def reduced_bytes(plan: Plan, s: int, c: int, moved: int, reduce_b: float, which: str, native: bool = False) -> float:
    """Bytes one reduction of chunk ``c``'s gradients moves on a device (``moved`` elements sharded as ``which``):
    ``reduce_b`` per value, but where the partitioner sums replicated gradients (nothing shards them) the norms'
    parameters' reduce in fp32 (testbed.model.leaves.NORM_PARTS: JAX sums bf16 in fp32 and the partitioner
    reduces the fp32 partial sums), 4 bytes each. Sharded gradients are reduce-scattered by the runner's own
    ``psum_scatter`` of the bf16 gradient (testbed.runner.param_shards, testbed.runner.replicas). ``native``: the
    compiler reduces bf16 in bf16 (XLA:TPU, testbed.topology.DeviceSpec.native_reductions), the norms' too."""
    if native or reduce_b >= 4.0 or state_sharding(plan).split_axes(plan, "grads") or summed_after_the_loop(plan):
        return moved * reduce_b
    return moved * reduce_b + norm_elements(plan, s, c, which) * (4.0 - reduce_b)


def summed_after_the_loop(plan: Plan) -> bool:
    """Whether the data replicas' gradients are accumulated apart over a microbatch loop and summed after it
    (testbed.runner.step._accumulated, testbed.runner.replicas.sum_replicas): in the accumulator's dtype, the
    norms' parameters' too, where the partitioner's sum of one microbatch's gradients reduces the norms' fp32
    partial sums (:func:`reduced_bytes`). JAX's one SPMD step only: pipelines, whose stages also sum the
    replicas after the microbatches, and eager loops (``runtime.microbatch_scan`` false) are not counted here (no
    traced step checks them)."""
    return plan.batch.microbatches > 1 and plan.mesh.stage == 1 and plan.runtime.microbatch_scan


def sequence_replicated(plan: Plan) -> bool:
    """Whether sequence parallelism's tensor-replicated parameters (norms, row-parallel biases) sum their
    gradients over tensor too: each tensor rank computes on its sequence shard, so their gradients are partial
    sums over tensor as well as over the batch axes (Megatron-LM all-reduces them over the tensor group; the
    runner's partitioner reduces them over data and tensor in one all-reduce). Counted where nothing shards the
    optimizer state (the case checked against the traced step; under fsdp/ZeRO the plan keeps the dense rule)."""
    return plan.sequence_parallel and plan.mesh.tensor > 1 and not state_sharding(plan).split_axes(plan, "optimizer")


def summed_each_microbatch(plan: Plan) -> bool:
    """Whether, in JAX's one SPMD step over more than one microbatch, the tensor-replicated parameters' gradients
    of sequence parallelism are summed over tensor alone every microbatch, as that microbatch's compute ends.
    Under :func:`sequence_replicated` (data replicas summed after the loop, :func:`summed_after_the_loop`) the
    loop's accumulators are each replica's whole gradients, replicated over tensor, so the partitioner sums the
    tensor ranks' partial sums of each microbatch's (the norms' in fp32) before the add; the replicas' sum after
    the loop carries them with the rest in the accumulator's dtype, and the position table's gradient whole
    (gathered over tensor in the loop). Under :func:`sequence_apart` (fsdp) each microbatch's gradients are
    reduce-scattered in the loop, each after its own sum over tensor. The traced runner step moves these bytes
    (tests/test_program_vs_plan.py)."""
    return (sequence_replicated(plan) or sequence_apart(plan)) and summed_after_the_loop(plan)


def sequence_apart(plan: Plan) -> bool:
    """Whether, with the parameters sharded (fsdp, ZeRO-3) under sequence parallelism, the tensor-replicated
    parameters' gradients are all-reduced whole over tensor on their own before their reduce-scatter with the rest:
    testbed.runner.param_shards reduce-scatters each gathered leaf's gradient over the batch axes in its map, and
    the partitioner sums the tensor ranks' partial sums first (the norms' in fp32). The traced runner step moves
    exactly these bytes (tests/test_program_vs_plan.py)."""
    return plan.sequence_parallel and plan.mesh.tensor > 1 and bool(state_sharding(plan).split_axes(plan, "params"))


def sequence_reduced(plan: Plan, s: int, c: int, reduce_b: float, native: bool = False) -> tuple[float, float]:
    """(bytes of chunk ``c``'s tensor-replicated parameters' gradients, reduced over tensor too; bytes the position
    table's reduction saves) under :func:`sequence_replicated` or :func:`sequence_apart`, else zeros (nothing
    saved under the latter). The norms' at 4 bytes each unless ``native``
    (:func:`reduced_bytes`). The learned position table's gradient is reduced as each tensor rank's 1/t shard of
    the positions (the runner adds positions to its sequence shard), then gathered over tensor
    (testbed.model.costs.ChunkCost.position_gather_bytes)."""
    apart = sequence_apart(plan)
    if not apart and not sequence_replicated(plan):
        return 0.0, 0.0
    t, replicated, saved = plan.mesh.tensor, 0.0, 0.0
    held = chunk_params(plan.model, s, c, plan.mesh.stage, plan.schedule.virtual_stages, stage_layers=plan.stage_layers)
    for q, copies in held:
        if q.part is Part.EMBEDDING:
            positions = q.path == ("positions",) and not apart and not summed_each_microbatch(plan)
            saved += copies * q.device_elements(t, 1, 1) * reduce_b * (1 - 1 / t) if positions else 0
        elif q.tensor_dim is None and not q.is_expert:
            replicated += copies * q.device_elements(t, 1, 1) * (4.0 if q.path[0] in NORM_PARTS and not native else reduce_b)
    return replicated, saved


def summed_in_the_step(plan: Plan) -> bool:
    """Whether the replicas' gradient sums are the partitioner's all-reduces inside the one jitted step of a
    sequence-parallel data x tensor plan (:func:`sequence_replicated`; one SPMD program of one microbatch: the
    case checked against the traced runner step): XLA's all-reduce combiner merges the independent ones of one
    kind and device groups, and its scheduler starts each once its operands are ready. So the tensor-replicated
    parameters' sum over data and tensor (the norms' and row-parallel biases' gradients, complete when the
    layers' backward is) leaves before the embedding's backward, on a stream of its own beside the rest (it never
    merges with the sums over data), where the plan's model otherwise puts it after them
    (tests/test_program_vs_plan.py). Only with data replicas, the case checked: without them there is no sum over
    data to leave beside, and the merged gathers of :func:`token_table_last` stay in the backward."""
    rt = plan.runtime
    return (sequence_replicated(plan) and rt.allreduce_combiner and plan.mesh.data > 1 and plan.mesh.stage == 1
            and plan.mesh.context == 1
            and plan.schedule.virtual_stages == 1 and plan.batch.microbatches == 1 and not rt.grad_reduce_overlap
            and not rt.tp_comm_overlap)


def token_table_last(plan: Plan, cost: ChunkCost, combine_bytes: float, reduce_b: float) -> tuple[float, float]:
    """(bytes of the token table's gradient summed over data after the other gradients', bytes of the one tensor
    all-gather between the two sums) under :func:`summed_in_the_step` with a learned position table (its gradient
    gathered over tensor: ``position_gather_bytes``); zeros otherwise. ``cost``: the chunk's; its embedding
    backward's all-gather of the lookup's cotangent over tensor (sequence parallelism's,
    ``tensor_allreduce_bytes``) and the position table's gradient gather, which waits for the sum over data of
    each rank's shard of that gradient.

    XLA's all-gather combiner (it runs before the all-reduce combiner: testbed.sim.xla.combine.PASSES) merges the two
    independent gathers within its bound (``combine_bytes``: testbed.model.leaves.combine_limit); the token table's
    gradient is the scatter-add of the gathered cotangent, so its all-reduce then depends on the position table's,
    and the all-reduce combiner cannot merge the two: the step sums the rest, gathers, then sums the token table
    (the tied head's gradient included), in series, not as one merged all-reduce."""
    gathered = cost.tensor_allreduce_bytes + cost.position_gather_bytes
    if not (summed_in_the_step(plan) and cost.position_gather_bytes and gathered <= combine_bytes):
        return 0.0, 0.0
    return tied_table(plan.model).device_elements(plan.mesh.tensor, 1, 1) * reduce_b, gathered


def without_embedding_gathers(tensor: tuple[tuple[str, int, int], ...]) -> tuple[tuple[str, int, int], ...]:
    """A backward's tensor collectives (testbed.sim.step.action_work.tensor_transfers) less the embedding's, which are the
    gradient sums' merged gather under :func:`token_table_last`: one of the all-gathers (the lookup's cotangent) and
    the position table's gradient gather, its last entry."""
    out, dropped = [], False
    for op, count, nbytes in tensor[:-1]:
        if op == "all_gather" and not dropped:
            count, dropped = count - 1, True
        if count:
            out.append((op, count, nbytes))
    return tuple(out)


def gradient_buckets(plan: Plan, layers: int, grad_bytes: float) -> int:
    """Gradient buckets of a chunk of ``layers`` layers whose gradients on a device are ``grad_bytes``: the
    runner's one per layer, at most :data:`BUCKETS`; with ``runtime.grad_bucket_bytes`` as many as that size
    makes, at least one and at most one per layer (the backward is split no finer than a layer)."""
    size = plan.runtime.grad_bucket_bytes
    if not size:
        return min(BUCKETS, max(1, layers))
    return max(1, min(max(1, layers), math.ceil(grad_bytes / size)))


def accumulate_bytes(plan: Plan, params: int, grad_bytes: float) -> float:
    """HBM bytes one device streams adding one microbatch's gradients of ``params`` into the accumulator.

    Every microbatch adds into an accumulator that starts at zero; a step of one microbatch keeps its
    gradients as they are (0). Sharded accumulation (each microbatch's gradients reduce-scattered first,
    testbed.plan.sharding.gradient_reduction) adds into the device's shard. ``runtime.grad_accumulate_fp32``:
    a cast to fp32 and an fp32 add every microbatch (:data:`FP32_ACCUMULATE_BYTES`).
    """
    if plan.runtime.grad_accumulate_fp32 and plan.precision.mixed:  # every microbatch, the first too
        return FP32_ACCUMULATE_BYTES * params / state_sharding(plan).ways(plan, "grads")
    if plan.batch.microbatches <= 1 or accumulated_in_the_backward(plan):
        return 0.0
    return _added_bytes(plan, params, grad_bytes)


def _added_bytes(plan: Plan, params: int, grad_bytes: float) -> float:
    """The add's traffic: :data:`ACCUMULATE_PASSES` over the device's share of ``params`` gradients of
    ``grad_bytes`` each, whether a kernel of its own (:func:`accumulate_bytes`) or in the backward
    (:func:`accumulated_bytes`)."""
    return ACCUMULATE_PASSES * params * grad_bytes / state_sharding(plan).ways(plan, "grads")


def accumulated_in_the_backward(plan: Plan) -> bool:
    """Whether the add of each microbatch's gradients into the accumulator is part of the backward's program,
    not a memory-bound kernel of its own after it: JAX's one SPMD step (no pipeline stages) adds the whole
    gradients in its microbatch loop (testbed.runner.step._scan_sum), each weight's add a consumer of the GEMM
    that produces its gradient (one XLA can fuse into that GEMM's output). The traced loop body has the adds in
    the segment of the weight gradients' GEMMs, which no collective waits for (testbed.sim.graph.traced_graph), so the
    plan's last backward carries them in its last span, where testbed.model.spans puts the weight gradients
    (testbed.sim.step.facts): they hide beside those matmuls as the traced ones do. Traced/plan over the data x tensor
    corners at 2 microbatches without sequence parallelism (benchmarks/results/program_vs_plan.json): superpod
    0.964-1.030; TPU slice 0.984-1.046 but for three fp32 corners at tensor 1 (1.06, 1.15, 1.31). Not where the
    gradients accumulate sharded (the add follows a reduce-scatter) nor under ``runtime.grad_accumulate_fp32``
    (a cast and an fp32 add, kernels of their own)."""
    rt = plan.runtime
    return (plan.batch.microbatches > 1 and plan.mesh.stage == 1 and rt.microbatch_scan
            and not (rt.grad_accumulate_fp32 and plan.precision.mixed)
            and not state_sharding(plan).split_axes(plan, "grads"))


def loop_kept(plan: Plan) -> bool:
    """Whether the step accumulates its microbatches in a loop XLA keeps (JAX's one SPMD step, no pipeline stages:
    testbed.runner.step._scan_sum's ``lax.scan``), one iteration's body at a time: a microbatch begins once the one
    before it has ended, its collectives too (an asynchronous collective starts and ends inside the body). XLA:GPU
    at its default settings neither unrolls the loop, nor hoists its loop-invariant parameter gathers, nor
    pipelines its collectives across iterations (docs/program.md, "The microbatch loop XLA keeps");
    ``runtime.microbatch_scan``."""
    return plan.batch.microbatches > 1 and plan.mesh.stage == 1 and plan.runtime.microbatch_scan


def accumulated_bytes(plan: Plan, params: int, weight_gradients: bool, fused: bool = False,
                      in_matmuls: float = 0.0) -> float:
    """HBM bytes a microbatch's weight-gradient action (``weight_gradients``) of ``params`` carries for the add into
    the accumulator under :func:`accumulated_in_the_backward`: :data:`ACCUMULATE_PASSES` over the device's
    gradients; with ``fused`` (the compiler fuses the add into the gradient's producer) the one read of the
    accumulator (:data:`FUSED_ACCUMULATE_PASSES`) over the parameters whose gradients no matmul of
    :func:`accumulating_gemms` adds in its own kernel (``in_matmuls`` of them per device: the lookup tables', the
    norms' and biases'); else 0."""
    if not (weight_gradients and accumulated_in_the_backward(plan)):
        return 0.0
    if not fused:
        return _added_bytes(plan, params, state_bytes_per_param(plan)[1])
    rest = _added_bytes(plan, max(0.0, params - in_matmuls), state_bytes_per_param(plan)[1])
    return rest * FUSED_ACCUMULATE_PASSES / ACCUMULATE_PASSES


def accumulating_gemms(plan: Plan, shapes: ChunkGemms, fused: bool, moe_layers: int = 0) -> ChunkGemms:
    """A chunk's GEMMs with its weight gradients marked ``accumulates`` where the compiler adds each microbatch's
    into the accumulator inside the gradient's matmul (``fused``: testbed.topology.DeviceSpec.fused_updates, under
    :func:`accumulated_in_the_backward`): XLA:TPU compiles every weight gradient of the loop body as a ``kOutput``
    fusion of the convolution and the add (benchmarks/tpu_chip/accumulate.json), a kernel that takes the longer of
    its math and its bytes with the accumulator's read (testbed.sim.price.compute). The chip's per-op profiles of the
    125M step at 16, 8 and 4 microbatches (benchmarks/tpu_chip/profiles.json): the MLP input projection's weight
    gradient, its add fused, takes 28.7, 53.1 and 104.6 us a microbatch beside 26.2, 52.2 and 104.5 us for the
    forward product of its FLOPs (priced 26.7, 51.7, 103.4): the add's read hides under the math, where the add as a
    kernel of its own would take 22 us more and its read as a pass 7 us. Without MoE layers (their expert GEMMs are
    priced apart, testbed.sim.step.moe); :func:`accumulated_bytes` keeps the other parameters' read."""
    if not (fused and moe_layers == 0 and accumulated_in_the_backward(plan)):
        return shapes
    return replace(shapes, backward_weight=tuple(replace(g, accumulates=True) for g in shapes.backward_weight))


def accumulated_elements(shapes: ChunkGemms) -> float:
    """Gradient elements per device the ``accumulates`` weight-gradient GEMMs of ``shapes`` write (one microbatch)."""
    return sum(g.m * g.n * g.batch * g.count for g in shapes.backward_weight if g.accumulates)


def in_last_span(spans: tuple[tuple[float, float], ...], acc: float) -> tuple[tuple[float, float], ...]:
    """An action's spans (testbed.model.spans) with ``acc`` more bytes in the last, where its weight gradients
    are: the adds into the accumulator beside their GEMMs (:func:`accumulated_in_the_backward`)."""
    return (*spans[:-1], (spans[-1][0], spans[-1][1] + acc)) if acc and spans else spans
