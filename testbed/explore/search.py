"""Search for the best plan: enumerate, prune by memory, rank analytically, replay the best with the DES.

1. :func:`testbed.explore.candidates.candidates` enumerates the plans the runner
   accepts (divisibility is pruned there, before any cost is computed);
2. each candidate's memory comes from testbed.model.memory, exactly; those
   over ``memory_cap`` x device memory are dropped;
3. the rest get the analytic tier's step time (testbed.explore.analytic) and
   are ranked by the objective;
4. the best ``replay`` of them (and any within ``margin`` of the best
   estimate) are simulated with the discrete-event simulator, whose report
   decides the final ranking: the analytic tier only chooses what to replay.
   Once ``top`` are replayed, a replay stops as soon as its step is certainly
   slower than the ``top`` fastest so far (testbed.sim.graph.engine.run's bar),
   so the ``top`` fastest replayed are those of replaying every one whole.

Objectives: ``step_time`` (seconds, lower is better), ``tokens_per_s``,
``mfu`` and ``cost`` (tokens per dollar, from a price per device-hour);
higher is better for the last three. With the model, global batch, device
count and precision fixed they order plans alike; they differ once the
space lists several precisions (MFU counts each against its own peak).
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from testbed.errors import InputError
from testbed.explore.analytic import Estimate, estimate, plan_memory
from testbed.explore.eta import TimeLeft
from testbed.explore.collector import rarely_collected
from testbed.explore.floor import cached_peaks, cached_played_floor, cached_step_floor, group_floor_key, placed_floor
from testbed.explore.gather_floor import gather_floor
from testbed.explore.slowed_floor import slowed_floor
from testbed.model.memory import probe_stages, stage_memory, state_floor
from testbed.explore.choices import SearchSpace
from testbed.explore.candidates import CandidateGroup, candidate_groups, candidates
from testbed.explore.objectives import OBJECTIVES, objective_value
from testbed.plan.spec import Plan
from testbed.sim.graph.engine import StepAboveBar, simulate
from testbed.sim.report.exposed import cached_exposed_by_kind
from testbed.sim.report.timeline import Report
from testbed.topology import Topology

__all__ = ["OBJECTIVES", "Candidate", "SearchResult", "search", "objective_value", "evaluate", "exhaustive_optimum"]

#: Layouts whose model states fit that a search bounds at most (each kept as its step floor and a reference into
#: its candidate group, about 200 bytes; a plan is built only once it may be estimated).
MAX_CANDIDATES = 1_000_000
@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One evaluated plan: its analytic estimate, its DES report once replayed, and its objective value."""

    plan: Plan
    estimate: Estimate
    report: Report | None = None
    value: float
    #: Once replayed: the DES step's exposed communication by kind (testbed.sim.report.exposed.exposed_by_kind).
    exposed_by_kind: dict[str, float] = field(default_factory=dict)

    @property
    def step_time_s(self) -> float:
        """The DES step time when replayed, else the analytic one."""
        return self.report.step_time_s if self.report is not None else self.estimate.step_time_s

    def summary(self) -> dict:
        """JSON-ready: the layout choices, both step times, the DES breakdown and the memory."""
        p, r, e = self.plan, self.report, self.estimate
        out = {"data": p.mesh.data, "fsdp": p.mesh.fsdp, "tensor": p.mesh.tensor, "stage": p.mesh.stage,
               "expert": p.mesh.expert, "context": p.mesh.context, "expert_tensor": p.mesh.expert_tensor_degree,
               "schedule": p.schedule.name.value, "virtual_stages": p.schedule.virtual_stages,
               "microbatches": p.batch.microbatches, "zero": p.zero, "remat": p.remat.value,
               "sequence_parallel": p.sequence_parallel,
               "precision": p.precision.value, "value": self.value, "step_time_s": self.step_time_s,
               "analytic_step_time_s": e.step_time_s, "memory_bytes": e.memory_bytes,
               "capacity_bytes": e.capacity_bytes}
        if r is not None:
            out.update({"compute_s": r.compute_s, "exposed_comm_s": r.exposed_comm_s,
                        "bubble_fraction": r.bubble_fraction, "mfu": r.mfu})
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchResult:
    """Ranked replayed candidates (best first) and what the search did to find them."""

    ranked: tuple[Candidate, ...]
    objective: str
    enumerated: int
    pruned_memory: int
    estimated: int
    #: Plans skipped, before their memory, because their step-time floor could not reach the replay list.
    pruned_bound: int = 0
    replayed: int
    analytic_s: float
    replay_s: float
    shortlist: tuple[Candidate, ...] = field(default=())
    #: Of the ``replayed``, those the DES stopped once certainly slower than the ``top`` fastest (not in ``ranked``).
    replays_stopped: int = 0

    @property
    def best(self) -> Candidate:
        if not self.ranked:
            raise InputError("no candidate plan fits in memory; raise --memory-cap, add devices or shrink the "
                             "model or batch", field="--memory-cap")
        return self.ranked[0]

    @property
    def plans_per_minute(self) -> float:
        """Candidates the analytic tier handled (memory and, if it fits, step time) per minute."""
        return 60.0 * self.enumerated / self.analytic_s if self.analytic_s > 0 else float("inf")


def _within_limits(plan: Plan) -> bool:
    """A candidate the plan limits admit (testbed.plan.limits: a layout of 10^5 pipeline actions is not built)."""
    from testbed.plan.limits import check_plan_limits

    try:
        check_plan_limits(plan)
    except InputError:
        return False
    return True


def _sort_key(objective: str, c: Candidate) -> tuple:
    value = -c.value if OBJECTIVES[objective] else c.value
    return value, c.estimate.memory_bytes


def evaluate(plan: Plan, topology: Topology, memory_cap: float = 1.0, floors: dict | None = None,
             bar: float = math.inf, plays: dict | None = None, checked: bool = False) -> Estimate | float | None:
    """The analytic estimate of ``plan``, or None when it needs more than ``memory_cap`` of device memory (with a
    finite ``bar``, a lower bound of the estimate above ``bar`` where it certainly is: testbed.explore.analytic).

    Before the exact memory of every stage, two exact lower bounds drop most plans that overflow cheaply:
    the model states of the fullest-looking stage (:func:`testbed.model.memory.state_floor`, the same for
    every schedule, microbatch count and remat of a mesh, so kept in ``floors`` across calls when given),
    then those stages' whole peak bytes (:func:`testbed.model.memory.stage_memory`). Neither changes which
    plans fit: a plan is dropped only when a device overflows (``plays``: its memo; ``checked``: no bound overflows).
    """
    if not checked and _overflows(plan, topology, memory_cap, floors):
        return None
    memory = plan_memory(plan, topology)
    if memory.total > memory_cap * memory.capacity:
        return None
    return estimate(plan, topology, memory, bar, plays)


def _states_overflow(plan: Plan, limit: float, floors: dict | None) -> bool:
    """Whether ``plan``'s model states alone (testbed.model.memory.state_floor, the same for every plan of its
    candidate group) need more than ``limit`` bytes on some device; memoized in ``floors`` when given."""
    key = (plan.mesh, plan.zero, plan.precision, plan.schedule.virtual_stages, plan.layers_per_stage)
    floor = None if floors is None else floors.get(key)
    if floor is None:
        floor = state_floor(plan)
        if floors is not None:
            floors[key] = floor
    return floor > limit


def _overflows(plan: Plan, topology: Topology, memory_cap: float, floors: dict | None) -> bool:
    """Whether one of ``plan``'s devices certainly needs more than ``memory_cap`` of its memory, by the two
    cheap exact lower bounds :func:`evaluate` describes (False: it may still overflow elsewhere)."""
    limit = memory_cap * int(topology.device.memory_bytes)  # as MemoryBreakdown.capacity
    if _states_overflow(plan, limit, floors):
        return True
    inflight = cached_peaks(plan.schedule.name.value, plan.mesh.stage, plan.batch.microbatches,
                            plan.schedule.virtual_stages)
    capacity = int(topology.device.memory_bytes)
    rules = topology.device.buffer_rules
    return any(stage_memory(plan, s, inflight[s], capacity, rules).total > limit for s in probe_stages(plan))


@rarely_collected
def search(base: Plan, topology: Topology, space: SearchSpace = SearchSpace(), *, objective: str = "step_time",
           memory_cap: float = 1.0, replay: int = 16, margin: float = 0.02, top: int = 5,
           price_per_device_hour: float | None = None, stop_replays: bool = True,
           progress: Callable[[str, int, int], None] | None = None) -> SearchResult:
    """Find the best layout of ``base`` on ``topology``: the DES-ranked best ``max(top, replay)`` candidates.

    Args:
        space: what may vary (testbed.explore.choices).
        objective: one of :data:`OBJECTIVES`.
        memory_cap: fraction of device memory a plan may use (0, 1].
        replay: how many analytically best candidates the DES replays; also
            every one within ``margin`` (relative) of the best estimate.
        stop_replays: ranking by step time, stop each replay once it is certainly
            slower than the ``top`` fastest replayed so far (the ``top`` are the same).
        progress: called with ("bounds", done, total, left_s) while every plan's
            model states and step floor are bounded (ranking by step time),
            ("analytic", done, total, left_s) as the analytic tier advances, then
            ("replay", done, total, left_s) during the DES replay; ``left_s`` is
            the search's estimate of its seconds left (testbed.explore.eta), or
            None while it has no rate to go by.
    """
    _check_arguments(base, topology, objective, memory_cap, replay, top, price_per_device_hour)
    groups = [g for g in candidate_groups(base, topology.num_devices, space) if _within_limits(g.head)]
    if not groups:
        raise InputError(f"no layout of this model and batch divides over {topology.num_devices} devices within "
                         f"the plan limits (testbed.plan.limits)", field="--devices")
    start = time.perf_counter()
    # Every objective but MFU ranks plans of one model, batch and device count as step time does (MFU also
    # weighs each precision's peak): only then may a plan be skipped for its step-time floor.
    by_time = objective != "mfu" or space.precisions is None
    def rank(plan: Plan, step_time_s: float) -> float:
        return objective_value(objective, plan, topology, step_time_s, price_per_device_hour)

    eta = TimeLeft()
    tier = _analytic_tier(groups, topology, memory_cap, max(replay, top), margin, by_time, rank, progress, eta)
    tier.top = top if by_time and stop_replays else 0
    analytic_s = time.perf_counter() - start
    shortlist = sorted(tier.shortlist, key=lambda c: _sort_key(objective, c))
    chosen = shortlist[:max(replay, top)]
    if shortlist:
        best_est = shortlist[0].estimate.step_time_s
        chosen += [c for c in shortlist[len(chosen):] if c.estimate.step_time_s <= best_est * (1 + margin)]
    start = time.perf_counter()
    replayed = _replay_all(chosen, topology, rank, progress, eta, tier)
    if by_time and replayed:
        replayed += _settle(shortlist[len(chosen):], tier, replayed, topology, memory_cap, margin, rank, progress)
        shortlist = sorted([*shortlist, *tier.revived], key=lambda c: _sort_key(objective, c))
    replayed.sort(key=lambda c: _sort_key(objective, c))
    return SearchResult(ranked=tuple(replayed), objective=objective, enumerated=tier.enumerated,
                        pruned_memory=tier.pruned, pruned_bound=tier.bounded - len(tier.revived), estimated=len(shortlist),
                        replayed=len(replayed) + tier.stopped, analytic_s=analytic_s,
                        replay_s=time.perf_counter() - start, shortlist=tuple(shortlist), replays_stopped=tier.stopped)


def _check_arguments(base: Plan, topology: Topology, objective: str, memory_cap: float, replay: int, top: int,
                     price_per_device_hour: float | None) -> None:
    """:func:`search`'s arguments, each refused with the option it came from."""
    if objective not in OBJECTIVES:
        raise InputError(f"unknown objective `{objective}`; valid: {', '.join(OBJECTIVES)}", field="--objective")
    if not 0 < memory_cap <= 1:
        raise InputError(f"must be a fraction of device memory in (0, 1], got {memory_cap}", field="--memory-cap")
    if replay < 1 or top < 1:
        raise InputError(f"must be at least 1, got {min(replay, top)}", field="--top")
    if objective == "cost":
        objective_value(objective, base, topology, 1.0, price_per_device_hour)  # validates the price first


def _replay_all(chosen: list, topology: Topology, rank: Callable, progress: Callable | None, eta: TimeLeft,
                tier: _Tier) -> list:
    """The chosen candidates replayed by the DES (:func:`_replayed`), one by one, the progress told after each."""
    replayed = []
    eta.update("replay", 0)
    for k, c in enumerate(chosen):
        if (done := _replayed(c, topology, rank, tier)) is not None:
            replayed.append(done)
        if progress is not None:
            eta.update("replay", k + 1)
            progress("replay", k + 1, len(chosen), eta.seconds("replay", len(chosen) - k - 1))
    return replayed


@dataclass
class _Tier:
    """What the analytic pass found: the estimated plans, the plans skipped for their step floor (``deferred``: (floor,
    the plan or its (group, index, floor key), built by :func:`_built`), for :func:`_settle`), memos and counts."""

    shortlist: list[Candidate] = field(default_factory=list)
    deferred: list[tuple[float, Plan | tuple[CandidateGroup, int, tuple]]] = field(default_factory=list)
    floors: dict = field(default_factory=dict)
    played: dict = field(default_factory=dict)  # memos: the DES's programs and timelines (engine.simulate) and
    plays: dict = field(default_factory=dict)  # the analytic tier's whole plays (testbed.explore.analytic.estimate)
    exposed: dict = field(default_factory=dict)  # testbed.sim.report.exposed.cached_exposed_by_kind's memo
    revived: list[Candidate] = field(default_factory=list)  # deferred plans _settle estimated after all (that fit)
    pruned: int = 0
    bounded: int = 0
    enumerated: int = 0
    top: int = 0  # replays stop once certainly slower than this many replayed (0: never; _replayed)
    steps: list[float] = field(default_factory=list)  # the replayed DES steps, sorted
    stopped: int = 0


def _analytic_tier(groups: list[CandidateGroup], topology: Topology, memory_cap: float, keep: int, margin: float,
                   by_time: bool, rank: Callable, progress, eta: TimeLeft | None = None) -> _Tier:
    """Every candidate's memory bound, and the estimate of each that fits unless its step floor cannot reach the
    ``keep`` fastest estimates (plus ``margin``).

    A group of candidates (testbed.explore.candidates.CandidateGroup) whose model states alone overflow is dropped
    whole before its plans are built (their states' bytes are the same). Ranked by step time (``by_time``), it
    is best-first: the step floors of all the other plans first, then, in floor order, each plan's exact stage
    peaks (:func:`_overflows`: the schedule's in-flight activations, which at hundreds of microbatches cost more
    than the floor, so only for plans that could still be estimated) and its estimate, so the ``keep`` fastest estimates are found early and every plan whose floor
    is above them is skipped (once one is, all later ones are: the floors only grow, the bar only falls). A
    plan whose estimate could reach the replay list has a floor below it, so it is estimated in either order.
    Before its memory and estimate, a plan's schedule is played at its floors (:func:`testbed.explore.floor
    .played_floor`, a lower bound of the estimate that counts the pipeline's bubble, memoized across plans alike in
    it), and before its estimate its parameter gathers are summed as its stages play them one after another
    (:func:`testbed.explore.gather_floor.gather_floor`), then its step floor taken with its own tensor groups'
    collectives (:func:`testbed.explore.floor.placed_floor`) and with its gathers' comm slowdown
    (:func:`testbed.explore.slowed_floor.slowed_floor`); it is skipped when any is above the bar (a plan so
    skipped that would not fit is counted as skipped, not over memory; :func:`_settle` checks its memory before it
    could be estimated): the bar only falls, so it would be above the final bar too, and the plans estimated at
    or below the final bar are the same.
    """
    tier = _Tier(enumerated=sum(g.size for g in groups))
    total, done, kept = tier.enumerated, 0, 0
    eta = eta or TimeLeft()
    eta.update("bounds" if by_time else "analytic", 0)
    limit = memory_cap * int(topology.device.memory_bytes)  # as MemoryBreakdown.capacity
    bounded: list[tuple[float, int, tuple[CandidateGroup, int]]] = []
    for group in groups:
        if _states_overflow(group.head, limit, tier.floors):
            tier.pruned += group.size
        else:
            kept += group.size
            if kept > MAX_CANDIDATES:
                raise InputError(f"the search space holds more than {MAX_CANDIDATES:,} layouts of this model on "
                                 f"{topology.num_devices:,} devices whose model states fit (each is bounded, and "
                                 f"kept, in memory); narrow it: fewer --schedules, --microbatches or "
                                 f"--max-microbatches, one --precisions, or fewer --devices", field="space")
            if not by_time:
                for plan in group.plans():
                    _estimate_into(tier, plan, topology, memory_cap, rank, None, keep)
            else:  # no floor (context parallelism, a shared host): estimated first
                shared, replicas = group_floor_key(group.head), group.head.replicas
                for j, (mb, remat, sp, runtime) in enumerate(group.choices()):
                    key = (*shared, mb, group.head.batch.global_batch // (replicas * mb), remat, sp, runtime)
                    floor = cached_step_floor(key, functools.partial(group.plan, j), topology)
                    bounded.append((floor or 0.0, len(bounded), (group, j, key)))
        done += group.size
        if progress is not None:
            phase = "analytic" if not by_time else "bounds"
            eta.update(phase, done)
            progress(phase, done, total, eta.seconds(phase, total - done, replays=keep))
    if not by_time:
        return tier
    bounded.sort(key=lambda x: x[:2])
    eta.update("analytic", 0)
    _best_first(tier, bounded, total - len(bounded), topology, memory_cap, keep, margin, rank, progress, eta)
    if progress is not None:
        progress("analytic", total, total)
    return tier


def _best_first(tier: _Tier, bounded: list, before: int, topology: Topology, memory_cap: float, keep: int,
                margin: float, rank: Callable, progress, eta: TimeLeft) -> None:
    """:func:`_analytic_tier`'s best-first pass over ``bounded`` ((step floor, order, (group, index, floor key)), sorted), in the
    order of each plan's best known lower bound: a plan whose played or gather floor puts it
    behind the next plan waits in a heap at that floor, so plans are estimated cheapest-floor first and the bar
    falls sooner. Every plan is estimated, dropped for memory, or deferred (``tier.deferred``) with a proven
    floor above the bar at that time, which only falls: the plans estimated at or below the final bar are those
    of the plain floor order."""
    fastest: list[float] = []  # the ``keep`` fastest estimates so far, negated (a max-heap of them)
    waiting: list[tuple[float, int, Plan]] = []  # (tightened floor, order, plan): behind the next plan's floor
    floors, k, total = [x[0] for x in bounded], 0, before + len(bounded)
    while k < len(bounded) or waiting:
        bar = -fastest[0] * (1 + margin) if len(fastest) >= keep else float("inf")
        if waiting and (k >= len(bounded) or waiting[0][:2] < bounded[k][:2]):
            if waiting[0][0] > bar:  # every floor left is at least this one's
                break
            plan = heapq.heappop(waiting)[2]
        else:
            floor, order, (group, j, key) = bounded[k]
            if floor > bar:
                break
            k += 1
            plan = group.plan(j)
            # Its schedule played at its floors (memoized across plans alike), then its stages' exact peaks, its
            # gathers and its own tensor groups' collectives: skipped if too slow, else estimated in its place.
            tight = max(floor, cached_played_floor(key, plan, topology) or 0.0) if floor else floor
            if tight <= bar and _overflows(plan, topology, memory_cap, tier.floors):
                tier.pruned += 1
                continue
            if floor:
                for bound in (gather_floor, placed_floor, slowed_floor):
                    tight = max(tight, bound(plan, topology)) if tight <= bar else tight
                if tight > bar:
                    tier.bounded += 1
                    tier.deferred.append((tight, plan))
                    continue
                if tight > min(floors[k] if k < len(bounded) else float("inf"),
                               waiting[0][0] if waiting else float("inf")):
                    heapq.heappush(waiting, (tight, order, plan))
                    continue
        _estimate_into(tier, plan, topology, memory_cap, rank, fastest, keep, margin, checked=True)
        if progress is not None:
            eta.update("analytic", k)
            bar = -fastest[0] * (1 + margin) if len(fastest) >= keep else float("inf")
            may = bisect.bisect_right(floors, bar, lo=k) - k + len(waiting)  # plans whose floor may be estimated
            progress("analytic", before + k - len(waiting), total, eta.seconds("analytic", may, replays=keep))
    tier.bounded += len(bounded) - k + len(waiting)
    tier.deferred.extend((f, ref) for f, _, ref in bounded[k:])
    tier.deferred.extend((f, plan) for f, _, plan in waiting)


def _built(ref: Plan | tuple[CandidateGroup, int, tuple]) -> Plan:
    """The plan of a deferred entry: itself, or the ``index``-th of its ``(group, index, floor key)``."""
    return ref if isinstance(ref, Plan) else ref[0].plan(ref[1])


def _estimate_into(tier: _Tier, plan: Plan, topology: Topology, memory_cap: float, rank: Callable,
                   fastest: list[float] | None, keep: int, margin: float = 0.0, checked: bool = False) -> None:
    """Estimate ``plan`` into ``tier``'s shortlist (or count it pruned when it does not fit), keeping the heap of
    the ``keep`` fastest estimates when given (``checked``: as :func:`evaluate`'s)."""
    bar = -fastest[0] * (1 + margin) if fastest is not None and len(fastest) >= keep else math.inf
    est = evaluate(plan, topology, memory_cap, tier.floors, bar, tier.plays, checked)
    if est is None:
        tier.pruned += 1
        return
    if isinstance(est, float):  # its estimate is certainly above the bar: skipped as its floor would have it
        tier.bounded += 1
        tier.deferred.append((est, plan))
        return
    tier.shortlist.append(Candidate(plan=plan, estimate=est, value=rank(plan, est.step_time_s)))
    if fastest is not None:
        heapq.heappush(fastest, -est.step_time_s)
        if len(fastest) > keep:
            heapq.heappop(fastest)


def _replayed(c: Candidate, topology: Topology, rank: Callable, tier: _Tier) -> Candidate | None:
    """``c`` replayed by the DES, with ``tier``'s memos of timelines (simulate's) and of their exposed kinds; None
    (counted in ``tier.stopped``) where the DES stopped it above the ``tier.top``-th fastest step replayed: it is
    slower than each of them, so not among the ``top`` fastest."""
    steps = tier.steps
    bar = steps[tier.top - 1] if tier.top and len(steps) >= tier.top else math.inf
    try:
        sim = simulate(c.plan, topology, tier.played, bar)
    except StepAboveBar:
        tier.stopped += 1
        return None
    bisect.insort(steps, sim.report.step_time_s)
    return Candidate(plan=c.plan, estimate=c.estimate, report=sim.report, value=rank(c.plan, sim.report.step_time_s),
                     exposed_by_kind=cached_exposed_by_kind(sim.timeline, tier.exposed))


#: At most this many replays beyond the replay list while settling (:func:`_settle`).
SETTLE_LIMIT = 64


def _settle(rest: list[Candidate], tier: _Tier, replayed: list[Candidate], topology: Topology, memory_cap: float,
            margin: float, rank: Callable, progress) -> list[Candidate]:
    """Replays past the replay list while an unreplayed plan could still beat the best replayed step time.

    The analytic tier prices each collective alone, so where concurrent collectives share links (a tensor
    group across nodes beside the data-parallel reductions) it is optimistic, and a list of such plans can
    replay slower than plans it ranked lower. So, in estimate order, every plan whose estimate is more than
    ``margin`` below the best replayed step time is replayed too (the tier's usual optimism, a few percent,
    replays nothing more); a plan skipped for its step floor is estimated first once its floor is that far
    below it. At most :data:`SETTLE_LIMIT` more (the result says how many it replayed).
    """
    best = min(c.report.step_time_s for c in replayed)
    pending = sorted(rest, key=lambda c: c.estimate.step_time_s)
    deferred = sorted(tier.deferred, key=lambda x: x[0])
    out: list[Candidate] = []
    tries = 0  # a replay stopped above the bar counts too: it is slower than the best, which it leaves alone
    while tries < SETTLE_LIMIT:
        while deferred and deferred[0][0] * (1 + margin) < best:  # its estimate may beat the best: estimate it
            plan = _built(deferred.pop(0)[1])
            est = evaluate(plan, topology, memory_cap, tier.floors, plays=tier.plays)
            if est is None:
                tier.pruned += 1
                tier.bounded -= 1
                continue
            tier.revived.append(Candidate(plan=plan, estimate=est, value=rank(plan, est.step_time_s)))
            bisect.insort(pending, tier.revived[-1], key=lambda c: c.estimate.step_time_s)
        if not pending or pending[0].estimate.step_time_s * (1 + margin) >= best:
            break
        tries += 1
        if (done := _replayed(pending.pop(0), topology, rank, tier)) is not None:
            out.append(done)
            best = min(best, done.report.step_time_s)
        if progress is not None:
            progress("replay", len(replayed) + tries, len(replayed) + tries, None)
    return out


def exhaustive_optimum(base: Plan, topology: Topology, space: SearchSpace = SearchSpace(), *,
                       memory_cap: float = 1.0) -> tuple[Plan, float, int]:
    """(plan, DES step seconds, plans simulated) of the fastest fitting plan of ``space``, every one simulated.

    The ground truth the search is checked against (slow: one DES per candidate).
    """
    best: tuple[Plan, float] | None = None
    count = 0
    for plan in candidates(base, topology.num_devices, space):
        memory = plan_memory(plan, topology)
        if memory.total > memory_cap * memory.capacity:
            continue
        count += 1
        step = simulate(plan, topology).report.step_time_s
        if best is None or step < best[1]:
            best = (plan, step)
    if best is None:
        raise InputError("no candidate plan fits in memory", field="--memory-cap")
    return best[0], best[1], count
