"""The search's fast tier: a plan's step time from the simulator's own cost functions, without the DES.

Where the discrete-event simulator (testbed.sim.engine) builds the step's
task graph and plays it as fluids sharing links, this tier plays only the
pipeline schedule table, stage by stage, with the same prices:

- each F/B/W action costs :func:`testbed.sim.engine.compute_seconds` of the
  work testbed.sim.program assigns it (``chunk_cost`` of testbed.model.costs,
  split into gradient buckets as the program splits it), plus its blocking
  tensor-parallel all-reduces timed by testbed.collectives.timing over every
  tensor group at once (``groups_time``: the groups share links);
- fsdp/ZeRO-3 parameter gathers run ahead on their own stream, so an action
  waits for its gather only when gathering is the bottleneck;
- activations and gradients cross stages with ``send_time`` on the sender's
  pipe stream (serial, as the program's);
- under context parallelism an action is priced as the task graph splits
  it (testbed.sim.ring's ``ring_action_seconds``), and the ring's sends
  left exposed beside each step's attention block it;
- under expert parallelism each MoE layer's dispatch and combine all-to-alls
  (testbed.sim.moe's chain) block the action but for the shared experts'
  compute running beside each: ``max(0, all-to-all - shared half)`` twice;
- gradient buckets reduce on the grad stream while the backward goes on
  (all-reduce, reduce-scatter or HSDP, testbed.plan.sharding's rule), then
  the optimizer runs and, with ZeRO-1/2, the data axis re-gathers parameters;
- the single controller (when the topology calibrates one) dispatches every
  program serially, and devices computing at once on a shared host slow each
  other by ``calibration.host_share``.

What it leaves out is what the DES adds: max-min link sharing between
concurrent streams (gathers and reductions vs. sends), and a shared host's
share varying as stages idle. So the estimate is a fast, honest ranking
signal, not the verdict: the search replays its best candidates with the
DES (testbed.explore.search). Memory comes from testbed.model.memory exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from testbed.collectives.timing import groups_time, send_time
from testbed.model import buffers as dispatch
from testbed.model import costs as model
from testbed.model.memory import MemoryBreakdown, memory_breakdown, state_bytes_per_param
from testbed.pipeline.schedules import Schedule, build_schedule, dependency_keys, execution_order, peak_inflight
from testbed.plan.placement import place
from testbed.plan.sharding import (gathers_parameters, gradient_reduction, moved_elements, parameter_collectives,
                                   reduction_axes, state_sharding)
from testbed.plan.spec import MESH_AXES, Axis, Plan
from testbed.model.gemm import chunk_gemms, gemm_flops, scaled, without
from testbed.sim.barriers import Syncs, interleaved_wait, merge, step_end_wait
from testbed.sim.engine import compute_seconds
from testbed.sim.ring import ring_action_seconds, ring_neighbours
from testbed.sim.moe import Piece, expert_gemms, moe_pieces
from testbed.sim.program import BUCKETS, OPTIMIZER_FLOPS_PER_PARAM, _action_work, accumulate_bytes
from testbed.model.moe import moe_layers
from testbed.model.layout import chunk_layers, chunk_params, held_elements
from testbed.topology import Topology

__all__ = ["Estimate", "estimate", "plan_memory", "cached_schedule", "cached_inflight", "memo_chunk_cost",
           "memo_chunk_gemms"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """The analytic tier's verdict on one plan: seconds per step and its rough split, and the exact memory.

    ``compute_s`` is the busiest stage's compute (actions and optimizer),
    ``comm_s`` its blocking or exposed communication (tensor all-reduces,
    waits for gathers, the gradient tail, the final gather), ``bubble_s``
    the rest of the step.
    """

    step_time_s: float
    compute_s: float
    comm_s: float
    bubble_s: float
    memory_bytes: int
    capacity_bytes: int
    fits: bool

    def __post_init__(self) -> None:
        if not self.step_time_s >= 0:
            raise ValueError(f"step_time_s must be >= 0, got {self.step_time_s}")


@lru_cache(maxsize=4096)
def cached_schedule(name: str, stages: int, microbatches: int, virtual: int) -> tuple[Schedule, tuple]:
    """(schedule table, its execution order with dependency keys), memoized: many candidates share a table."""
    schedule = build_schedule(name, stages, microbatches, virtual)
    order = tuple((s, a, tuple(dependency_keys(schedule, s, a.kind, a.microbatch, a.chunk)))
                  for s, a in execution_order(schedule))
    return schedule, order


def _groups(ids, axes: tuple[Axis, ...], stage: int) -> tuple[tuple[int, ...], ...]:
    """All device groups of ``stage`` varying along ``axes`` (mesh order), the representative's first."""
    dims = [MESH_AXES.index(a) for a in axes]
    block = ids[stage]  # dims: MESH_AXES but stage
    keep = [d - 1 for d in range(1, ids.ndim) if d not in dims]
    moved = block.transpose(keep + [d - 1 for d in sorted(dims)])
    size = 1
    for d in dims:
        size *= ids.shape[d]
    return tuple(tuple(int(x) for x in row) for row in moved.reshape(-1, size))


#: (placement, axes, stage) -> that stage's device groups along the axes: a pure function of its key, kept
#: across plans since building the groups of a 16,384-device mesh takes longer than pricing them.
_GROUPS: dict = {}


class _Collectives:
    """Seconds of one collective over every group of one stage at once (groups share links)."""

    def __init__(self, topology: Topology, ids) -> None:
        self.topology, self.ids = topology, ids
        self.placement = (ids.shape, ids.tobytes())  # plans of one mesh share their groups (a search meets many)

    def time(self, op: str, axes: tuple[Axis, ...], stage: int, nbytes: float) -> float:
        key = (self.placement, axes, stage)
        groups = _GROUPS.get(key)
        if groups is None:
            if len(_GROUPS) > 4096:
                _GROUPS.clear()
            groups = _GROUPS[key] = _groups(self.ids, axes, stage)
        if nbytes <= 0 or len(groups[0]) < 2:
            return 0.0
        return groups_time(self.topology, op, groups, nbytes).time_s


def _reduce_seconds(plan: Plan, coll: _Collectives, stage: int, nbytes: float, expert_bytes: float,
                    leaves: float = 0.0) -> tuple[float, Syncs]:
    """One gradient bucket's reduction (testbed.sim.program's ``_reduce``): per parameter kind, a reduce-scatter
    over its reduction axes the optimizer state is sharded on (``leaves`` collectives of the bucket when the
    parameters are sharded, a share of them per kind; 0: one), then an all-reduce over the rest. Its seconds
    and its collectives as barriers (testbed.sim.barriers), the first first."""
    o_axes = state_sharding(plan).optimizer
    t, syncs = 0.0, []
    degree = lambda axes: math.prod(plan.mesh.degree(a) for a in axes)  # noqa: E731
    for expert, size in ((False, nbytes - expert_bytes), (True, expert_bytes)):
        axes = reduction_axes(plan, expert)
        if size <= 0 or not axes:
            continue
        sharded = tuple(a for a in axes if a in o_axes)
        rest = tuple(a for a in axes if a not in o_axes)
        ways = math.prod(plan.mesh.degree(a) for a in sharded)
        if sharded:
            n = max(1.0, leaves * size / nbytes) if leaves else 1.0
            t += n * coll.time("reduce_scatter", sharded, stage, size / n)
            syncs.append((degree(sharded), n))
        if rest:
            t += coll.time("all_reduce", rest, stage, size / ways)
            syncs.append((degree(rest), 1))
    return t, tuple(syncs)


def _chunk_cost(plan: Plan, stage: int, chunk: int) -> model.ChunkCost:
    """``chunk_cost`` memoized on what it reads (model, stages, virtual, tensor, microbatch size, precision, remat,
    layers per stage)."""
    key = (plan.model, plan.mesh.stage, plan.schedule.virtual_stages, plan.mesh.tensor, plan.microbatch_size,
           plan.precision, plan.remat, plan.sequence_parallel, stage, chunk, plan.layers_per_stage,
           plan.mesh.expert, plan.expert_imbalance, plan.mesh.context)
    cost = _CHUNKS.get(key)
    if cost is None:
        if len(_CHUNKS) > 100_000:
            _CHUNKS.clear()
        cost = _CHUNKS[key] = model.chunk_cost(plan, stage, chunk)
    return cost


_CHUNKS: dict[tuple, model.ChunkCost] = {}


def _chunk_gemms(plan: Plan, stage: int, chunk: int):
    """``testbed.model.gemm.chunk_gemms`` memoized on what it reads (as :func:`_chunk_cost`)."""
    key = (plan.model, plan.mesh.stage, plan.schedule.virtual_stages, plan.mesh.tensor, plan.microbatch_size,
           plan.remat, stage, chunk, plan.layers_per_stage, plan.mesh.expert, plan.expert_imbalance, plan.mesh.context)
    shapes = _GEMMS.get(key)
    if shapes is None:
        if len(_GEMMS) > 100_000:
            _GEMMS.clear()
        shapes = _GEMMS[key] = chunk_gemms(plan, stage, chunk)
    return shapes


_GEMMS: dict[tuple, object] = {}


@lru_cache(maxsize=4096)
def _inflight(name: str, stages: int, microbatches: int, virtual: int) -> tuple[int, ...]:
    return tuple(int(n) for n in peak_inflight(cached_schedule(name, stages, microbatches, virtual)[0]))


def cached_inflight(plan: Plan) -> tuple[int, ...]:
    """The schedule's per-stage peak of activation sets (testbed.model.memory.inflight_microbatches), memoized."""
    return _inflight(plan.schedule.name.value, plan.mesh.stage, plan.batch.microbatches, plan.schedule.virtual_stages)


#: The memoized chunk costs and GEMM shapes, for the search's step floor (testbed.explore.floor).
memo_chunk_cost, memo_chunk_gemms = _chunk_cost, _chunk_gemms


def plan_memory(plan: Plan, topology: Topology) -> MemoryBreakdown:
    """:func:`testbed.model.memory.memory_breakdown`, with the schedule's in-flight counts memoized."""
    return memory_breakdown(plan, topology, _inflight(plan.schedule.name.value, plan.mesh.stage,
                                                      plan.batch.microbatches, plan.schedule.virtual_stages))


def estimate(plan: Plan, topology: Topology, memory: MemoryBreakdown | None = None) -> Estimate:
    """Analytic seconds per step of ``plan`` on ``topology`` (see the module docstring) and its exact memory."""
    memory = memory or plan_memory(plan, topology)
    mesh, v, m = plan.mesh, plan.schedule.virtual_stages, plan.batch.microbatches
    p, dtype, cal = mesh.stage, plan.precision.compute_dtype, topology.calibration
    schedule, order = cached_schedule(plan.schedule.name.value, p, m, v)
    ids = place(plan, topology).device_ids
    coll = _Collectives(topology, ids)
    reps = [int(ids[s].flat[0]) for s in range(p)]
    rings = [ring_neighbours(_groups(ids, (Axis.CONTEXT,), s), reps[s])[0] if mesh.context > 1
             else (reps[s], reps[s]) for s in range(p)]  # no ring: each rank its own (what the groups of one say)
    param_b, grad_b, _ = state_bytes_per_param(plan)
    sharding = state_sharding(plan)
    p_axes, p_ways, o_ways = sharding.params, sharding.ways(plan, "params"), sharding.ways(plan, "optimizer")
    per_microbatch = tuple(Axis(a) for a in gradient_reduction(plan)[0])
    split = schedule.split_backward
    last_kind = "W" if split else "B"
    replicas = math.prod(mesh.degree(a) for a in reduction_axes(plan))  # the axes dense gradients are summed over
    controller = cal.controller
    skewed = cal.host if cal.host is not None and cal.host.skew_s else None  # a shared host's stragglers
    # Programs over several devices one at a time (testbed.sim.program's ``serial``): each action and update
    # starts once the previous one has completed, and its end is a meeting of the stage's devices.
    per_stage = topology.num_devices // p
    serial = cal.host is not None and cal.host.serial_programs and p > 1 and per_stage > 1
    ends = ((per_stage, 1.0),) if serial else ()

    costs = [[_chunk_cost(plan, s, c) for c in range(v)] for s in range(p)]
    combine = cal.collectives.combine_bytes
    # Per (stage, chunk, kind): compute s, tp s, gather s, one bucket piece's compute s, the bucket count,
    # one bucket's reduction s, the per-microbatch reduce-scatter s, sends [(dst, s)], dispatch buffers.
    work: dict[tuple[int, int, str], tuple] = {}
    for s in range(p):
        for c in range(v):
            cost = costs[s][c]
            kernels = max(1, 4 * cost.layers)
            # testbed.sim.program's gather: as many collectives as the rule counts, an equal share of the bytes each.
            leaves = parameter_collectives(plan, s, c, math.inf if combine is None else combine, param_b)
            gather = leaves * coll.time("all_gather", p_axes, s, moved_elements(plan, s, c) * param_b / leaves) \
                if p_ways > 1 else 0.0
            for kind in ("F", "B", "W") if split else ("F", "B"):
                flops, hbm, (rep_b, split_b), tp = _action_work(cost, kind, split, plan.remat)
                gemms = _chunk_gemms(plan, s, c).action(kind, split)
                whole = compute_seconds(topology, dtype, flops, hbm, kernels, rep_b, split_b, cost.tensor_bytes,
                                        gemms)
                n_moe = moe_layers(plan.model, chunk_layers(plan.model, p, v, plan.stage_layers)[s][c])
                chain = moe_pieces(plan, n_moe, kind, split, flops, hbm, (rep_b, split_b), gemms, kernels)
                # Context parallelism: the action as the ring's tasks, and the ring's sends it leaves exposed. With
                # expert parallelism too, the task graph plays the ring on all but the experts' work, then the chain.
                ring_work, ring_gemms = (flops, hbm, rep_b, split_b), gemms
                if chain and mesh.context > 1:
                    moe_g = expert_gemms(plan, n_moe, kind, split)
                    ring_work, ring_gemms = (flops - gemm_flops(moe_g), hbm, rep_b, split_b), without(gemms, moe_g)
                    chain = moe_pieces(plan, n_moe, kind, split, gemm_flops(moe_g), 0.0, (0.0, 0.0), moe_g, len(moe_g))
                ringed = ring_action_seconds(plan, topology, dtype, rings[s], kind, cost.layers, ring_work, ring_gemms,
                                             kernels, cost.tensor_bytes)
                whole, ring_s = ringed or (whole, 0.0)
                if chain:  # the chain's compute tasks, each priced as the task graph prices it
                    whole = (ringed[0] if ringed else 0.0) + sum(
                        compute_seconds(topology, dtype, x.flops, x.hbm_bytes, x.kernels, x.replicated_bytes,
                                        x.split_bytes, cost.tensor_bytes, x.gemms) for x in chain if not x.transfer)
                pieces = min(BUCKETS, max(1, cost.layers)) if kind == last_kind and replicas > 1 and per_microbatch \
                    else 1  # the program's buckets (one when they wait for the backward's end)
                piece = bucket = scatter = acc = 0.0
                bucket_syncs: Syncs = ()
                if kind == last_kind and replicas > 1:  # the program reduces even a one-layer chunk's gradients
                    piece = compute_seconds(topology, dtype, flops / pieces, hbm / pieces,
                                                   max(1, kernels // pieces), rep_b / pieces, split_b / pieces,
                                                   cost.tensor_bytes, scaled(gemms, 1 / pieces))
                    piece = whole / pieces if ringed or chain else piece
                    experts = held_elements(chunk_params(plan.model, s, c, p, v, stage_layers=plan.stage_layers),
                                            mesh.tensor, 1, mesh.expert, experts_only=True)
                    bucket, bucket_syncs = _reduce_seconds(plan, coll, s, moved_elements(plan, s, c, "optimizer") / pieces * grad_b,
                                                           experts / pieces * grad_b, leaves / pieces)
                if kind == last_kind and per_microbatch and m > 1:
                    n = max(1, leaves)
                    scatter = n * coll.time("reduce_scatter", per_microbatch, s, moved_elements(plan, s, c, "grads") * grad_b / n)
                if kind == last_kind:  # the add into the gradient accumulator (a task of its own in the graph)
                    acc = compute_seconds(topology, dtype, 0.0, accumulate_bytes(plan, cost.params, grad_b))
                tp_s = sum(count * coll.time(op, (Axis.TENSOR,), s, cost.tensor_allreduce_bytes) for op, count in tp)
                tp_s += _exposed_all_to_all(chain, coll, topology, dtype, s)
                tp_s += ring_s
                sends = tuple((dst, send_time(topology, reps[s], reps[dst], nbytes))
                              for dst, _, nbytes in _sends(schedule, s, kind, c, costs))
                # The action's collectives as barriers among its kernels (testbed.sim.program's interleave): the
                # tensor collectives, then an earlier microbatch's reduce-scatters or the last one's buckets.
                # Gathers meet on their own stream ahead of the action, with next to no computing since the
                # last meeting (no wait here; the task graph's prefetched gathers wait next to nothing too).
                gathering = gathers_parameters(plan, kind) and p_ways > 1
                own = [(mesh.tensor, n) for _, n in tp if mesh.tensor > 1]
                plain = not chain and not ringed  # the task graph's interleaved actions
                g_ways = math.prod(mesh.degree(a) for a in per_microbatch)
                syncs = (merge([*ends, *own, *([(g_ways, max(1, leaves))] if scatter else [])]) if plain else ends,
                         merge([*ends, *own, *((g, n * pieces) for g, n in bucket_syncs if per_microbatch)]) if plain
                         else ends)
                work[(s, c, kind)] = (whole, tp_s, gather if gathering else 0.0, piece, pieces,
                                      bucket, scatter, sends, acc, syncs, bucket_syncs)

    def play(slow: float) -> tuple[float, list[float], list[float], float]:
        """(step seconds, per-stage compute, per-stage communication, the controller's seconds) with compute
        slowed ``slow`` times."""
        end: dict[tuple, float] = {}     # (stage, kind, microbatch, chunk) -> done on its stage
        arrive: dict[tuple, float] = {}  # ... -> its send has reached the next stage
        free, pipe, gather_free, grad, once = [0.0] * p, [0.0] * p, [0.0] * p, [0.0] * p, [0.0] * p
        once_group = [0] * p  # the group the first of a stage's once-reductions meets
        busy, comm = [0.0] * p, [0.0] * p
        remaining = {(s, c): m for s in range(p) for c in range(v)}
        host = 0.0
        if controller is not None:
            host = controller.step_s + (controller.pipeline_step_s if p > 1 else 0.0)
            if p == 1:
                host += controller.overhead_s + dispatch.spmd_step_buffers(plan) * controller.buffer_s
        carry = [0.0] * p  # a shared host's stragglers: computing since the stage's devices last met
        launch = 0.0  # with ``serial``: when the previous program completed
        for s, action, deps in order:
            c, kind, mb = action.chunk, action.kind, action.microbatch
            compute, tp_s, gather, piece, pieces, bucket, scatter, sends, acc, syncs, bucket_syncs = work[(s, c, kind)]
            compute, piece, acc = slow * compute, slow * piece, slow * acc
            start = max(free[s], launch) if serial else free[s]
            if controller is not None:
                if p > 1:
                    buffers = (dispatch.action_buffers(plan, s, c, kind, remaining[(s, c)] < m)
                               + len(sends) * dispatch.send_buffers(plan))
                    host += (1 + len(sends)) * controller.overhead_s + buffers * controller.buffer_s
                start = max(start, host)
            for key in deps:
                t = end[key] if key[0] == s else arrive[key]
                if t > start:
                    start = t
            if gather:
                gather_free[s] += gather
                if gather_free[s] > start:
                    comm[s] += gather_free[s] - start
                    start = gather_free[s]
            wait = 0.0  # at the action's barriers (a shared host's stragglers): communication, not compute
            if kind == last_kind:
                remaining[(s, c)] -= 1
                last_mb = remaining[(s, c)] == 0
                if last_mb and piece:
                    compute = pieces * piece
                if skewed is not None:  # the action's barriers (testbed.sim.barriers), then the accumulator's add
                    own = syncs[1] if last_mb else syncs[0]
                    if last_mb and piece and pieces > 1:  # the task graph's bucket pieces: an equal share each
                        share = tuple((g, n / pieces) for g, n in own)
                        wait = interleaved_wait(skewed, share, piece, carry[s]) + (pieces - 1) * interleaved_wait(
                            skewed, share, piece, 0.0)
                    else:
                        wait = interleaved_wait(skewed, own, compute, carry[s])
                    carry[s] = acc if own else carry[s] + compute + acc
                    compute += wait
                    piece += wait / pieces
                if last_mb and piece:
                    if not per_microbatch:  # the replicas' one sum, after the stage's backward (program.py)
                        once[s] += pieces * bucket
                        once_group[s] = once_group[s] or (bucket_syncs[0][0] if bucket_syncs else 1)
                    for k in range(pieces if per_microbatch else 0):
                        grad[s] = max(grad[s], start + (k + 1) * piece) + bucket
                elif not last_mb and scatter:
                    grad[s] = max(grad[s], start + compute) + scatter
                compute += acc
            elif skewed is not None:
                wait = interleaved_wait(skewed, syncs[0], compute, carry[s])
                carry[s] = 0.0 if syncs[0] else carry[s] + compute
                compute += wait
            finish = start + compute + tp_s
            busy[s] += compute - wait
            comm[s] += tp_s + wait
            free[s] = finish
            if serial:  # the program ends with its reductions too
                launch = max(finish, grad[s])
            end[(s, kind, mb, c)] = finish
            for _, seconds in sends:
                pipe[s] = max(pipe[s], finish) + seconds
                arrive[(s, kind, mb, c)] = pipe[s]
        step = 0.0
        for s in range(p):
            shard = model.device_stage_params(plan, s, o_ways)  # the program's optimizer shard
            if once[s]:  # the replicas meet first (a shared host's stragglers)
                grad[s] = max(grad[s], free[s], launch) + once[s] + (skewed.barrier_wait(once_group[s], carry[s])
                                                             if skewed else 0.0)
                carry[s] = 0.0
            ready = max(free[s], grad[s], launch)
            if controller is not None and p > 1:
                host += controller.overhead_s + dispatch.update_buffers(plan, s) * controller.buffer_s
                ready = max(ready, host)
            comm[s] += max(0.0, grad[s] - free[s])
            opt = slow * compute_seconds(topology, dtype, OPTIMIZER_FLOPS_PER_PARAM * shard,
                                         shard * (grad_b + param_b + 2 * (4 + 4 * plan.optimizer.moments)), 1)
            busy[s] += opt
            done = ready + opt
            carry[s] += opt
            if serial and skewed is not None:  # the update program's end: the stage's devices meet
                wait = interleaved_wait(skewed, ends, opt, carry[s] - opt)
                comm[s] += wait
                done += wait
                carry[s] = 0.0
            if o_ways > p_ways and mesh.data > 1:
                n = max(1, parameter_collectives(plan, s, None, math.inf if combine is None else combine, param_b,
                                                 which="optimizer"))
                regather = n * coll.time("all_gather", (Axis.DATA,), s, moved_elements(plan, s, None, "optimizer") / mesh.fsdp * param_b / n)
                comm[s] += regather
                done += regather
                if skewed is not None:  # back to back after the update: the first meets the data group
                    wait = skewed.barrier_wait(mesh.data, carry[s])
                    comm[s] += wait
                    done += wait
                    carry[s] = 0.0
            done += step_end_wait(skewed, topology.num_devices // p, carry[s])  # every device meets at the end
            launch = done if serial else launch
            step = max(step, done, host)
        return step, busy, comm, host

    # A shared host (emulated devices): each device computing runs at host_share(n, P) of its speed with n
    # computing at once in P programs (a pipeline's stages). One program (no stages): all its devices compute
    # together whenever it computes, as in the task graph. Pipelines: mean field, n and P the time-averaged
    # counts the previous play gives, refined twice.
    step, busy, comm, host = play(1.0)
    if cal.shares_host and p == 1:
        step, busy, comm, host = play(1.0 / cal.host_share(topology.num_devices))
    elif cal.shares_host and serial:
        # One stage's program computes at a time, beside the controller for the share of the step it works.
        for _ in range(2):
            step, busy, comm, host = play(1.0 / cal.host_share(per_stage + (min(1.0, host / step) if step > 0
                                                                             else 0.0)))
    elif cal.shares_host:
        for _ in range(2):
            stages = sum(busy) / step if step > 0 else 1.0
            step, busy, comm, host = play(1.0 / cal.host_share(stages * per_stage, max(1.0, stages)))
    worst = max(range(p), key=lambda s: busy[s] + comm[s])
    return Estimate(step_time_s=step, compute_s=busy[worst], comm_s=comm[worst],
                    bubble_s=max(0.0, step - busy[worst] - comm[worst]), memory_bytes=int(memory.total),
                    capacity_bytes=int(memory.capacity), fits=bool(memory.fits))


def _exposed_all_to_all(chain: list[Piece], coll: _Collectives, topology: Topology, dtype: str, stage: int) -> float:
    """Seconds an action's MoE all-to-alls block it (testbed.sim.moe's chain): each all-to-all less the shared
    experts' compute the chain runs beside it (the piece that follows it, when it is one)."""
    total = 0.0
    for i, piece in enumerate(chain):
        if piece.transfer:
            a2a = piece.count * coll.time("all_to_all", (Axis.EXPERT,), stage, piece.nbytes)
            beside = chain[i + 1] if i + 1 < len(chain) and chain[i + 1].name.endswith("shared") else None
            overlap = compute_seconds(topology, dtype, beside.flops, 0.0, beside.kernels,
                                      gemms=beside.gemms) if beside else 0.0
            total += max(0.0, a2a - overlap)
    return total


def _sends(schedule: Schedule, stage: int, kind: str, chunk: int, costs) -> list[tuple[int, int, float]]:
    """(destination stage, its chunk, bytes) of what a ``kind`` action of ``chunk`` sends (testbed.sim.program's rule)."""
    g = schedule.model_chunk(stage, chunk)
    if kind == "F" and g < schedule.chunks - 1:
        dst, c = schedule.locate(g + 1)
        if dst != stage:
            return [(dst, c, float(costs[stage][chunk].activation_out_bytes))]
    elif kind == "B" and g > 0:
        dst, c = schedule.locate(g - 1)
        if dst != stage:
            return [(dst, c, float(costs[dst][c].activation_out_bytes))]
    return []

