"""Plan + placement -> the task graph of one training step (the shared IR).

Every task runs on one *representative* device: data replicas, fsdp ranks
and tensor ranks of a pipeline stage execute identical tasks at the same
time, so the program holds one device per stage (mesh coordinate
``(stage, 0, 0, 0)``) and :attr:`Program.representative` maps every device to
its stage's representative. A communication task lists, in ``instances``,
every group (or sender/receiver pair) that runs it at once, so link sharing
between the replicas is not lost.

Streams of a representative: ``compute`` (F/B/W actions, optimizer),
``tensor`` (tensor-parallel all-reduces, or with sequence parallelism all-gathers
and reduce-scatters; blocking: the next action waits),
``gather`` (fsdp/ZeRO-3 parameter all-gathers, prefetched), ``pipe``
(activation and gradient sends) and ``grad`` (gradient reduction, updated
parameter all-gathers) and ``expert`` (an MoE layer's dispatch and combine
all-to-alls under expert parallelism, beside the shared experts' compute:
testbed.sim.moe) and ``ring`` (ring attention's K/V sends to the next
context rank, beside each ring step's attention: testbed.sim.ring). A stream runs its tasks in program order, one at a
time; a task also waits for its ``deps``.

The controller (``build_program(..., controller=True)``): one host thread
prepares the step (task ``op="step"``, ``"pipeline step"`` for a pipeline:
the batch, and its microbatches per stage) and then dispatches every
program, one after another, on the ``host`` stream of the first
representative. A plan without pipeline stages is one SPMD program (one
dispatch before the first action); a pipeline runs one program per action on
its stage's devices (MPMD), so each action waits for its own dispatch, which
also issues the action's sends (``count`` programs in all), and each stage's
optimizer update is one more. The simulator prices the step task at
``calibration.controller.step_s`` (plus ``pipeline_step_s`` for a
pipeline) and a dispatch at ``overhead_s`` per program and
``buffer_s`` per device buffer; on a shared host (the ``calibration.host``
group) the controller takes a core's share like a device.

Programs one at a time (``serial``, the host's ``calibration.host.serial_programs``): XLA:CPU's PjRt
client launches a process's programs over several devices one at a time, each once the previous one
has completed, in dispatch order. A pipeline whose stages span several devices then runs its stages'
actions and updates one after another (:meth:`~testbed.sim.tasks.Builder.serialize`), never two stages
computing at once; stages of one device each still overlap.

On a shared host (testbed.sim.barriers) the collectives an action's program runs among its kernels
(tensor collectives, per-microbatch gradient reduce-scatters and buckets) are also ``syncs`` of its
compute tasks, marked ``interleaved``: its devices meet there and wait for the last of them. Parameter
gathers, which XLA schedules ahead of the kernels back to back (they need only the parameters), a ZeRO-1/2
update's re-gathers (back to back after the update) and the replicas' sums after the backward meet on
their own, as the compiled steps order them.

Gradient accumulation: with more than one microbatch, each chunk's weight-gradient
action (B, or W when split) ends with an ``accumulate`` compute task, the add of the
microbatch's gradients into the step's accumulator: :data:`ACCUMULATE_PASSES` memory
passes over the device's gradients (its shard when they accumulate sharded). It ends the
action's program, so the action's sends leave after it (the runner's MPMD stage programs
and Megatron-LM's backward both finish the add before the gradient goes out).

Parameter and gradient sharding (same conventions as testbed.model.memory):
parameters are sharded over ``P`` = fsdp (+ data when zero = 3) and
all-gathered before each forward action (and backward with full remat:
:func:`~testbed.plan.sharding.gathers_parameters`); optimizer state over
``O`` = fsdp (+ data when zero >= 1). Gradients are reduced in buckets: the
last backward (or W) of each chunk is split into up to :data:`BUCKETS`
pieces; when gradients accumulate sharded (fsdp, ZeRO >= 2: the runner
reduce-scatters them inside each backward) each piece's gradients start
reducing at once, overlapping the rest of the backward pass. When no axis
shards them (ZeRO 0/1 data parallelism) every replica accumulates its own
and the runner sums them once, in the stage's update program
(testbed.runner.replicas.sum_replicas): the buckets then reduce one after another
once the stage's last backward is done, not overlapping it (Megatron-LM's
own DDP, ``--DDP-impl local``, does the same). Each kind of parameter is summed over its
axes (testbed.plan.sharding.reduction_axes: dense ones over the batch axes
data, fsdp, expert and context; routed experts' weights over those but
expert): a reduce-scatter over those of them ``O`` spans, then an all-reduce
of the shard over the rest (an all-reduce over the replicas when nothing is
sharded, one reduce-scatter when ``O`` spans them all, HSDP otherwise). Gradients sharded over an axis (fsdp; data when
zero >= 2) accumulate sharded, so each earlier microbatch's last backward
action also reduce-scatters the chunk's gradients over those axes (as the
runner and DeepSpeed do); over the axes they are replicated on, gradients
are reduced once per step. After the optimizer, parameters sharded in ``O``
but not in ``P`` are all-gathered over the data axis.

How many collectives a gather and a gradient reduce-scatter of a chunk's sharded
parameters is: the runner (testbed.runner.parallel.ParamShards) gathers every sharded
leaf on its own and reduce-scatters its gradient on its own, which XLA:CPU runs
as that many collectives and XLA:GPU combines; testbed.plan.sharding's
:func:`~testbed.plan.sharding.parameter_collectives` counts them under the
topology's ``calibration.collectives.combine_bytes``, and the task carries the
count (``count`` back-to-back collectives of an equal share of the bytes; a
bucket's reduce-scatter its share of them).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from testbed.model import buffers as dispatch

from testbed.model import costs as model
from testbed.model.gemm import chunk_gemms, gemm_flops, scaled, without
from testbed.model.memory import state_bytes_per_param
from testbed.plan.placement import Placement
from testbed.plan.spec import Axis, Plan, Remat
from testbed.pipeline.schedules import Action, Schedule, build_schedule, dependencies
from testbed.plan.sharding import (gathers_parameters, gradient_reduction, moved_elements, parameter_collectives,
                                   reduction_axes, state_sharding)
from testbed.model.layout import chunk_layers, chunk_params, held_elements
from testbed.model.moe import moe_layers
from testbed.sim.moe import A2A_STREAM, expert_gemms, moe_pieces
from testbed.sim.ring import RING_STREAM, layers_share, ring_neighbours, ring_tasks
from testbed.sim.tasks import Builder, Program, Task, TaskKind, axis_groups, axis_groups_cached, rep_group

__all__ = ["TaskKind", "Task", "Program", "build_program", "axis_groups", "BUCKETS", "STREAMS",
           "OPTIMIZER_FLOPS_PER_PARAM", "ACCUMULATE_PASSES", "accumulate_bytes"]

#: Most gradient buckets per chunk (split of the chunk's last backward action).
BUCKETS = 4
STREAMS = ("compute", "tensor", A2A_STREAM, RING_STREAM, "gather", "pipe", "grad", "host")
#: Adam(W) update FLOPs per parameter (moments, bias correction, sqrt, divide, decay).
OPTIMIZER_FLOPS_PER_PARAM = 12
#: Memory passes of adding one microbatch's gradients into the step's accumulator: read both, write one (an
#: unfused add, as Megatron-LM's autograd accumulation into ``param.grad`` and XLA's accumulation loops run it).
ACCUMULATE_PASSES = 3


def accumulate_bytes(plan: Plan, params: int, grad_bytes: float) -> float:
    """HBM bytes one device streams adding one microbatch's gradients of ``params`` into the accumulator.

    Every microbatch adds into an accumulator that starts at zero; a step of one microbatch keeps its
    gradients as they are (0). Sharded accumulation (each microbatch's gradients reduce-scattered first,
    testbed.plan.sharding.gradient_reduction) adds into the device's shard.
    """
    if plan.batch.microbatches <= 1:
        return 0.0
    return ACCUMULATE_PASSES * params * grad_bytes / state_sharding(plan).ways(plan, "grads")


def build_program(plan: Plan, placement: Placement, schedule: Schedule | None = None,
                  controller: bool = False, combine_bytes: float | None = None, serial: bool = False) -> Program:
    """The task graph of one training step of ``plan`` on ``placement``.

    Args:
        schedule: the pipeline table to follow (default: the plan's schedule).
        controller: add the single controller's dispatch tasks (module docstring).
        combine_bytes: the topology's ``calibration.collectives.combine_bytes`` (None: unbounded, one
            collective per chunk's parameter gather or gradient reduce-scatter; module docstring).
        serial: the host runs programs over several devices one at a time in dispatch order (the
            topology's ``calibration.host.serial_programs``; module docstring).
    """
    mesh, v = plan.mesh, plan.schedule.virtual_stages
    p = mesh.stage
    schedule = schedule or build_schedule(plan.schedule.name, p, plan.batch.microbatches, v)
    param_b, grad_b, _ = state_bytes_per_param(plan)
    reps = [int(placement.device_ids[s].flat[0]) for s in range(p)]
    representative = np.empty(placement.num_devices, dtype=np.int64)
    for s in range(p):
        representative[placement.device_ids[s].ravel()] = reps[s]

    tensor = axis_groups(placement, [Axis.TENSOR])
    data_groups = axis_groups(placement, [Axis.DATA])
    sharding = state_sharding(plan)
    p_groups = axis_groups(placement, list(sharding.params))
    p_ways = sharding.ways(plan, "params")
    per_microbatch, _ = gradient_reduction(plan)  # reduced as each microbatch's gradients come (sharded)
    g_groups = axis_groups(placement, [Axis(a) for a in per_microbatch])
    o_ways = sharding.ways(plan, "optimizer")
    costs = [[model.chunk_cost(plan, s, c) for c in range(v)] for s in range(p)]
    # Per chunk, the collectives one gather of its sharded parameters (and one reduce-scatter of their gradients) is.
    combine = math.inf if combine_bytes is None else combine_bytes
    leaf_counts = [[parameter_collectives(plan, s, c, combine, param_b) for c in range(v)] for s in range(p)]
    # Per chunk, the elements a collective over each state's shard axes moves, padded shards' padding included.
    moved = [[{w: moved_elements(plan, s, c, w) for w in ("params", "grads", "optimizer")} for c in range(v)]
             for s in range(p)]
    experts = axis_groups(placement, [Axis.EXPERT])  # the dispatch/combine all-to-alls' groups
    spans = chunk_layers(plan.model, p, v, plan.stage_layers)
    moe_counts = [[moe_layers(plan.model, spans[s][c]) for c in range(v)] for s in range(p)]
    # Per chunk, the routed experts' parameters on one device: reduced over the batch axes but expert.
    expert_params = [[held_elements(chunk_params(plan.model, s, c, p, v, stage_layers=plan.stage_layers),
                                    mesh.tensor, 1, mesh.expert, experts_only=True) for c in range(v)] for s in range(p)]
    groups: dict = {"placement": placement}  # gradient reduction groups by axes, memoized (_reduce)
    shapes = [[chunk_gemms(plan, s, c) for c in range(v)] for s in range(p)]
    contexts = axis_groups(placement, [Axis.CONTEXT])  # ring attention: each rank sends to the next of its ring
    ring_pair, rings = zip(*(ring_neighbours(contexts[s], reps[s]) for s in range(p)))
    # Sender/receiver pairs between two stages: the same (data, fsdp, tensor) coordinate (made for the stage
    # pairs that send, when they first do).
    @functools.cache
    def stage_pairs(a: int, b: int) -> tuple[tuple[int, int], ...]:
        return tuple(zip(placement.device_ids[a].ravel().tolist(), placement.device_ids[b].ravel().tolist()))

    b = Builder()
    done: dict[tuple[int, Action], int] = {}      # action -> its last task (TP all-reduce or compute)
    sent: dict[tuple[int, Action, int], int] = {}  # (stage, action, dst stage) -> send task
    reduce_tasks: dict[int, list[int]] = {s: [] for s in range(p)}
    once: dict[int, list[tuple[float, float, str]]] = {s: [] for s in range(p)}  # reduced after the backward
    last_bwd_kind = "W" if schedule.split_backward else "B"
    order = _global_order(schedule)
    remaining_bwd = {(s, c): plan.batch.microbatches for s in range(p) for c in range(v)}

    previous: dict[int, int] = {}  # stage -> last task of its previous action (tensor all-reduces block)
    # The programs over several devices, in dispatch order (run one at a time with ``serial``): an MPMD stage's
    # actions and updates; an SPMD step is one program.
    programs: list[tuple[range, int]] = []
    serial = serial and p > 1
    host = reps[0]
    if controller:
        b.add(name="prepare step", device=host, stream="host", kind=TaskKind.HOST,
              op="step" if p == 1 else "pipeline step", count=0)
    if controller and p == 1:
        previous[0] = b.add(name="dispatch step", device=host, stream="host", kind=TaskKind.HOST,
                            buffers=dispatch.spmd_step_buffers(plan))
    for s, action in order:
        rep, cost = reps[s], costs[s][action.chunk]
        label = action.label(v)
        first, computes = len(b.tasks), []  # the action's tasks from here; its compute pieces (barriers)
        deps: list[int] = [previous[s]] if s in previous else []
        if controller and p > 1:
            n_sends = len(_sends(schedule, s, action, costs))
            accumulated = remaining_bwd[(s, action.chunk)] < plan.batch.microbatches
            deps.append(b.add(name=f"dispatch {label}@{s}", device=host, stream="host", kind=TaskKind.HOST,
                              count=1 + n_sends, buffers=dispatch.action_buffers(
                                  plan, s, action.chunk, action.kind, accumulated) + n_sends * dispatch.send_buffers(plan)))
        for ds, dep in dependencies(schedule, s, action):
            key = (ds, dep)
            if ds != s:
                deps.append(sent[(ds, dep, s)])
            else:
                deps.append(done[key])
        leaves = leaf_counts[s][action.chunk]
        if gathers_parameters(plan, action.kind):
            deps.append(b.add(name=f"gather {label}", device=rep, stream="gather", kind=TaskKind.COLLECTIVE,
                              op="all_gather", nbytes=moved[s][action.chunk]["params"] * param_b / leaves, count=leaves,
                              group=rep_group(p_groups[s], rep), instances=p_groups[s]))
        flops, hbm, (replicated, split), tp = _action_work(cost, action.kind, schedule.split_backward, plan.remat)
        kernels = max(1, 4 * cost.layers)
        gemms = shapes[s][action.chunk].action(action.kind, schedule.split_backward)
        pieces, scatter, reduce = 1, False, False
        if action.kind == last_bwd_kind:
            remaining_bwd[(s, action.chunk)] -= 1
            if remaining_bwd[(s, action.chunk)] == 0 and reduction_axes(plan):
                # One bucket per layer, at most BUCKETS (a one-layer chunk reduces its gradients at once); one
                # when the buckets wait for the backward's end anyway (no sharded accumulation, module docstring).
                pieces, reduce = (min(BUCKETS, max(1, cost.layers)) if per_microbatch else 1), True
            # An earlier microbatch: its gradients are reduce-scattered into the sharded accumulator.
            scatter = remaining_bwd[(s, action.chunk)] > 0 and bool(per_microbatch)
        last = -1
        chain = moe_pieces(plan, moe_counts[s][action.chunk], action.kind, schedule.split_backward, flops, hbm,
                           (replicated, split), gemms, kernels)
        if chain and mesh.context > 1:
            # Both rings: the action's ring attention and the rest first (testbed.sim.ring), then the MoE chain
            # on the routed and shared experts' work alone (its own rest is empty).
            moe_g = expert_gemms(plan, moe_counts[s][action.chunk], action.kind, schedule.split_backward)
            work = (flops - gemm_flops(moe_g), hbm, replicated, split)
            deps = [_add_ring(b, ring_tasks(plan, action.kind, label, cost.layers, 1.0, work, without(gemms, moe_g),
                                            kernels), rep, deps, cost.tensor_bytes, ring_pair[s], rings[s])]
            chain = moe_pieces(plan, moe_counts[s][action.chunk], action.kind, schedule.split_backward,
                               gemm_flops(moe_g), 0.0, (0.0, 0.0), moe_g, len(moe_g))
        # A bucket of gradients closes after every few MoE layers (as the dense path's ``pieces``).
        bucket, done_buckets, closes = 0, 0, set()
        if chain and reduce:
            closes = {max(1, round((k + 1) * sum(x.layer_end for x in chain) / pieces)) for k in range(pieces)}
        ids: list[int] = []
        for piece in chain:  # an MoE action under expert parallelism: its per-layer chain (testbed.sim.moe)
            a2a = piece.transfer
            last = b.add(name=f"{label}{piece.name}", device=rep, stream=piece.stream,
                         kind=TaskKind.COLLECTIVE if a2a else TaskKind.COMPUTE,
                         deps=tuple(deps) if piece.after is None else tuple(ids[j] for j in piece.after), flops=piece.flops,
                         hbm_bytes=piece.hbm_bytes, replicated_bytes=piece.replicated_bytes,
                         split_bytes=piece.split_bytes, tensor_bytes=0.0 if a2a else cost.tensor_bytes,
                         kernels=piece.kernels, op="all_to_all" if a2a else "", nbytes=piece.nbytes, count=piece.count,
                         group=rep_group(experts[s], rep) if a2a else (), instances=experts[s] if a2a else (),
                         pipeline=True, gemms=piece.gemms)
            ids.append(last)
            bucket += piece.layer_end
            if piece.layer_end and bucket in closes:
                share, done_buckets = 1 / len(closes), done_buckets + 1
                bucket_of = (moved[s][action.chunk]["optimizer"] * share * grad_b, expert_params[s][action.chunk] * share * grad_b,
                             f"{label}/{done_buckets - 1}", bucket_share(leaves, len(closes), done_buckets - 1))
                if per_microbatch:
                    reduce_tasks[s].extend(_reduce(b, plan, rep, s, last, *bucket_of, groups))
                else:
                    once[s].append(bucket_of)
        for k in range(0 if chain else pieces):
            name, share = label if pieces == 1 else f"{label}/{k}", layers_share(cost.layers, pieces, k)
            # Context parallelism: the ring's steps and sends (testbed.sim.ring).
            ringed = _add_ring(b, ring_tasks(plan, action.kind, name, share, share / max(1, cost.layers),
                                             (flops, hbm, replicated, split), gemms, kernels),
                               rep, deps, cost.tensor_bytes, ring_pair[s], rings[s])
            last = ringed if ringed is not None else b.add(
                name=name, device=rep, stream="compute",
                kind=TaskKind.COMPUTE, deps=tuple(deps), flops=flops / pieces, hbm_bytes=hbm / pieces,
                replicated_bytes=replicated / pieces, split_bytes=split / pieces,
                tensor_bytes=cost.tensor_bytes, kernels=max(1, kernels // pieces), pipeline=True,
                gemms=scaled(gemms, 1 / pieces) if pieces > 1 else gemms)
            computes += [] if ringed is not None else [last]
            deps = []
            if reduce:
                # Bucket k holds 1/pieces of the chunk's gradients: reduced while the backward continues when
                # they accumulate sharded, else once the stage's backward is done.
                bucket_of = (moved[s][action.chunk]["optimizer"] / pieces * grad_b, expert_params[s][action.chunk] / pieces * grad_b,
                             label if pieces == 1 else f"{label}/{k}", bucket_share(leaves, pieces, k))
                if per_microbatch:
                    reduce_tasks[s].extend(_reduce(b, plan, rep, s, last, *bucket_of, groups))
                else:
                    once[s].append(bucket_of)
        if scatter:
            reduce_tasks[s].append(b.add(name=f"reduce_scatter {label} (accumulate)", device=rep, stream="grad",
                                         kind=TaskKind.COLLECTIVE, deps=(last,), op="reduce_scatter",
                                         nbytes=moved[s][action.chunk]["grads"] * grad_b / max(1, leaves), count=max(1, leaves),
                                         group=rep_group(g_groups[s], rep), instances=g_groups[s]))
        for op, count in tp if mesh.tensor > 1 else ():
            # Megatron's all-reduces, or with sequence parallelism all-gathers and reduce-scatters
            # (ChunkCost.tensor_collectives, the one decision the analytic tier reads too).
            last = b.add(name=f"tp {label}" if op == "all_reduce" else f"tp {label} {op}", device=rep,
                         stream="tensor", kind=TaskKind.COLLECTIVE, deps=(last,), op=op,
                         nbytes=cost.tensor_allreduce_bytes, count=count, group=rep_group(tensor[s], rep),
                         instances=tensor[s], pipeline=True)
        if action.kind == last_bwd_kind and (acc := accumulate_bytes(plan, cost.params, grad_b)):
            # The add into the accumulator ends the action's program: its sends leave after it.
            last = b.add(name=f"accumulate {label}", device=rep, stream="compute", kind=TaskKind.COMPUTE,
                         deps=(last,), hbm_bytes=acc, pipeline=True)
        if not chain:  # the action's collectives run among its kernels (a shared host's barriers); XLA hoists
            # the parameter gathers (they need only the parameters) ahead of the kernels: those meet on their own.
            b.interleave(computes, [i for i in range(first, len(b.tasks)) if b.tasks[i].stream != "gather"])
        done[(s, action)] = previous[s] = last
        if placement.device_ids[s].size > 1:
            programs.append((range(first, len(b.tasks)), placement.device_ids[s].size))
        for dst, dst_chunk, nbytes in _sends(schedule, s, action, costs):
            sent[(s, action, dst)] = b.add(name=f"send {label}->{dst}", device=rep, stream="pipe", kind=TaskKind.SEND,
                                           deps=(last,), nbytes=nbytes, group=(rep, reps[dst]),
                                           instances=stage_pairs(s, dst))

    for s in range(p):
        rep, first = reps[s], len(b.tasks)
        for bucket_of in once[s]:  # the update's one reduction of the replicas' gradients, after the backward
            reduce_tasks[s].extend(_reduce(b, plan, rep, s, previous[s], *bucket_of, groups))
        shard = model.device_stage_params(plan, s, o_ways)  # the optimizer's shard, by the layout's one rule
        waits = list(reduce_tasks[s])
        if controller and p > 1:
            waits.append(b.add(name=f"dispatch optimizer@{s}", device=host, stream="host", kind=TaskKind.HOST,
                               buffers=dispatch.update_buffers(plan, s)))
        opt = b.add(name="optimizer", device=rep, stream="compute", kind=TaskKind.COMPUTE,
                    deps=tuple(waits), flops=OPTIMIZER_FLOPS_PER_PARAM * shard,
                    hbm_bytes=shard * (grad_b + param_b + 2 * (4 + 4 * plan.optimizer.moments)), kernels=1)
        if o_ways > p_ways and mesh.data > 1:
            # ZeRO-1/2: the updated shards gathered over data, as many collectives as the rule counts (per leaf).
            n = max(1, parameter_collectives(plan, s, None, combine, param_b, which="optimizer"))
            b.add(name="gather params", device=rep, stream="grad", kind=TaskKind.COLLECTIVE, deps=(opt,),
                  op="all_gather", nbytes=sum(m["optimizer"] for m in moved[s]) / mesh.fsdp * param_b / n, count=n,
                  group=rep_group(data_groups[s], rep), instances=data_groups[s])
        if placement.device_ids[s].size > 1:
            programs.append((range(first, len(b.tasks)), placement.device_ids[s].size))
    if serial:
        b.serialize(programs)
    return Program(tasks=tuple(b.tasks), representative=representative, schedule=schedule)


def _add_ring(b: Builder, tasks: list, rep: int, deps: list[int], tensor_bytes: float, pair: tuple[int, int],
              rings) -> int | None:
    """Adds testbed.sim.ring's tasks of one action (or bucket) after ``deps``; returns the last (None: no ring)."""
    ids: list[int] = []
    for t in tasks:
        ids.append(b.add(
            name=t.name, device=rep, stream=t.stream, kind=TaskKind.SEND if t.transfer else TaskKind.COMPUTE,
            deps=tuple(deps) if t.after is None else tuple(ids[j] for j in t.after), flops=t.flops,
            hbm_bytes=t.hbm_bytes, replicated_bytes=t.replicated_bytes, split_bytes=t.split_bytes,
            tensor_bytes=0.0 if t.transfer else tensor_bytes, kernels=t.kernels, nbytes=t.nbytes,
            count=t.count or 1, group=pair if t.transfer else (), instances=rings if t.transfer else (),
            pipeline=True, gemms=t.gemms))
    return ids[-1] if ids else None


def _global_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """Actions in an order where every dependency comes first (stages keep their table order)."""
    from testbed.pipeline.schedules import execution_order

    return execution_order(schedule)


def _action_work(cost: model.ChunkCost, kind: str, split: bool, remat: Remat,
                 ) -> tuple[float, float, tuple[float, float], tuple[tuple[str, int], ...]]:
    """(FLOPs, HBM bytes, (replicated, split) activation bytes, tensor collectives) of one action, one microbatch.

    The backward writes about twice the forward's activation traffic (the
    gradients of each activation and of its inputs), B and W one forward's
    worth each when split, plus what remat writes again. Full remat reruns
    each layer's forward up to the MLP down projection in the backward, so
    the attention output's tensor all-reduce runs again (one per layer);
    selective remat redoes no all-reduce. The tensor collectives are
    ``(op, count)`` pairs from :meth:`testbed.model.costs.ChunkCost.tensor_collectives`
    (all-reduces, or with sequence parallelism all-gathers and reduce-scatters).
    """
    forward = cost.forward_traffic
    if kind == "F":
        return float(cost.forward_flops), float(cost.forward_bytes), tuple(map(float, forward)), \
            cost.tensor_collectives("F", remat)
    if kind == "B":
        flops = cost.backward_input_flops + cost.recompute_flops + (0 if split else cost.backward_weight_flops)
        hbm = cost.backward_bytes / 2 if split else cost.backward_bytes
        times = 1 if split else 2
        traffic = tuple(float(times * f + r) for f, r in zip(forward, cost.recompute_traffic))
        return float(flops), float(hbm), traffic, cost.tensor_collectives("B", remat)
    return float(cost.backward_weight_flops), cost.backward_bytes / 2, tuple(map(float, forward)), ()


def _sends(schedule: Schedule, stage: int, action: Action, costs) -> list[tuple[int, int, float]]:
    """(destination stage, its chunk, bytes) of the transfers ``action`` produces."""
    g = schedule.model_chunk(stage, action.chunk)
    out = []
    if action.kind == "F" and g < schedule.chunks - 1:
        dst, c = schedule.locate(g + 1)
        if dst != stage:
            out.append((dst, c, float(costs[stage][action.chunk].activation_out_bytes)))
    elif action.kind == "B" and g > 0:
        dst, c = schedule.locate(g - 1)
        if dst != stage:
            out.append((dst, c, float(costs[dst][c].activation_out_bytes)))
    return out


def _reduce(b: Builder, plan: Plan, rep: int, s: int, after: int, nbytes: float, expert_bytes: float, label: str,
            leaves: int, groups: dict) -> list[int]:
    """Gradient reduction tasks of one bucket of ``nbytes`` (``expert_bytes`` of them routed experts' weights);
    returns the last task(s). ``leaves``: the collectives the bucket's reduce-scatter is when the parameters are
    sharded (:func:`bucket_share`; 0: one).

    Each kind of parameter is summed over its axes (testbed.plan.sharding.reduction_axes: dense ones over
    data, fsdp, expert and context, routed experts' over those but expert): a reduce-scatter over those of
    them the optimizer state is sharded on (fsdp; data with ZeRO >= 1), then an all-reduce of the shard over
    the rest (HSDP: data without ZeRO; expert, context).
    """
    mesh, o_axes = plan.mesh, state_sharding(plan).optimizer
    out = []
    for expert, size in ((False, nbytes - expert_bytes), (True, expert_bytes)):
        axes = reduction_axes(plan, expert)
        if size <= 0 or not axes:
            continue
        sharded = [a for a in axes if a in o_axes]
        rest = [a for a in axes if a not in o_axes]
        ways = math.prod(mesh.degree(a) for a in sharded)
        kind = " experts" if expert else ""
        last = after
        if sharded:
            g = axis_groups_cached(groups, plan, sharded, s)
            # Of the bucket's collectives, the parameter kinds' shares (a piece of each as its bytes are).
            n = max(1, round(leaves * size / nbytes)) if leaves else 1
            last = b.add(name=f"reduce_scatter {label}{kind}", device=rep, stream="grad", kind=TaskKind.COLLECTIVE,
                         deps=(last,), op="reduce_scatter", nbytes=size / n, count=n, group=rep_group(g, rep),
                         instances=g)
        if rest:
            g = axis_groups_cached(groups, plan, rest, s)
            last = b.add(name=f"all_reduce {label}{kind}", device=rep, stream="grad", kind=TaskKind.COLLECTIVE,
                         deps=(last,), op="all_reduce", nbytes=size / ways, group=rep_group(g, rep), instances=g)
        out.append(last)
    return out


def bucket_share(leaves: int, buckets: int, k: int) -> int:
    """Of a chunk's ``leaves`` gradient collectives, those bucket ``k`` of ``buckets`` reduces (0 stays 0: the
    parameters are not sharded, one reduction per bucket). Whole numbers summing to ``leaves``, at least 1."""
    if leaves <= 0:
        return 0
    return max(1, leaves * (k + 1) // buckets - leaves * k // buckets)
