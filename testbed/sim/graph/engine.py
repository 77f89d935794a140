"""Discrete-event simulation of a task graph on a topology: one training step.

Pricing (:func:`~testbed.sim.graph.pricing.price`, re-exported here) turns each task into a
standalone duration and, for communication, the bytes it moves over each directed link:

- compute (calibration groups ``compute``, ``memory``, ``elementwise``):
  ``launch_overhead_s + max(flops / (peak * eff(f)), bytes / bw) +
  (replicated_passes * replicated_bytes + split_passes * split_bytes) / bw``,
  ``cached_passes * (replicated_bytes + split_bytes) / bw`` instead for the
  part of the task's ``[tokens, d_model]`` activation its device's share of
  ``cache_bytes`` holds (``Calibration.cached_fraction``),
  with the precision's peak FLOP/s, ``bw = memory_bandwidth *
  memory.efficiency`` and ``eff(f) = compute.efficiency * f / (f +
  compute.efficiency_half_flops)`` for a kernel of ``f`` FLOPs: the roofline
  of the calibrated device, plus the memory-bound elementwise passes over the
  activations the task writes (none without an ``elementwise`` group); with the
  calibration's GEMM shape model the matmuls are priced by shape instead
  (testbed.sim.price.compute, which holds this pricing);
- host (the ``controller`` group, when the topology has one):
  ``step_s`` for the step's preparation (plus ``pipeline_step_s`` for a
  pipeline's), ``count * overhead_s + buffers * buffer_s`` for a
  dispatch (:func:`controller_seconds`);
- collectives and sends: timed by testbed.collectives.timing; their link
  loads are what every group running the task at once puts on the links the
  representative's own traffic crosses (its ring neighbours' routes, or the
  send route).

The engine (:func:`run`) keeps every representative's streams as FIFOs; a
task starts when it heads its stream and its dependencies are done. Tasks in
flight progress as fluids: transfers share links max-min fairly
(testbed.sim.price.contention), re-evaluated whenever a task starts or finishes; with
a shared host (the calibration's ``host`` group) the devices
computing at once (and the controller thread while it works) share its
throughput, and devices that meet wait for the last of them (testbed.sim.price.barriers:
a collective standing alone before it starts, a compute task with ``syncs`` after
its work, the step's end). The result is
a :class:`~testbed.sim.report.timeline.Timeline` over the representatives (and the
device -> representative map) and a :class:`~testbed.sim.report.timeline.Report`.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from testbed.model.costs import model_flops_per_step
from testbed.model.memory import memory_breakdown
from testbed.sim.price.barriers import interleaved_wait, step_end_wait
from testbed.sim.price.compute import compute_seconds, pass_seconds, plan_matmul_dtype, rate_dtype
from testbed.sim.price.contention import Flow, LinkLedger
from testbed.sim.price.host_threads import CONTROLLER_THREADS
from testbed.sim.graph.pricing import Priced, controller_seconds, price
from testbed.plan.placement import place
from testbed.plan.spec import Plan
from testbed.sim.graph.program import STREAMS, Program, TaskKind, program_of
from testbed.sim.step.facts import facts_key, keep, recall, step_facts, topology_rules
from testbed.sim.step.step_rules import serial_host
from testbed.sim.report.timeline import CATEGORIES, Report, Timeline
from testbed.topology import Calibration, HostCalibration, Topology

__all__ = ["Priced", "Simulation", "StepAboveBar", "compute_seconds", "pass_seconds", "controller_seconds", "price", "run",
           "simulate", "report"]

#: Fraction of a task's work below which it counts as finished (rounding of the fluid steps).
_DONE = 1e-9
#: A play stops past its bar only once its step floor, taken this much under its sum, is above it (a task finishes
#: when its work left is under ``_DONE``, and a row's thousands of durations are summed in another order).
_BAR_SAFETY = 1e-6


class StepAboveBar(Exception):
    """A play stopped once its step was certainly above the bar: ``floor`` (a lower bound of the step) is."""

    def __init__(self, floor: float) -> None:
        super().__init__(floor)
        self.floor = floor


@dataclass(frozen=True, slots=True, kw_only=True)
class Simulation:
    """What :func:`simulate` returns: the report, the timeline and the program it ran."""

    report: Report
    timeline: Timeline
    program: Program


def run(program: Program, priced: Priced, host_cores: int = 0, calibration: Calibration | None = None,
        bar: float = math.inf) -> Timeline:
    """Play ``program`` with ``priced`` durations as a fluid discrete-event simulation.

    Devices computing at once share the host as ``calibration.host_share``
    says (or, without a calibration, ``host_cores`` cores as
    :class:`~testbed.topology.HostCalibration` says; 0: none shared).

    With a finite ``bar`` (and no shared host), raises :class:`StepAboveBar` as soon as the step is certainly above
    it. Every task takes at least its priced duration (a compute or host task runs at ``1 / duration``, slowed
    only by the communication beside it; a transfer at its standalone rate times a max-min share of at most 1,
    testbed.sim.price.contention), and starts only once the task before it on its row and its dependencies are
    done; so a task not yet started at ``now`` ends no earlier than ``now`` plus the longest chain of durations
    from it through the tasks that wait for it (its tail, :func:`_tails`), and the step is at least that. The
    bound reads only the play's own durations and order; a play that is not stopped is the same play as without
    the bar.
    """
    if calibration is None:
        calibration = Calibration(host=HostCalibration(cores=host_cores)) if host_cores > 0 else Calibration()
    fluid = _Fluid(program, priced, calibration, bar)
    fluid.check_waiting()
    fluid.try_rows(range(len(fluid.rows)))
    while fluid.active or fluid.holds:
        fluid.advance()
    return fluid.timeline()


class _Fluid:
    """The state of one play: every (device, stream) row's FIFO, the tasks in flight with the fraction of their
    work left and their rates, and a shared host's stragglers."""

    def __init__(self, program: Program, priced: Priced, calibration: Calibration, bar: float = math.inf) -> None:
        self.program, self.sharing = program, calibration
        tasks = self.tasks = program.tasks
        self.durations, self.loads = priced.durations, priced.loads
        n = len(tasks)
        keys = dict.fromkeys((t.device, t.stream) for t in tasks)
        self.rows = sorted(keys, key=lambda k: (k[0], STREAMS.index(k[1]) if k[1] in STREAMS else len(STREAMS), k[1]))
        row_index = {k: i for i, k in enumerate(self.rows)}
        self.row_of = [row_index[(t.device, t.stream)] for t in tasks]
        self.queues: list[deque] = [deque() for _ in self.rows]
        for i, r in enumerate(self.row_of):
            self.queues[r].append(i)
        self.pending = [len(t.deps) for t in tasks]
        self.dependents: list[list[int]] = [[] for _ in range(n)]
        for i, t in enumerate(tasks):
            for d in t.deps:
                self.dependents[d].append(i)
        self.is_comm = [t.kind not in (TaskKind.COMPUTE, TaskKind.HOST) for t in tasks]
        # Devices computing at once share the host's cores, and so does the controller while it works (host_threads).
        self.weight = [CONTROLLER_THREADS if t.kind is TaskKind.HOST else program.multiplicity[t.device] for t in tasks]
        self.start = [math.nan] * n
        self.end = [math.nan] * n
        self.busy = [False] * len(self.rows)
        self.active: dict[int, float] = {}  # task -> remaining fraction of its work
        self.rate: dict[int, float] = {}
        self.now = 0.0
        self.dirty_comm = self.dirty_compute = False
        # A shared host's stragglers (testbed.sim.price.barriers): per device, computing since its group last met; tasks
        # waiting for the last member -> (seconds left, whether the task's own work follows).
        self.host = calibration.host
        self.skewed = self.host is not None and bool(self.host.skew_s)
        self.carry: dict[int, float] = {}
        self.holds: dict[int, tuple[float, bool]] = {}
        # Compute task -> when its work was done (it then waited for the last device).
        self.worked: dict[int, float] = {}
        self.ledger = LinkLedger(priced.bandwidth)
        # Compute beside its device's own collectives and sends runs 1 + slowdown times longer (DeviceSpec).
        self.beside = 1.0 + priced.comm_slowdown
        # With a bar: each task's tail (run's docstring), and the tasks not yet started, longest tail first.
        self.bar = bar if bar < math.inf and not calibration.shares_host and not self.skewed else math.inf
        self.tails: list[float] = []
        self.waiting: list[tuple[float, int]] = []
        if self.bar < math.inf:
            self.tails = _tails(self.durations, self.queues, self.dependents, self.row_of)
            self.waiting = [(-x, i) for i, x in enumerate(self.tails)]
            heapq.heapify(self.waiting)

    def check(self, floor: float) -> None:
        """Stops the play (:class:`StepAboveBar`) once ``floor``, a lower bound of its step, is above the bar."""
        if floor * (1.0 - _BAR_SAFETY) > self.bar:
            raise StepAboveBar(floor * (1.0 - _BAR_SAFETY))

    def check_waiting(self) -> None:
        """With a bar: the step is at least now plus the longest tail of a task not yet started."""
        waiting, start = self.waiting, self.start
        while waiting and not math.isnan(start[waiting[0][1]]):
            heapq.heappop(waiting)
        if waiting:
            self.check(self.now - waiting[0][0])

    def _started(self, i: int) -> None:
        """With a bar, task ``i`` started now: the step is at least now plus its tail."""
        if self.bar < math.inf:
            self.check(self.now + self.tails[i])

    def try_rows(self, rows) -> None:
        """Starts the head task of each of ``rows`` that is free and whose dependencies are done (and of the rows
        that frees in turn)."""
        work, queues, pending = list(rows), self.queues, self.pending
        while work:
            r = work.pop()
            if self.busy[r] or not queues[r] or pending[queues[r][0]]:
                continue
            i = queues[r].popleft()
            self.busy[r] = True
            self.start[i] = self.now
            self._started(i)
            t = self.tasks[i]
            if self.skewed and t.kind is TaskKind.COLLECTIVE and not t.interleaved and len(t.group) > 1:
                # A collective standing alone: its group waits for the last member first (testbed.sim.price.barriers).
                wait = self.host.barrier_wait(len(t.group), self.carry.get(t.device, 0.0))
                self.carry[t.device] = 0.0
                if wait > 0:
                    self.holds[i] = (wait, True)
                    continue
            work.extend(self.begin(i))

    def begin(self, i: int) -> list[int]:
        """Task ``i``'s work starts (a transfer joins the link ledger); returns the rows it frees (none unless it
        takes no time)."""
        if self.durations[i] <= 0:
            return self.finish(i)
        self.active[i] = 1.0
        if self.is_comm[i]:
            self.ledger.add(i, Flow(1.0 / self.durations[i], self.loads[i] or {}))
            self.dirty_comm = True
            self.dirty_compute = self.dirty_compute or self.beside > 1.0
        else:
            self.dirty_compute = True
        return []

    def computed(self, i: int) -> list[int]:
        """A task's work is done: a compute task on a skewed host may still wait at its barriers."""
        t = self.tasks[i]
        if self.skewed and t.kind is TaskKind.COMPUTE:
            seconds, before = self.now - self.start[i], self.carry.get(t.device, 0.0)
            self.carry[t.device] = 0.0 if t.syncs else before + seconds
            wait = interleaved_wait(self.host, t.syncs, seconds, before)
            if wait > 0:
                self.holds[i] = (wait, False)
                self.worked[i] = self.now
                return []
        return self.finish(i)

    def finish(self, i: int) -> list[int]:
        """Task ``i`` is done: its row and the rows of the dependents it was the last wait of may start more."""
        self.end[i] = self.now
        self.busy[self.row_of[i]] = False
        rows = [self.row_of[i]]
        for d in self.dependents[i]:
            self.pending[d] -= 1
            if self.pending[d] == 0:
                rows.append(self.row_of[d])
        return rows

    def _rates(self) -> None:
        """Re-evaluates the rates that changed: transfers' max-min shares of the links, computes' share of the
        host (the programs computing at once: one per stage representative, MPMD pipeline stages being separate
        programs and an SPMD step one, share the host worse than one program's devices do), slowed while a
        collective or send of their device is in flight (``DeviceSpec.comm_slowdown``)."""
        if self.dirty_comm:
            self.rate.update(self.ledger.rates())
            self.dirty_comm = False
        if self.dirty_compute:
            tasks, is_comm, durations, rate = self.tasks, self.is_comm, self.durations, self.rate
            comp = [i for i in self.active if not is_comm[i]]
            share = 1.0
            if self.sharing.shares_host:
                programs = len({tasks[i].device for i in comp if tasks[i].kind is TaskKind.COMPUTE}) or 1
                share = self.sharing.host_share(sum(self.weight[i] for i in comp), programs)
            if self.beside > 1.0:
                talking = {tasks[j].device for j in self.active if is_comm[j]}
                for i in comp:
                    rate[i] = share / durations[i] / (self.beside if tasks[i].device in talking else 1.0)
            else:
                for i in comp:
                    rate[i] = share / durations[i]
            self.dirty_compute = False

    def advance(self) -> None:
        """Moves time to the next event (a task's work done, or a barrier's wait over) and starts what follows."""
        self._rates()
        active, rate, holds = self.active, self.rate, self.holds
        first = min(active, key=lambda i: active[i] / rate[i]) if active else -1
        dt = active[first] / rate[first] if active else math.inf
        held = min(holds, key=lambda i: holds[i][0]) if holds else -1
        if holds and holds[held][0] < dt:
            first, dt = -1, holds[held][0]
        self.now += dt
        if self.bar < math.inf:
            self.check_waiting()
        done = []
        for i in active:
            left = active[i] - rate[i] * dt
            active[i] = left
            if left <= _DONE or i == first:
                done.append(i)
        rows: list[int] = []
        for i in [i for i in holds if (first < 0 and i == held) or holds[i][0] <= dt]:
            _, work_follows = holds.pop(i)
            rows.extend(self.begin(i) if work_follows else self.finish(i))
        for i in holds:
            holds[i] = (holds[i][0] - dt, holds[i][1])
        for i in done:
            del active[i]
            del rate[i]
            if self.is_comm[i]:
                self.ledger.remove(i)
                self.dirty_comm = True
                self.dirty_compute = self.dirty_compute or self.beside > 1.0
            else:
                self.dirty_compute = True
            rows.extend(self.computed(i))
        self.try_rows(rows)

    def timeline(self) -> Timeline:
        """The played step's timeline: it ends when the last device of every stage is done (each
        representative's devices meet there)."""
        tasks, end = self.tasks, self.end
        if any(math.isnan(e) for e in end):
            stuck = [tasks[i].name for i in range(len(tasks)) if math.isnan(end[i])][:5]
            raise RuntimeError(f"the task graph deadlocks; unfinished tasks include {stuck}")
        last: dict[int, float] = {}
        for t, e in zip(tasks, end):
            last[t.device] = max(last.get(t.device, 0.0), e)
        multiplicity = self.program.multiplicity
        step = max((e + step_end_wait(self.host, multiplicity[d], self.carry.get(d, 0.0)) if self.skewed else e
                    for d, e in last.items()), default=0.0)
        return _timeline(self.program, self.rows, self.row_of, self.start, end, step, self.worked)


def _tails(durations, queues: list[deque], dependents: list[list[int]], row_of: list[int]) -> list[float]:
    """Each task's tail: its duration plus the longest tail of what waits for it (the next task on its row, and its
    dependents), the tasks taken in reverse topological order (testbed.sim.graph.program lists each task after
    its dependencies and each row in order; Kahn's order otherwise)."""
    n = len(durations)
    after = [-1] * n
    for queue in queues:
        for a, b in zip(queue, list(queue)[1:]):
            after[a] = b
    order = range(n - 1, -1, -1)
    if any(d <= i for i in range(n) for d in dependents[i]) or any(0 <= b <= a for a, b in enumerate(after)):
        order = _reverse_topological(dependents, after)
    tails = [0.0] * n
    for i in order:
        b = after[i]
        longest = tails[b] if b >= 0 else 0.0
        for d in dependents[i]:
            if tails[d] > longest:
                longest = tails[d]
        tails[i] = max(durations[i], 0.0) + longest
    return tails


def _reverse_topological(dependents: list[list[int]], after: list[int]) -> list[int]:
    """The tasks, each after every task that waits for it (Kahn's algorithm on the dependents and row edges)."""
    n = len(after)
    waits = [0] * n
    for i in range(n):
        for d in (*dependents[i], *((after[i],) if after[i] >= 0 else ())):
            waits[d] += 1
    ready = [i for i in range(n) if not waits[i]]
    order = []
    while ready:
        i = ready.pop()
        order.append(i)
        for d in (*dependents[i], *((after[i],) if after[i] >= 0 else ())):
            waits[d] -= 1
            if not waits[d]:
                ready.append(d)
    return order[::-1]


def _timeline(program: Program, rows: list[tuple[int, str]], row_of, start, end, step: float,
              worked: dict[int, float]) -> Timeline:
    """The spans of the played program (a compute task that waited at its barriers: its work, then the wait
    as communication), and the schedule's bubbles."""
    tasks = program.tasks
    starts, ends = np.asarray(start), np.asarray(end)
    step = max(step, float(ends.max(initial=0.0)))
    pipeline = [i for i, t in enumerate(tasks) if t.pipeline]
    phase = float(ends[pipeline].max()) if pipeline else step
    names = {TaskKind.COMPUTE: "compute", TaskKind.HOST: "host"}
    cats = [CATEGORIES.index(names.get(t.kind, "comm")) for t in tasks]
    labels = [t.name for t in tasks]
    out_rows, out_start, out_end, out_cat, out_label = list(row_of), list(start), list(end), cats, labels
    for i, t in worked.items():
        out_end[i] = t
        out_rows.append(row_of[i])
        out_start.append(t)
        out_end.append(end[i])
        out_cat.append(CATEGORIES.index("comm"))
        out_label.append(f"wait {labels[i]}")
    # Bubble spans: when a stage runs no pipeline action (F/B/W and their tensor all-reduces) inside the
    # pipeline phase -- the idle time of the schedule table, whatever else (optimizer, waits) fills it.
    by_device: dict[int, list[int]] = {}
    for i in pipeline:
        by_device.setdefault(tasks[i].device, []).append(i)
    # Without pipeline stages there is no schedule to idle in: a wait on fsdp gathers or all-to-alls is
    # exposed communication, not bubble (counting it twice would let compute + comm + bubble exceed the step).
    staged = len(set(np.asarray(program.representative).tolist())) > 1
    for device in dict.fromkeys(t.device for t in tasks) if staged else ():
        idx = by_device.get(device, [])
        compute_row = rows.index((device, "compute")) if (device, "compute") in rows else 0
        t = 0.0
        for i in sorted(idx, key=lambda i: start[i]):
            if start[i] > t:
                out_rows.append(compute_row)
                out_start.append(t)
                out_end.append(start[i])
                out_cat.append(CATEGORIES.index("bubble"))
                out_label.append("bubble")
            t = max(t, end[i])
        if t < phase:
            out_rows.append(compute_row)
            out_start.append(t)
            out_end.append(phase)
            out_cat.append(CATEGORIES.index("bubble"))
            out_label.append("bubble")
    return Timeline(rows=tuple(rows), row=np.asarray(out_rows), start=np.asarray(out_start),
                    end=np.asarray(out_end), category=np.asarray(out_cat), label=tuple(out_label),
                    representative=program.representative, step_time_s=step, pipeline_end_s=phase)


def report(plan: Plan, topology: Topology, timeline: Timeline, tasks: int = 0) -> Report:
    """Step time, compute, exposed comm, bubble, MFU and memory of a simulated (or measured) step."""
    step = timeline.step_time_s
    peak = topology.device.flops(rate_dtype(plan_matmul_dtype(plan, topology)))
    mfu = model_flops_per_step(plan) / (topology.num_devices * peak * step) if step > 0 else 0.0
    memory = memory_breakdown(plan, topology).as_dict()
    memory.pop("per_stage", None)
    return Report(step_time_s=step, compute_s=timeline.compute_s(), exposed_comm_s=timeline.exposed_comm_s(),
                  bubble_fraction=timeline.bubble_fraction(), mfu=mfu, memory=memory, plan=plan.name,
                  topology=topology.name, devices=topology.num_devices, tasks=tasks, source=timeline.source)


#: Programs a :func:`simulate` memo keeps (each with its timeline), the latest.
MEMO_PROGRAMS = 16


def simulate(plan: Plan, topology: Topology, memo: dict | None = None, bar: float = math.inf) -> Simulation:
    """Simulate one training step of ``plan`` on ``topology`` (raises InputError on a mismatched mesh; with a finite
    ``bar``, :class:`StepAboveBar` once its step is certainly above it, as :func:`run` says).

    ``memo`` (one dict per topology, empty at first): the programs and timelines of the last :data:`MEMO_PROGRAMS`
    plans' keys played (testbed.sim.step.facts.facts_key: what program_of reads, known before it builds). A plan
    whose key equals one played before is neither built nor played again: it reuses that program and timeline;
    its report is its own (memory, MFU). A key whose play stopped above a bar keeps its floor: a plan of that key
    under a lower bar stops there at once, one under a higher bar is built and played.
    """
    placement = place(plan, topology)
    controller, serial = topology.calibration.controller is not None, serial_host(topology.calibration)
    facts = step_facts(plan, placement.device_ids, **topology_rules(topology))
    dtype = plan_matmul_dtype(plan, topology)
    # What program_of and price read beyond the step facts: the placement's order and the matmul dtype.
    key, extra = facts_key(facts, placement.device_ids, controller), (placement.order, serial, dtype)
    if memo is not None and memo.setdefault("topology", topology) is not topology:
        raise ValueError("a simulate memo holds the programs of one topology")
    hit = recall(memo, key, extra) if memo is not None else None
    if isinstance(hit, StepAboveBar) and hit.floor > bar:  # stopped before at a floor above this bar too
        raise StepAboveBar(hit.floor)
    if hit is not None and not isinstance(hit, StepAboveBar):
        program, timeline = hit
    else:
        program = program_of(facts, placement, controller=controller, serial=serial)
        try:
            timeline = run(program, price(program, topology, dtype), calibration=topology.calibration, bar=bar)
        except StepAboveBar as stop:
            if memo is not None:
                keep(memo, key, stop, MEMO_PROGRAMS, extra)
            raise
        if memo is not None:
            keep(memo, key, (program, timeline), MEMO_PROGRAMS, extra)
    return Simulation(report=report(plan, topology, timeline, len(program.tasks)), timeline=timeline, program=program)
