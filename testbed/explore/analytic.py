"""The search's fast tier: a plan's step time from the simulator's own cost functions, without the DES.

Where the discrete-event simulator (testbed.sim.graph.engine) builds the step's
task graph and plays it as fluids sharing links, this tier plays the same
step facts (testbed.sim.step.facts, from which the task graph is built) over
the pipeline schedule table, stage by stage, with the same prices:

- each F/B/W action costs :func:`testbed.sim.price.compute.compute_seconds` of the
  work the facts give it (``chunk_cost`` of testbed.model.costs, split
  into gradient buckets as the program splits it), plus its blocking
  tensor-parallel all-reduces timed by testbed.collectives.timing over every
  tensor group at once (``groups_time``: the groups share links); under
  ``runtime.tp_comm_overlap`` each block's collectives beside its own GEMMs
  (testbed.sim.step.tp_overlap, played by testbed.explore.play);
- fsdp/ZeRO-3 parameter gathers run block by block on their own stream, at
  most ``runtime.fsdp_prefetch`` blocks ahead of the compute: an action of
  ``n`` blocks waits for its first block's gather, then runs a block every
  ``max(gather, compute)`` per block (``gather + compute`` without prefetch); those the compiler holds with
  the compute (testbed.sim.step.step_rules.held_stream: v5p's all-gathers, a slice's lowered all-reduces) run on
  the compute stream before their block instead (testbed.explore.held_blocks);
- activations and gradients cross stages with ``send_time`` on the sender's
  pipe stream (serial, as the program's);
- under context parallelism an action is priced as the task graph splits
  it (testbed.sim.graph.ring's ``ring_action_seconds``), and the ring's sends
  left exposed beside each step's attention block it;
- under expert parallelism each MoE layer's dispatch and combine all-to-alls
  (testbed.sim.step.moe's chain) block the action but for the shared experts'
  compute running beside each: ``max(0, all-to-all - shared half)`` twice;
- gradient buckets reduce on the grad stream while the backward goes on
  (all-reduce, reduce-scatter or HSDP, testbed.plan.sharding's rule), then
  the optimizer runs and, with ZeRO-1/2, the data axis re-gathers parameters;
- the single controller (when the topology calibrates one) dispatches every program serially, and devices
  computing at once on a shared host slow each other by ``calibration.host_share``, the controller among them for
  its share of a pipeline's step (testbed.sim.price.host_threads); an action's compute is
  ``device.comm_slowdown`` longer for the communication beside it (gathers, the reductions it starts, sends, hidden
  tensor, the ring's sends; block by block where its blocks play their own gathers, GEMM by GEMM beside
  ``tp_comm_overlap``'s chunks), before its gradient reductions leave.

What it leaves out is what the DES adds: max-min link sharing between concurrent streams (gathers and reductions
vs. sends), but for the collectives the compiler holds with the compute (XLA:TPU's all-reduces, v5p's all-gathers),
which play on the compute stream and share the gathers' links as the DES shares them (testbed.explore.held_blocks),
and a shared host's share varying as stages idle. So the estimate is a fast, honest ranking signal,
not the verdict: the search replays its best candidates with the DES (testbed.explore.search). Memory comes from
testbed.model.memory exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from testbed.explore.play import Play
from testbed.explore.play_floor import AboveBar
from testbed.explore.prices import StepPrices
from testbed.model.memory import MemoryBreakdown, memory_breakdown
from testbed.pipeline.schedules import peak_inflight
from testbed.plan.placement import place
from testbed.plan.spec import Plan
from testbed.sim.price.host_threads import controller_load
from testbed.sim.step.facts import StepFacts, cached_order, facts_key, keep, recall, step_facts, topology_rules
from testbed.topology import Topology

__all__ = ["Estimate", "estimate", "estimate_of", "plan_memory", "cached_inflight"]


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
def _inflight(name: str, stages: int, microbatches: int, virtual: int) -> tuple[int, ...]:
    return tuple(int(n) for n in peak_inflight(cached_order(name, stages, microbatches, virtual)[0]))


def cached_inflight(plan: Plan) -> tuple[int, ...]:
    """The schedule's per-stage peak of activation sets (testbed.model.memory.inflight_microbatches), memoized."""
    return _inflight(plan.schedule.name.value, plan.mesh.stage, plan.batch.microbatches, plan.schedule.virtual_stages)


def plan_memory(plan: Plan, topology: Topology) -> MemoryBreakdown:
    """:func:`testbed.model.memory.memory_breakdown`, with the schedule's in-flight counts memoized."""
    return memory_breakdown(plan, topology, _inflight(plan.schedule.name.value, plan.mesh.stage,
                                                      plan.batch.microbatches, plan.schedule.virtual_stages))


#: Plans' keys an :func:`estimate` memo keeps plays of (testbed.sim.step.facts.facts_key), the latest.
MEMO_PLAYS = 64


def estimate(plan: Plan, topology: Topology, memory: MemoryBreakdown | None = None,
             bar: float = math.inf, plays: dict | None = None) -> Estimate | float:
    """Analytic seconds per step of ``plan`` on ``topology`` (see the module docstring) and its exact memory; with a
    finite ``bar``, where the step is certainly above it, a lower bound of the step above ``bar`` instead
    (testbed.explore.play_floor: the play stops there).

    ``plays`` (one dict per topology, empty at first): the plays, whole or stopped above a bar, of the last
    :data:`MEMO_PLAYS` keys (:func:`~testbed.sim.step.facts.facts_key`). A plan whose key was played whole to a
    step at most ``bar`` reuses it (a play stops only once its step's floors, lower bounds, pass the bar, so it
    would have played whole); one whose key's play stopped above a bar at least ``bar`` stops where that play
    checked its first bound above ``bar`` (:class:`_Stopped`: the play, and its bounds, are those of its key).
    """
    ids = place(plan, topology).device_ids
    facts, memory = step_facts(plan, ids, **topology_rules(topology)), memory or plan_memory(plan, topology)
    if plays is None:
        return estimate_of(facts, topology, ids, memory, bar)
    if plays.setdefault("topology", topology) is not topology:
        raise ValueError("an estimate memo holds the plays of one topology")
    key = facts_key(facts, ids, topology.calibration.controller is not None)
    split = recall(plays, key)
    if isinstance(split, _Stopped):
        if bar <= split.bar:
            return next(x for x in split.bounds if x > bar)  # the last is above split.bar
        split = None
    if split is None or split.step_time_s > bar:
        played = _played(facts, topology, ids, bar)
        if isinstance(played, AboveBar):
            if split is None:  # (a whole play kept stays kept)
                keep(plays, key, _Stopped(bar, played.bounds), MEMO_PLAYS)
            return played.floor
        split = played
        keep(plays, key, split, MEMO_PLAYS)
    return _estimate(split, memory)


class _Stopped(NamedTuple):
    """A play stopped above ``bar`` (testbed.explore.play_floor.AboveBar): every bound it checked, in order."""

    bar: float
    bounds: list[float]


class _Split(NamedTuple):
    """A whole play's step and the busiest stage's compute and communication."""

    step_time_s: float
    compute_s: float
    comm_s: float


def _estimate(split: _Split, memory: MemoryBreakdown) -> Estimate:
    step, compute, comm = split
    return Estimate(step_time_s=step, compute_s=compute, comm_s=comm, bubble_s=max(0.0, step - compute - comm),
                    memory_bytes=int(memory.total), capacity_bytes=int(memory.capacity), fits=bool(memory.fits))


def estimate_of(facts: StepFacts, topology: Topology, device_ids, memory: MemoryBreakdown,
                bar: float = math.inf) -> Estimate | float:
    """The analytic estimate of the step ``facts`` describes, placed as ``device_ids`` on ``topology`` (``bar``: as
    :func:`estimate`'s; a shared host's plays are not stopped)."""
    split = _played(facts, topology, device_ids, bar)
    return split.floor if isinstance(split, AboveBar) else _estimate(split, memory)


def _played(facts: StepFacts, topology: Topology, device_ids, bar: float = math.inf) -> _Split | AboveBar:
    """:func:`estimate_of`'s play: the step and its busiest stage's split, or where it stopped above ``bar``.

    A shared host (emulated devices): each device computing runs at host_share(n, P) of its speed with n
    computing at once in P programs (a pipeline's stages). One program (no stages): all its devices compute
    together whenever it computes, as in the task graph. Pipelines: mean field, n and P the time-averaged
    counts the previous play gives, refined twice.
    """
    priced = StepPrices(facts, topology, device_ids)
    cal, p, per_stage = topology.calibration, facts.stages, priced.per_stage
    try:
        step, busy, comm, host = Play(priced, 1.0).run(math.inf if cal.shares_host else bar)
    except AboveBar as above:
        return above
    if cal.shares_host and p == 1:  # all devices compute together; the controller's dispatch precedes them
        share = cal.host_share(topology.num_devices + controller_load(p, host, step))
        step, busy, comm, host = Play(priced, 1.0 / share).run()
    elif cal.shares_host and priced.serial:
        # One stage's program computes at a time, beside the controller for the share of the step it works.
        for _ in range(2):
            share = cal.host_share(per_stage + controller_load(p, host, step))
            step, busy, comm, host = Play(priced, 1.0 / share).run()
    elif cal.shares_host:
        for _ in range(2):
            stages = sum(busy) / step if step > 0 else 1.0
            share = cal.host_share(stages * per_stage + controller_load(p, host, step), max(1.0, stages))
            step, busy, comm, host = Play(priced, 1.0 / share).run()
    worst = max(range(p), key=lambda s: busy[s] + comm[s])
    return _Split(step, busy[worst], comm[worst])
