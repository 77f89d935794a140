"""The search's step floor: a lower bound of the analytic tier's step time, from a few stages' compute.

testbed.explore.search skips a plan whose floor is above the estimates it
would have to beat to be replayed; the floor never exceeds
:func:`testbed.explore.analytic.estimate` (tests/test_flagship_search.py
checks it on sampled plans), so what the search replays is unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from testbed.hashed import HashedTuple
from testbed.collectives.bounds import max_injection_bandwidth
from testbed.collectives.routed import memoized, topology_memo
from testbed.model.costs import ChunkCost
from testbed.model.gemm import ChunkGemms, scaled
from testbed.model.layout import chunk_layers
from testbed.model.moe import dispatch_bytes, moe_layers, sequence_dispatch
from testbed.model.spans import action_spans, scaled_spans
from testbed.pipeline.schedules import Schedule, build_schedule, dependency_keys, peak_inflight, splits_backward
from testbed.explore.stage_collectives import StageCollectives
from testbed.plan.placement import place
from testbed.plan.sharding import gathers_parameters, state_sharding
from testbed.model.memory import state_bytes_per_param
from testbed.plan.stages import chunk_counts
from testbed.plan.spec import Axis, Plan, Remat
from testbed.sim.step.action_work import action_work
from testbed.sim.step.chunk_facts import MATMULS_PER_LAYER
from testbed.sim.price.compute import compute_seconds
from testbed.sim.xla.xla_tpu import (narrows_gathers, scatters_as_allreduce, scatters_whole_sequence,
                                    sequence_gather_bytes)
from testbed.sim.step.facts import BUCKETS, accumulate_bytes, cached_chunk_cost, cached_chunk_gemms
from testbed.sim.step.memo import cached_execution
from testbed.topology import Topology

__all__ = ["step_floor", "placed_floor", "played_floor", "played_at", "cached_played_at", "stage_floors", "combined",
           "cached_step_floor", "cached_played_floor", "floor_key", "group_floor_key", "cached_table", "cached_peaks"]


def step_floor(plan: Plan, topology: Topology) -> float | None:
    """A lower bound of :func:`estimate`'s step seconds from compute and tensor collectives, at a few stages' cost; None where
    the plan's actions are not plain compute (context parallelism's ring) or the host is shared.

    :func:`estimate` plays every action on its stage's one stream for at least its compute seconds and its
    blocking tensor collectives' (:func:`_tensor_floor`: a bandwidth bound of them), in the
    schedule's dependency order, so its step is at least (a) any stage's compute over all its actions and
    (b), with one chunk per stage, the first microbatch's forward through the stages before the last, the
    last stage's whole forward and backward, and the last microbatch's backward back through the others
    (weight gradients of split backwards left out of (b): they need not be on that path). Compute as the
    estimate prices it; the gradient-bucket split of the last backward is taken at the cheaper of its two
    prices; an MoE chain's (expert parallelism) bounded by the action as one kernel and its all-to-alls' bound; each
    microbatch's add into the gradient accumulator after its last backward, as the estimate prices it. Stages
    alike in their layers' kinds, embedding and head are priced once. The search drops a plan whose floor
    exceeds the estimates it would have to beat to be replayed, without changing what it replays.
    """
    return cached_step_floor(floor_key(plan), lambda: plan, topology)


def cached_step_floor(key: tuple, build: Callable[[], Plan], topology: Topology) -> float | None:
    """:func:`step_floor` of the plan ``build`` makes, whose :func:`floor_key` is ``key``; memoized per topology on
    the key, so a plan alike in what the floor reads to one already bounded is not built."""
    memo = topology_memo(topology).setdefault("step_floor_plans", {})
    hit = memo.get(key, memo)  # one hash of the key (its model and runtime are hashed field by field)
    if hit is not memo:
        return hit
    if len(memo) > 200_000:
        memo.clear()
    memo[key] = floor = _step_floor(build(), topology)
    return floor


def group_floor_key(plan: Plan) -> tuple:
    """The part of :func:`floor_key` that plans alike but in microbatches, remat, sequence parallelism and runtime
    share (a testbed.explore.candidates.CandidateGroup's)."""
    mesh = plan.mesh
    return (plan.model, mesh.tensor, mesh.stage, mesh.context, mesh.expert, mesh.expert_tensor,
            plan.schedule.virtual_stages, _splits_backward(plan), plan.precision, plan.layers_per_stage,
            plan.expert_imbalance, plan.runtime.moe_padded_dropless, gathers_parameters(plan, "B"),
            state_sharding(plan).ways(plan, "grads"))


def floor_key(plan: Plan) -> tuple:
    """What :func:`step_floor` reads of ``plan``: its chunks' costs and GEMMs (testbed.sim.step.memo's keys: the mesh's
    tensor, stage, context and expert degrees, not its data and fsdp degrees nor its order), the microbatches and
    their size, and of the ZeRO stage and the data and fsdp degrees only whether the backward gathers the
    parameters again and the ways the gradients are sharded (the add into the accumulator's bytes;
    ``state_sharding``, which the runtime's searched knobs leave alone), of the schedule's name only whether it
    splits the backward. Plans alike in those share one floor."""
    return (*group_floor_key(plan), plan.batch.microbatches, plan.microbatch_size, plan.remat,
            plan.sequence_parallel, plan.runtime)


def _step_floor(plan: Plan, topology: Topology) -> float | None:
    """:func:`step_floor`, not memoized."""
    priced = stage_floors(plan, topology)
    return None if priced is None else combined(plan, priced)


def placed_floor(plan: Plan, topology: Topology) -> float:
    """:func:`step_floor` with each action's blocking tensor collectives priced as the estimate prices them on
    ``plan``'s own placement (testbed.explore.stage_collectives: every tensor group of the stage at once, the
    collectives one after another) instead of their bandwidth bound, which holds wherever the groups lie; 0 where
    it does not apply (no tensor parallelism, ``runtime.tp_comm_overlap``, parameters gathered, whose actions play
    their tensor collectives among their blocks, or no step floor). A chunk holding the embedding keeps the bound (its
    backward may merge the embedding's gathers into the gradient sums: testbed.sim.step.grad_bytes). The transfers are
    :func:`testbed.sim.step.action_work.action_work`'s, the loss's at its fewest bytes, as the estimate's or fewer (the
    sequence's gathers as the compiler narrows them: testbed.sim.xla.xla_tpu.sequence_gather_bytes; without the
    backward's sequence gathers again, testbed.sim.xla.xla_tpu.regathers_sequence: fewer transfers, still a bound).
    Memoized per topology on :func:`floor_key` and the mesh (what the placement follows)."""
    return memoized(topology, "placed_floor", (floor_key(plan), plan.mesh), lambda: _placed_floor(plan, topology))


def _placed_floor(plan: Plan, topology: Topology) -> float:
    """:func:`placed_floor`, not memoized."""
    if plan.mesh.tensor == 1 or plan.runtime.tp_comm_overlap or (
            gathers_parameters(plan, "F") and state_sharding(plan).ways(plan, "params") > 1):
        return 0.0
    priced = stage_floors(plan, topology)
    if priced is None:
        return 0.0
    coll = StageCollectives(topology, place(plan, topology).device_ids)
    split, size = _splits_backward(plan), float(plan.precision.compute_bytes)
    extra: dict[tuple, float] = {}
    out = []
    for s, chunks in enumerate(priced):
        seconds = dict(chunks)
        for c, kind in chunks:
            if (s, c) == (0, 0):
                continue  # the embedding's chunk: its bound
            cost = cached_chunk_cost(plan, s, c)
            narrow = sequence_gather_bytes(plan, cost.tensor_allreduce_bytes, narrows_gathers(topology))
            transfers = action_work(cost, kind, split, plan.remat, size, narrow,
                                    whole=_whole(plan, topology))[3]
            key = (s, transfers)
            if key not in extra:
                exact = sum(n * coll.time(op, (Axis.TENSOR,), s, nbytes) for op, n, nbytes in transfers)
                extra[key] = max(0.0, exact - _tensor_floor(plan, topology, transfers))
            seconds[(c, kind)] += extra[key]
        out.append(seconds)
    return combined(plan, out)


def combined(plan: Plan, priced: list[dict[tuple[int, str], float]]) -> float:
    """:func:`step_floor` from each stage's action floors ``(chunk, kind) -> seconds``: (a) the busiest stage's
    every action, (b) with one chunk per stage, the first microbatch's way to the last stage and back."""
    m, p = plan.batch.microbatches, plan.mesh.stage
    sums: dict[int, dict[str, float]] = {}  # stages alike share one dict of floors, and one of their sums
    for chunks in priced:
        if id(chunks) not in sums:
            sums[id(chunks)] = {kind: sum(x for (_, k), x in chunks.items() if k == kind) for kind in ("F", "B", "W")}
    per_stage = [sums[id(chunks)] for chunks in priced]
    floor = max(m * sum(x.values()) for x in per_stage)
    if plan.schedule.virtual_stages == 1 and p > 1:
        last = per_stage[-1]
        path = sum(x["F"] + x["B"] for x in per_stage[:-1]) + m * (last["F"] + last["B"])
        floor = max(floor, path)
    return floor


def played_floor(plan: Plan, topology: Topology) -> float | None:
    """A tighter lower bound of :func:`estimate`'s step seconds: the schedule's dependency order played with
    each action at its floor (None where :func:`step_floor` is None).

    The estimate's play (testbed.explore.play) starts an action no earlier than its stage's previous action
    ends and than each action it waits for ends (a send arrives after its sender ends), and runs it for at
    least its compute and blocking tensor floor (the per-action terms of :func:`step_floor`); so replaying
    the same order (testbed.sim.step.memo's ``cached_order``, its dependency keys) with ``start = max(stage free,
    dependencies' ends)`` and ``end = start + floor`` gives, at each action, an end no later than the
    estimate's, and the latest end no later than its step. It counts the pipeline's fill and drain (the
    bubble of any schedule, interleaved and zero-bubble included), which :func:`step_floor` bounds only for
    one chunk per stage; its (a) and (b) are paths of this play, so but for rounding it is never below.
    The optimizer, gathers and gradient reductions are left out (they only add). At one action per
    microsecond or so it costs far less than an estimate, so the search plays it only for plans
    :func:`step_floor` did not already rule out (memoized: :func:`cached_played_floor`).
    """
    return cached_played_floor(floor_key(plan), plan, topology)


def cached_played_floor(key: tuple, plan: Plan, topology: Topology) -> float | None:
    """:func:`played_floor` of ``plan``, whose :func:`floor_key` is ``key``; memoized per topology on the key and
    the schedule's name (all it reads: plans alike in them play one order at the same floors)."""
    memo = topology_memo(topology).setdefault("played_floor", {})
    key = (key, plan.schedule.name)
    hit = memo.get(key, memo)
    if hit is memo:
        if len(memo) > 100_000:
            memo.clear()
        hit = memo[key] = _played_floor(plan, topology)
    return hit


def _played_floor(plan: Plan, topology: Topology) -> float | None:
    """:func:`played_floor`, not memoized on the plan: its play memoized on all it reads (:func:`cached_played_at`)."""
    priced = stage_floors(plan, topology)
    return None if priced is None else cached_played_at(plan, priced, topology)


def cached_played_at(plan: Plan, priced: list[dict[tuple[int, str], float]], topology: Topology) -> float:
    """:func:`played_at`, memoized per topology on all it reads: the schedule's order (its name, stages, microbatches
    and virtual stages) and each stage's floors (plans apart in what leaves those alike, such as a ZeRO stage or a
    remat that adds no work, play one; so do the played and the slowed floors, testbed.explore.slowed_floor, of
    floors alike)."""
    key = (plan.schedule.name, plan.mesh.stage, plan.batch.microbatches, plan.schedule.virtual_stages,
           tuple(tuple(chunks.items()) for chunks in priced))
    memo = topology_memo(topology).setdefault("played_at", {})
    hit = memo.get(key)
    if hit is None:
        if len(memo) > 100_000:
            memo.clear()
        hit = memo[key] = played_at(plan, priced)
    return hit


def played_at(plan: Plan, priced: list[dict[tuple[int, str], float]]) -> float:
    """The schedule's dependency order played with each action at ``priced``'s seconds (per stage, ``(chunk, kind)``
    -> seconds), as :func:`played_floor` plays it at its floors: the latest end."""
    p = plan.mesh.stage
    keys, order = _floor_order(plan.schedule.name.value, p, plan.batch.microbatches, plan.schedule.virtual_stages)
    seconds = [priced[s][action] for s, action in keys]
    end: list[float] = []
    free, add = [0.0] * p, end.append
    for s, k, deps in order:
        start = free[s]
        for dep in deps:
            t = end[dep]
            if t > start:
                start = t
        free[s] = t = start + seconds[k]
        add(t)
    return max(free)


@functools.lru_cache(maxsize=4096)
def _floor_order(name: str, p: int, m: int, v: int) -> tuple[tuple[tuple[int, tuple[int, str]], ...],
                                                              tuple[tuple[int, int, tuple[int, ...]], ...]]:
    """The schedule's execution order (testbed.sim.step.memo.cached_execution, as testbed.sim.step.memo.cached_order
    orders it) as :func:`_played_floor` plays it: its actions' distinct ``(stage, (chunk, kind))``, and per action
    its stage, the position of its own among those and the positions in the order of every action it waits for on
    other stages (testbed.pipeline.schedules.dependency_keys, whose other stages' keys are testbed.sim.step.memo.Waits'
    ``receives``: a send arrives no earlier than its sender ends; each before it: the order puts dependencies first).
    Its own stage's are left out: each ended by the time its stage is free. Built from the execution order alone,
    without the order's :class:`~testbed.sim.step.memo.Waits`, which only the plans estimated need."""
    schedule, executed = cached_execution(name, p, m, v)
    at: dict[tuple, int] = {}  # an action's key -> its position
    keys: dict[tuple[int, tuple[int, str]], int] = {}
    out = []
    for i, (s, a) in enumerate(executed):
        k = keys.setdefault((s, (a.chunk, a.kind)), len(keys))
        deps = dependency_keys(schedule, s, a.kind, a.microbatch, a.chunk)
        out.append((s, k, tuple(at[key] for key in deps if key[0] != s)))
        at[(s, a.kind, a.microbatch, a.chunk)] = i
    return tuple(keys), tuple(out)


#: Plans' stage floors :func:`stage_floors` keeps (per topology), the latest.
STAGE_FLOORS_KEPT = 4096


def stage_floors(plan: Plan, topology: Topology, computes: list | None = None
                  ) -> list[dict[tuple[int, str], float]] | None:
    """Per stage, each ``(chunk, kind)`` action's floor seconds (its compute, :func:`_action_floor`, and its
    blocking tensor collectives', :func:`_tensor_floor`); None where no floor applies (:func:`step_floor`).
    Stages alike in layers, embedding and head share one dict. ``computes``, when given, gets per stage the same
    floors less their tensor collectives' (an MoE chain's all-to-alls stay in). Memoized per topology on
    :func:`floor_key` (what the step, played, placed and slowed floors built from them read of the plan, and what
    each of their memos keys on), the latest :data:`STAGE_FLOORS_KEPT` keys, so the floors the search takes of one
    plan one after another price its actions once; the dicts are shared: read them, never change them."""
    memo = topology_memo(topology).setdefault("stage_floors", {})
    key = floor_key(plan)
    hit = memo.get(key, memo)
    if hit is memo:
        if len(memo) >= STAGE_FLOORS_KEPT:  # the oldest (a few KB each)
            del memo[next(iter(memo))]
        alone: list[dict[tuple[int, str], float]] = []
        hit = memo[key] = (_stage_floors(plan, topology, alone), tuple(alone))
    if computes is not None and hit[0] is not None:
        computes.extend(hit[1])
    return hit[0]


def _stage_floors(plan: Plan, topology: Topology, computes: list) -> list[dict[tuple[int, str], float]] | None:
    """:func:`stage_floors`, not memoized (``computes`` gets each stage's floors less their tensor collectives')."""
    mesh, v = plan.mesh, plan.schedule.virtual_stages
    if mesh.context > 1 or topology.calibration.host is not None:
        return None
    p, dtype = mesh.stage, plan.precision.compute_dtype
    split = _splits_backward(plan)
    kinds = ("F", "B", "W") if split else ("F", "B")
    priced: dict[tuple, dict[tuple[int, str], float]] = {}
    memo = topology_memo(topology).setdefault("chunk_floors", {})
    shared = HashedTuple(_chunk_key(plan, split, dtype))  # in every chunk's key below
    moe = _moe_chunks(plan.model, p, v, plan.stage_layers) if plan.model.experts else None
    per = chunk_counts(plan.stage_layers, v)
    accumulates = accumulate_bytes(plan, 1, 1.0) > 0  # each microbatch adds into the accumulator: by chunk params
    added: dict[int, float] = {}
    out = []
    for s in range(p):
        key = (plan.stage_layers[s], s == 0, s == p - 1) if moe is None else moe[s]
        if key not in priced:
            seconds, alone = {}, {}
            for c in range(v):
                # A chunk's cost and GEMMs (testbed.model.costs.chunk_cost) follow its layers' kinds (a dense model's:
                # its layer count) and the embedding and head it holds (testbed.sim.step.facts.alike_key) beside what
                # :func:`_chunk_key` holds: priced once per topology, whichever plan, stage and chunk holds it.
                alike = (shared, per[s][c], (s, c) == (0, 0), (s, c) == (p - 1, v - 1)) if moe is None else \
                    (shared, *moe[s][c])
                hit = memo.get(alike)
                if hit is None:
                    cost, gemms = cached_chunk_cost(plan, s, c), cached_chunk_gemms(plan, s, c)
                    n_moe = 0 if moe is None else moe[s][c][-1]
                    hit, whole = {}, {}
                    for kind in kinds:
                        whole[kind], tensor = _action_floor(topology, plan, cost, gemms, kind, split, dtype, n_moe)
                        hit[kind] = whole[kind] + _tensor_floor(plan, topology, tensor)
                    if len(memo) > 100_000:
                        memo.clear()
                    memo[alike] = hit = (hit, cost.params, whole)
                seconds.update({(c, kind): x for kind, x in hit[0].items()})
                alone.update({(c, kind): x for kind, x in hit[2].items()})
                if accumulates:
                    if hit[1] not in added:
                        added[hit[1]] = _accumulate_floor(plan, topology, hit[1])
                    seconds[(c, kinds[-1])] += added[hit[1]]
                    alone[(c, kinds[-1])] += added[hit[1]]
            priced[key] = (seconds, alone)
        out.append(priced[key][0])
        computes.append(priced[key][1])
    return out


def _accumulate_floor(plan: Plan, topology: Topology, params: int) -> float:
    """Seconds of the add of a microbatch's gradients of a chunk of ``params`` into the accumulator after its last
    backward (testbed.sim.step.grad_bytes.accumulate_bytes, priced as the estimate prices it: a memory pass of its own;
    0 where there is none)."""
    nbytes = accumulate_bytes(plan, params, state_bytes_per_param(plan)[1])
    return compute_seconds(topology, plan.precision.compute_dtype, 0.0, nbytes) if nbytes > 0 else 0.0


def _whole(plan: Plan, topology: Topology) -> bool:
    """Whether the estimate prices the sequence reduce-scatters as all-reduces (testbed.sim.xla.xla_tpu.
    scatters_whole_sequence, with the flags testbed.sim.step.facts reads of the topology); :func:`_chunk_key` and
    :func:`floor_key` hold what it reads (the tensor degree, the microbatch size, sequence parallelism; the mesh's
    size is the topology's)."""
    return scatters_whole_sequence(plan, narrows_gathers(topology), scatters_as_allreduce(topology))


def _chunk_key(plan: Plan, split: bool, dtype: str) -> tuple:
    """What a chunk's action floors read of ``plan`` beside its layers and ends: what its cost and GEMMs read
    (testbed.sim.step.memo's keys, but for the stage split and the chunk's place), the backward's split, the dtype,
    and what the spans and tensor floor read (``runtime.tp_comm_overlap``, whether the backward gathers the
    parameters again); an MoE chain's ``runtime.moe_sequence_dispatch``."""
    mesh, rt = plan.mesh, plan.runtime
    return (plan.model, mesh.tensor, plan.microbatch_size, plan.precision, plan.remat, plan.sequence_parallel,
            mesh.expert, plan.expert_imbalance, mesh.context, mesh.expert_tensor, rt.recompute, rt.moe_dispatch,
            rt.attention_kernel, rt.fp8_scaling, rt.fp8_head, rt.moe_padded_dropless, rt.tp_comm_overlap,
            rt.moe_sequence_dispatch, gathers_parameters(plan, "B"), split, dtype)


@functools.lru_cache(maxsize=1024)
def _moe_chunks(spec, p: int, v: int, stage_layers: tuple[int, ...]) -> tuple[tuple[tuple, ...], ...]:
    """Per stage, each chunk's kinds of layers (MoE or dense, in order), whether it holds the embedding and the head
    (testbed.sim.step.facts.alike_key's rule) and its MoE layers' count, of an MoE model split so (memoized: plans alike
    in the split share it)."""
    spans = chunk_layers(spec, p, v, stage_layers)
    return tuple(tuple((tuple(map(spec.is_moe_layer, spans[s][c])), (s, c) == (0, 0), (s, c) == (p - 1, v - 1),
                        moe_layers(spec, spans[s][c])) for c in range(v)) for s in range(p))


def _action_floor(topology: Topology, plan: Plan, cost: ChunkCost, gemms: ChunkGemms, kind: str, split: bool,
                  dtype: str, n_moe: int = 0) -> tuple[float, tuple[tuple[str, int, int], ...]]:
    """(compute seconds, blocking tensor transfers) of one ``kind`` action of a chunk of ``cost`` and ``gemms``
    holding ``n_moe`` MoE layers: its compute as the estimate prices it, a microbatch's last backward at the cheaper
    of whole and split into gradient buckets. An MoE chain's (expert parallelism: testbed.sim.step.moe), which the
    estimate prices as the sum of its compute pieces' (the action's work and GEMMs split among them) and its exposed
    all-to-alls, is bounded by the whole action as one kernel (its GEMMs' seconds are the pieces' summed, or, priced
    by FLOPs, at an efficiency no piece's exceeds: one kernel's is the highest; its memory pass no longer than
    theirs, its one launch no more than their several) and :func:`_all_to_all_floor`."""
    remat = plan.remat
    kernels = max(1, MATMULS_PER_LAYER * cost.layers)  # the estimate's count (chunk_facts): no more, so no slower
    # the loss's maximum at its fewest bytes (the logits' dtype, as a compiler reducing natively moves it): a bound
    narrow = sequence_gather_bytes(plan, cost.tensor_allreduce_bytes, narrows_gathers(topology))  # as the estimate
    flops, hbm, (rep_b, split_b), tensor = action_work(cost, kind, split, remat, float(plan.precision.compute_bytes),
                                                       narrow, whole=_whole(plan, topology))
    shapes = gemms.action(kind, split)
    if n_moe and plan.mesh.expert > 1 and kind != "W":  # an MoE chain (testbed.sim.step.moe.moe_pieces): a bound of it
        whole = compute_seconds(topology, dtype, flops, hbm, 1, rep_b, split_b, cost.tensor_bytes, shapes)
        return whole + _all_to_all_floor(plan, topology, n_moe, kind), tensor
    spans = action_spans(plan, cost, kind, split, n_moe)
    whole = compute_seconds(topology, dtype, flops, hbm, kernels, rep_b, split_b, cost.tensor_bytes, shapes, spans)
    pieces = min(BUCKETS, max(1, cost.layers))
    if kind == ("W" if split else "B") and pieces > 1:
        whole = min(whole, pieces * compute_seconds(
            topology, dtype, flops / pieces, hbm / pieces, max(1, kernels // pieces), rep_b / pieces,
            split_b / pieces, cost.tensor_bytes, scaled(shapes, 1 / pieces), scaled_spans(spans, 1 / pieces)))
    return whole, tensor


def _all_to_all_floor(plan: Plan, topology: Topology, n_moe: int, kind: str) -> float:
    """A lower bound of the seconds an F or B action's MoE chain blocks for its all-to-alls (the estimate's
    ``_exposed_all_to_all``): without shared experts, whose compute runs beside them, each layer's dispatch and
    combine (twice under full remat's backward) whole, each rank of a group of ``e`` sending at least ``(e - 1) / e``
    of the buffer (testbed.collectives.bounds) at the topology's largest injection bandwidth; 0 with shared
    experts."""
    e = plan.mesh.expert
    if plan.model.shared_experts:
        return 0.0
    nbytes = dispatch_bytes(plan) / (plan.mesh.tensor if sequence_dispatch(plan) else 1)
    count = 2 if plan.remat is Remat.FULL and kind == "B" else 1
    return n_moe * 2 * count * nbytes * (e - 1) / e / _max_injection(topology)


def _max_injection(topology: Topology) -> float:
    """The topology's largest injection bandwidth (testbed.collectives.bounds), once per topology."""
    memo = topology_memo(topology)
    if "max_injection_bandwidth" not in memo:  # a pass over every device: once per topology
        memo["max_injection_bandwidth"] = max_injection_bandwidth(topology)
    return memo["max_injection_bandwidth"]


def _tensor_floor(plan: Plan, topology: Topology, transfers: tuple[tuple[str, int, int], ...]) -> float:
    """A lower bound of the seconds an action's blocking tensor collectives ``(op, count, bytes each)`` add to it
    in :func:`estimate` (0 where ``runtime.tp_comm_overlap`` runs them beside the compute): each rank of a group
    of ``t`` moves at least ``(t - 1) / t`` of the bytes through its own links (testbed.collectives.bounds, which
    no algorithm beats), at best at the topology's largest injection bandwidth, whichever devices hold the group."""
    t = plan.mesh.tensor
    if t == 1 or not transfers or plan.runtime.tp_comm_overlap:
        return 0.0
    moved = sum(count * nbytes for _, count, nbytes in transfers) * (t - 1) / t
    return moved / _max_injection(topology)


def _splits_backward(plan: Plan) -> bool:
    """Whether ``plan``'s schedule splits the backward into B (input gradients) and W (weight gradients)."""
    return splits_backward(plan.schedule.name)


@functools.lru_cache(maxsize=4096)
def cached_table(name: str, stages: int, microbatches: int, virtual: int) -> Schedule:
    """The schedule table alone (testbed.pipeline.schedules.build_schedule), memoized: the bounds read it for
    every plan, and its execution order with dependency keys (testbed.sim.step.memo.cached_order), which costs far
    more at hundreds of microbatches, only the plans they estimate need."""
    return build_schedule(name, stages, microbatches, virtual)


@functools.lru_cache(maxsize=4096)
def cached_peaks(name: str, stages: int, microbatches: int, virtual: int) -> tuple[int, ...]:
    """Per stage, the schedule's peak of activation sets held (testbed.pipeline.schedules.peak_inflight, as
    testbed.model.memory.inflight_microbatches), memoized from :func:`cached_table`."""
    return tuple(int(n) for n in peak_inflight(cached_table(name, stages, microbatches, virtual)))
