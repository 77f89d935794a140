"""The facts of one training step, worked out once: what both the task graph and the analytic tier play.

A plan on a placement decides, before anything is timed, which pipeline
stages and virtual chunks there are, the schedule table and an order of its
actions in which every dependency comes first, how the model state is
sharded (``ways``), what each chunk costs (testbed.model.costs,
testbed.model.gemm), each F/B/W action's work and tensor collectives, its
MoE chain (testbed.sim.step.moe) and the part of it the context ring plays
(testbed.sim.graph.ring), the sends it makes, how many collectives a gather of a
chunk's sharded parameters is (``leaves``, under the calibration's
``combine_bytes``), the gradient buckets and how each is reduced, and each
stage's optimizer update (testbed.sim.step.update_facts); a chunk's own facts are testbed.sim.step.chunk_facts'.
:func:`step_facts` works these out once into a frozen :class:`StepFacts`; testbed.sim.graph.program builds the task graph from it
(one small builder per stream) and testbed.explore.analytic plays the same
facts without the graph. The plan's ``runtime:`` (testbed.plan.runtime) is read
here too: the gradient buckets, whether replicated gradients reduce during the
backward, the bytes they are reduced in, and whether pipeline sends are split.
The memos it reads (schedule orders, chunk costs and GEMMs) are testbed.sim.step.memo's; the rules of the
gradients' bytes (buckets, reduction dtype, sequence parallelism's replicated parameters, accumulation) are
testbed.sim.step.grad_bytes'.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from testbed.model import buffers
from testbed.model.layout import chunk_layers
from testbed.model.leaves import bucket_share, combine_limit
from testbed.model.memory import state_bytes_per_param
from testbed.pipeline.schedules import Schedule
from testbed.plan.sharding import gathers_parameters, gradient_reduction, loss_merged, state_sharding
from testbed.plan.spec import Axis, Plan
from testbed.sim.step.chunk_facts import ChunkFacts, action_sends, chunk_facts
from testbed.sim.step.grad_bytes import (ACCUMULATE_PASSES, BUCKETS, FP32_ACCUMULATE_BYTES, accumulate_bytes,
                                     gradient_buckets, reduce_bytes, tied_copy_bytes)
from testbed.sim.step.memo import OrderedAction, cached_chunk_cost, cached_chunk_gemms, cached_order, order_of
from testbed.sim.step.update_facts import OPTIMIZER_FLOPS_PER_PARAM, Reduction, StageUpdate, parameter_reductions, stage_update
from testbed.sim.xla.xla_tpu import (VECTOR_LANES, accumulate_op, gather_allreduce_bytes, lowered_reductions,
                                     lowering_of, lowers_vectors, matmul_gather_bytes, merged_shard_sums, merges_loss,
                                     merges_shard_sums, narrows_gathers, regathers_for_recompute,
                                     scatters_as_allreduce, shard_sum_count)

if TYPE_CHECKING:
    from testbed.topology import Topology

__all__ = ["cached_chunk_cost", "cached_chunk_gemms", "StageUpdate", "Reduction", "StepFacts", "ShardSum", "step_facts", "alike_key",
           "facts_key", "FactsKey", "recall", "keep",
           "topology_rules",
           "accumulate_bytes", "cached_order", "bucket_share", "BUCKETS", "OPTIMIZER_FLOPS_PER_PARAM",
           "ACCUMULATE_PASSES", "FP32_ACCUMULATE_BYTES", "gradient_buckets", "reduce_bytes"]


class ShardSum(NamedTuple):
    """A stage's merged all-reduces of its gradient shards (StepFacts.shard_sum): the axes, bytes each, how many."""

    axes: tuple
    each_bytes: float
    count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StepFacts:
    """Everything one training step of ``plan`` on a placement is made of, before any of it is timed.

    ``order``: every action with the keys it waits for, dependencies first (stages keep their table order);
    ``representatives``: each stage's representative device (mesh coordinate ``(stage, 0, 0, 0)``);
    ``params_axes``/``params_ways``, ``optimizer_ways``: the state sharding; ``per_microbatch``: the axes
    gradients are reduce-scattered over as each microbatch's come (sharded accumulation);
    ``reductions``: how each parameter kind's gradients are summed (empty: nothing reduces them);
    ``chunks[s][c]`` and ``updates[s]`` the per-chunk and per-stage facts.
    """

    plan: Plan
    schedule: Schedule
    order: tuple[OrderedAction, ...]
    representatives: tuple[int, ...]
    param_bytes: float
    grad_bytes: float
    params_axes: tuple[Axis, ...]
    params_ways: int
    optimizer_ways: int
    per_microbatch: tuple[Axis, ...]
    reductions: tuple[Reduction, ...]
    combine_bytes: float
    chunks: tuple[tuple[ChunkFacts, ...], ...]
    updates: tuple[StageUpdate, ...]
    #: Bytes per device of the tied token table's gradient all-reduced between the first and the last stage before
    #: their updates (testbed.sim.step.grad_bytes.tied_copy_bytes; 0: none).
    tied_bytes: float = 0.0
    #: The collective an earlier microbatch's gradients are summed into the sharded accumulator with over
    #: ``per_microbatch`` (testbed.sim.xla.xla_tpu.accumulate_op: ``reduce_scatter``, or XLA:TPU's all-reduce of it).
    accumulate_op: str = "reduce_scatter"
    #: The collective kinds played in program order with the compute (testbed.topology.parts.DeviceSpec.
    #: held_collectives; testbed.sim.step.step_rules.held_stream).
    held: frozenset[str] = frozenset()
    #: Per stage, the merged all-reduces of the gradient shards over the replicated axes (Reduction.rest_merged): (bytes
    #: per device, how many), issued once the stage's last reduce-scatter is done (testbed.sim.xla.xla_tpu.
    #: merges_shard_sums); empty: none, each bucket all-reduces its own.
    shard_sums: tuple[tuple[float, int], ...] = ()
    #: :meth:`dispatch_buffers` per (stage, chunk, kind, accumulated), filled as the step's actions ask.
    _buffers: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def stages(self) -> int:
        return self.schedule.stages

    @property
    def virtual(self) -> int:
        return self.plan.schedule.virtual_stages

    @property
    def microbatches(self) -> int:
        return self.plan.batch.microbatches

    @property
    def last_backward(self) -> str:
        """The kind of action that ends a microbatch's gradients: W when the backward is split, else B."""
        return "W" if self.schedule.split_backward else "B"

    @property
    def reduce_bytes(self) -> float:
        """Bytes per gradient value as gradients are reduced: their own, or 4 with ``runtime.grad_reduce_dtype``
        ``fp32``."""
        return reduce_bytes(self.plan, self.grad_bytes)

    @property
    def loss_merged(self) -> bool:
        """Whether the loss's all-reduce rides in the gradients' (testbed.plan.sharding.loss_merged; their
        reduce-scatter, or the rank-1 ones', an all-reduce over the loss's axes where testbed.sim.xla.xla_tpu.
        merges_loss)."""
        vectors = any("all_reduce" in ops for stage in self.chunks for chunk in stage for ops in chunk.bucket_ops)
        return loss_merged(self.plan, self.reduce_bytes, merges_loss(self.reductions, vectors))

    @property
    def scatter_sends(self) -> int:
        """The tensor degree a pipeline send is split over (``runtime.pipeline_scatter_gather`` without sequence
        parallelism, whose sends are split already: the receiver all-gathers the pieces); 1: whole sends."""
        plan = self.plan
        split = plan.runtime.pipeline_scatter_gather and plan.mesh.tensor > 1 and not plan.sequence_parallel
        return plan.mesh.tensor if split else 1

    @property
    def reduce_in_backward(self) -> bool:
        """Whether the last microbatch's gradient buckets reduce while its backward goes on: always when they
        accumulate sharded, and replicated ones too with ``runtime.grad_reduce_overlap`` (else the replicas
        sum once, after the stage's backward)."""
        return bool(self.per_microbatch) or self.plan.runtime.grad_reduce_overlap

    def shard_sum(self, stage: int) -> "ShardSum | None":
        """Stage ``stage``'s merged all-reduces of its gradient shards (:attr:`shard_sums`, the reduction marked
        ``rest_merged``): over which axes, of how many bytes each, how many; None where there are none. Both tiers
        read it (testbed.sim.graph.grad_tasks.shard_sum_task, testbed.explore.prices' ``shard_sum_s``)."""
        merged = next((r for r in self.reductions if r.rest_merged), None)
        if merged is None or not self.shard_sums or not self.shard_sums[stage][1]:
            return None
        nbytes, n = self.shard_sums[stage]
        return ShardSum(merged.rest, nbytes / n, n)

    def gathers(self, kind: str) -> bool:
        """Whether a ``kind`` action all-gathers its chunk's sharded parameters (block by block)."""
        return gathers_parameters(self.plan, kind)

    @property
    def prefetch(self) -> int:
        """Blocks gathered ahead of the one computing (``runtime.fsdp_prefetch``): block ``i``'s gather waits
        for block ``i - 1 - prefetch`` to finish, whose gathered weights it replaces."""
        return self.plan.runtime.fsdp_prefetch

    def dispatch_buffers(self, stage: int, chunk: int, kind: str, accumulated: bool) -> int:
        """Device buffers the controller passes dispatching one action's program and its sends
        (testbed.model.buffers); worked out once per (stage, chunk, kind, accumulated): every microbatch's action
        asks it again."""
        key = (stage, chunk, kind, accumulated)
        found = self._buffers.get(key)
        if found is None:
            sends = len(self.chunks[stage][chunk].action(kind).sends)
            found = self._buffers[key] = (buffers.action_buffers(self.plan, stage, chunk, kind, accumulated)
                                          + sends * buffers.send_buffers(self.plan))
        return found


def topology_rules(topology: Topology) -> dict[str, Any]:
    """What :func:`step_facts` (and testbed.sim.graph.program.build_program) take from ``topology``, read here once for
    both tiers: its compiler's merge bounds (``calibration.collectives``) and device rules (gathers on a resource of
    their own, bf16 reduced in bf16, the optimizer fused into the weight gradients, the collectives held in program
    order with the compute)."""
    collectives, device = topology.calibration.collectives, topology.device
    return {"combine_bytes": collectives.combine_bytes, "allreduce_bytes": collectives.allreduce_combine_bytes,
            "chained_gathers": device.gathers_apart(), "native_reductions": device.native_reductions(),
            "fused_updates": device.fused_updates(), "whole_slice_scatters": scatters_as_allreduce(topology),
            "recompute_gathers": regathers_for_recompute(topology),
            "narrowed_gathers": narrows_gathers(topology), "gather_allreduce": gather_allreduce_bytes(topology),
            "vector_lanes": VECTOR_LANES if lowers_vectors(topology) else 0, "held": device.held_collectives(),
            "merged_sums": merges_shard_sums(topology)}


def step_facts(plan: Plan, device_ids, combine_bytes: float | None = None,
               schedule: Schedule | None = None, chained_gathers: bool = False,
               native_reductions: bool = False, allreduce_bytes: float | None = None,
               fused_updates: bool = False, whole_slice_scatters: bool = False,
               recompute_gathers: bool = False, narrowed_gathers: bool = False, merged_sums: bool = False,
               gather_allreduce: float = 0.0, held: frozenset[str] = frozenset(), vector_lanes: int = 0) -> StepFacts:
    """The facts of one step of ``plan`` placed as ``device_ids`` (testbed.plan.placement's array).

    Args:
        combine_bytes: the topology's ``calibration.collectives.combine_bytes`` (None: the stack's own bound:
            testbed.model.leaves.combine_limit).
        schedule: the pipeline table to follow (default: the plan's schedule, memoized).
        chained_gathers: all-gathers are a scheduler resource of their own, one in flight (``device.collective_
            resources: per_kind``): a weight gradient that reads no re-gathered weight runs first (bucket_early).
        native_reductions: the compiler all-reduces bf16 in bf16 (XLA:TPU: DeviceSpec.native_reductions).
        allreduce_bytes: the topology's ``calibration.collectives.allreduce_combine_bytes`` (None: unbounded).
        fused_updates: the compiler fuses a weight gradient's update (where nothing sums it) and its add into the
            accumulator into its matmul (XLA:TPU: testbed.topology.DeviceSpec.fused_updates).
        whole_slice_scatters: a reduce-scatter over every device is an all-reduce merged by the all-reduce combiner
            (XLA:TPU on a whole slice: testbed.sim.xla.xla_tpu.scatters_as_allreduce).
        recompute_gathers: under full remat a layer's backward gathers its recomputation's leaves apart from its
            gradients' (XLA:TPU: testbed.sim.xla.xla_tpu.regathers_for_recompute).
        narrowed_gathers, gather_allreduce: XLA:TPU gathers fp32 weights and activations only matmuls read in bf16, over
            a whole slice small buffers as merged all-reduces, and (``vector_lanes``; 0: none) rank-1 leaves too;
            ``merged_sums``: it merges HSDP's shard sums (testbed.sim.xla.xla_tpu). held: :func:`held_kinds`."""
    mesh, v, m, p = plan.mesh, plan.schedule.virtual_stages, plan.batch.microbatches, plan.mesh.stage
    schedule, order = cached_order(plan.schedule.name.value, p, m, v) if schedule is None else (schedule,
                                                                                               order_of(schedule))
    (param_b, grad_b, _), sharding = state_bytes_per_param(plan), state_sharding(plan)
    o_ways, per_microbatch = sharding.ways(plan, "optimizer"), tuple(Axis(a) for a in gradient_reduction(plan)[0])
    reductions = step_reductions(plan, sharding.optimizer, whole_slice_scatters, merged_sums)
    combine = combine_limit(combine_bytes, plan.runtime.gather_combine_bytes)
    gathered = (matmul_gather_bytes(plan, param_b) if narrowed_gathers else 0.0,  # XLA:TPU's gathers' rules
                lowering_of(gather_allreduce, allreduce_bytes, sharding.ways(plan, "params"), mesh.size, vector_lanes))
    spans = chunk_layers(plan.model, p, v, plan.stage_layers)
    chunk_costs = [[cached_chunk_cost(plan, s, c) for c in range(v)] for s in range(p)]
    alike: dict[tuple, ChunkFacts] = {}  # chunks alike in their layers and ends: worked out once

    def facts_of(s: int, c: int) -> ChunkFacts:
        key = alike_key(plan, p, v, s, c, spans[s][c])
        if key in alike:
            return _sent(alike[key], schedule, chunk_costs, s, c)
        alike[key] = out = chunk_facts(plan, schedule, chunk_costs, s, c, spans[s][c], combine, param_b,
                                        bool(reductions), bool(per_microbatch), reduce_bytes(plan, grad_b),
                                        chained_gathers, native_reductions, allreduce_bytes,
                                        any(r.scatter_op == "all_reduce" for r in reductions), recompute_gathers,
                                        fused_updates, *gathered, narrowed_gathers, whole_slice_scatters)
        return out

    chunks = tuple(tuple(facts_of(s, c) for c in range(v)) for s in range(p))
    updates = tuple(stage_update(plan, s, chunk_costs[s], o_ways, sharding.ways(plan, "params"), combine, param_b,
                                 grad_b, fused_updates) for s in range(p))
    return StepFacts(plan=plan, schedule=schedule, order=order,
                     representatives=tuple(int(device_ids[s].flat[0]) for s in range(p)),
                     param_bytes=param_b, grad_bytes=grad_b, params_axes=sharding.params,
                     params_ways=sharding.ways(plan, "params"), optimizer_ways=o_ways, per_microbatch=per_microbatch,
                     reductions=reductions, combine_bytes=combine, chunks=chunks, updates=updates,
                     tied_bytes=tied_copy_bytes(plan, reduce_bytes(plan, grad_b)),
                     accumulate_op=accumulate_op(per_microbatch, mesh, whole_slice_scatters), held=held_kinds(plan, held),
                     shard_sums=shard_sums(reductions, chunks, reduce_bytes(plan, grad_b), allreduce_bytes))


def step_reductions(plan: Plan, optimizer_axes: tuple[Axis, ...], whole_slice_scatters: bool, merged_sums: bool
                    ) -> tuple[Reduction, ...]:
    """StepFacts.reductions: each parameter kind's (testbed.sim.step.update_facts.parameter_reductions) as the
    compiler makes them (testbed.sim.xla.xla_tpu: ``lowered_reductions`` where ``whole_slice_scatters``,
    ``merged_shard_sums`` where ``merged_sums``)."""
    lowered = lowered_reductions(parameter_reductions(plan, optimizer_axes), plan.mesh, whole_slice_scatters)
    return merged_shard_sums(lowered, merged_sums)


def shard_sums(reductions: tuple, chunks: tuple, reduce_b: float, allreduce_bytes: float | None
               ) -> tuple[tuple[float, int], ...]:
    """StepFacts.shard_sums: per stage, the bytes per device of its chunks' gradient shards that the reductions
    marked ``rest_merged`` all-reduce (each chunk's gradients, ChunkFacts.reduced.last, less the kinds apart, over
    the reduce-scatter's ways) and the merged all-reduces they pack into (testbed.sim.xla.xla_tpu.shard_sum_count);
    empty where none is so marked."""
    merged = [r for r in reductions if r.rest_merged]
    if not merged:
        return ()
    out = []
    for stage in chunks:
        nbytes = sum(r.size(c.reduced.last, c.special(1.0, reduce_b)) / r.ways for c in stage for r in merged)
        out.append((nbytes, shard_sum_count(nbytes, allreduce_bytes)))
    return tuple(out)


def held_kinds(plan: Plan, held) -> frozenset[str]:
    """The device's held collective kinds (DeviceSpec.held_collectives) but all-reduces where the plan's run overlaps
    them with the backward (``runtime.async_all_reduce``: its XLA flags)."""
    return frozenset(held) - ({"all_reduce"} if plan.runtime.async_all_reduce else set())


class FactsKey(NamedTuple):
    """:func:`facts_key`: ``plan`` (hashed: the plan's fields but its name, the device ids) and ``facts`` (the step
    facts but their plan, compared only between keys of equal ``plan``: hashing thousands of ordered actions
    costs as much as working them out)."""

    plan: tuple
    facts: tuple


def facts_key(facts: StepFacts, device_ids, controller: bool) -> FactsKey:
    """What both tiers' timing of the step ``facts`` describes follows from beside the topology, known before either
    plays it: the facts but their plan, every plan field but its name, and the device ids (``controller``: the
    topology's calibration has one). Each tier reads the plan's remat only through the facts (its recompute's
    FLOPs, bytes and gathers are in the chunk facts) but for the controller's dispatch buffers
    (testbed.model.buffers) and ring attention's steps (testbed.sim.graph.ring, context > 1), so elsewhere the
    remat is left out: plans alike but for a remat that adds no work (selective under flash attention) share one
    key (tests/test_graph_key.py holds equal keys to equal task graphs, DES steps and estimates)."""
    plan = facts.plan
    remat = plan.remat if controller or plan.mesh.context > 1 else None
    plan_fields = tuple(getattr(plan, f.name) for f in fields(plan) if f.compare and f.name not in ("name", "remat"))
    rest = tuple(getattr(facts, f.name) for f in fields(facts) if f.compare and f.name != "plan")
    return FactsKey((plan_fields, remat, device_ids.shape, device_ids.tobytes()), rest)


def recall(memo: dict, key: FactsKey, extra: tuple = ()) -> Any:
    """The value :func:`keep` put in ``memo`` under ``key`` (and ``extra``), or None."""
    return next((value for facts, value in memo.get((key.plan, extra), ()) if facts == key.facts), None)


def keep(memo: dict, key: FactsKey, value: Any, limit: int, extra: tuple = ()) -> None:
    """Puts ``value`` in ``memo`` under ``key`` (and ``extra``), as the latest of at most ``limit`` plan keys (its
    other entries: the memo's own, such as its topology, are kept)."""
    entries = memo.pop((key.plan, extra), [])
    memo[(key.plan, extra)] = [*(e for e in entries if e[0] != key.facts), (key.facts, value)]
    keys = [k for k in memo if isinstance(k, tuple)]
    if len(keys) > limit:  # the oldest
        del memo[keys[0]]


def alike_key(plan: Plan, stages: int, virtual: int, s: int, c: int, span: range) -> tuple:
    """What a chunk's :class:`ChunkFacts` but its sends (the stages they reach) follow from, beside the plan: the
    kind of each of its layers in order (testbed.model.layout's layer kinds: MoE or dense; every parameter,
    cost and GEMM of a layer is its kind's) and whether it holds the embedding or the head. Chunks alike in it
    have equal facts (tests/test_alike_chunks.py checks it chunk by chunk)."""
    kinds = tuple(plan.model.is_moe_layer(i) for i in span) if plan.model.experts else len(span)
    return kinds, (s, c) == (0, 0), (s, c) == (stages - 1, virtual - 1)


def _sent(chunk: ChunkFacts, schedule: Schedule, chunk_costs, s: int, c: int) -> ChunkFacts:
    """``chunk``'s facts (those of a chunk alike: :func:`alike_key`) as chunk ``c`` of stage ``s``: its actions'
    sends its own."""
    actions = tuple(a if (sends := tuple(action_sends(schedule, s, a.kind, c, chunk_costs))) == a.sends
                    else replace(a, sends=sends) for a in chunk.actions)
    return chunk if actions == chunk.actions else replace(chunk, actions=actions)


