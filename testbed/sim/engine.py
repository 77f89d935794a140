"""Discrete-event simulation of a task graph on a topology: one training step.

Pricing (:func:`~testbed.sim.pricing.price`, re-exported here) turns each task into a
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
  (testbed.sim.compute, which holds this pricing);
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
(testbed.sim.contention), re-evaluated whenever a task starts or finishes; with
a shared host (the calibration's ``host`` group) the devices
computing at once (and the controller thread while it works) share its
throughput, and devices that meet wait for the last of them (testbed.sim.barriers:
a collective standing alone before it starts, a compute task with ``syncs`` after
its work, the step's end). The result is
a :class:`~testbed.sim.timeline.Timeline` over the representatives (and the
device -> representative map) and a :class:`~testbed.sim.timeline.Report`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from testbed.sim.barriers import interleaved_wait, step_end_wait
from testbed.sim.compute import compute_seconds, pass_seconds
from testbed.sim.contention import Flow, LinkLedger
from testbed.sim.pricing import Priced, controller_seconds, price
from testbed.plan.placement import place
from testbed.plan.spec import Plan
from testbed.sim.program import STREAMS, Program, TaskKind, build_program
from testbed.sim.timeline import CATEGORIES, Report, Timeline
from testbed.topology import Calibration, HostCalibration, Topology

__all__ = ["Priced", "Simulation", "compute_seconds", "pass_seconds", "controller_seconds", "price", "run", "simulate",
           "report"]

#: Fraction of a task's work below which it counts as finished (rounding of the fluid steps).
_DONE = 1e-9


@dataclass(frozen=True, slots=True, kw_only=True)
class Simulation:
    """What :func:`simulate` returns: the report, the timeline and the program it ran."""

    report: Report
    timeline: Timeline
    program: Program


def run(program: Program, priced: Priced, host_cores: int = 0, calibration: Calibration | None = None) -> Timeline:
    """Play ``program`` with ``priced`` durations as a fluid discrete-event simulation.

    Devices computing at once share the host as ``calibration.host_share``
    says (or, without a calibration, ``host_cores`` cores as
    :class:`~testbed.topology.calibration.HostCalibration` says; 0: none shared).
    """
    if calibration is None:
        calibration = Calibration(host=HostCalibration(cores=host_cores)) if host_cores > 0 else Calibration()
    sharing = calibration
    tasks, durations, task_loads = program.tasks, priced.durations, priced.loads
    n = len(tasks)
    row_index: dict[tuple[int, str], int] = {}
    for t in tasks:
        row_index.setdefault((t.device, t.stream), 0)
    ordered = sorted(row_index, key=lambda k: (k[0], STREAMS.index(k[1]) if k[1] in STREAMS else len(STREAMS), k[1]))
    row_index = {k: i for i, k in enumerate(ordered)}
    row_of = [row_index[(t.device, t.stream)] for t in tasks]
    queues: list[deque] = [deque() for _ in ordered]
    for i, r in enumerate(row_of):
        queues[r].append(i)
    pending = [len(t.deps) for t in tasks]
    dependents: list[list[int]] = [[] for _ in range(n)]
    for i, t in enumerate(tasks):
        for d in t.deps:
            dependents[d].append(i)
    is_comm = [t.kind not in (TaskKind.COMPUTE, TaskKind.HOST) for t in tasks]
    # Devices computing at once share the host's cores, and so does the (single-threaded) controller.
    weight = [1 if t.kind is TaskKind.HOST else program.multiplicity[t.device] for t in tasks]
    start = [math.nan] * n
    end = [math.nan] * n
    busy = [False] * len(ordered)
    active: dict[int, float] = {}  # task -> remaining fraction of its work
    rate: dict[int, float] = {}
    now = 0.0
    dirty_comm = dirty_compute = False
    # A shared host's stragglers (testbed.sim.barriers): per device, computing since its group last met; tasks
    # waiting for the last member -> (seconds left, whether the task's own work follows).
    host = calibration.host
    skewed = host is not None and bool(host.skew_s)
    carry: dict[int, float] = {}
    holds: dict[int, tuple[float, bool]] = {}
    worked: dict[int, float] = {}  # compute task -> when its work was done (it then waited for the last device)
    ledger = LinkLedger(priced.bandwidth)

    def try_rows(rows) -> None:
        work = list(rows)
        while work:
            r = work.pop()
            if busy[r] or not queues[r] or pending[queues[r][0]]:
                continue
            i = queues[r].popleft()
            busy[r] = True
            start[i] = now
            t = tasks[i]
            if skewed and t.kind is TaskKind.COLLECTIVE and not t.interleaved and len(t.group) > 1:
                # A collective standing alone: its group waits for the last member first (testbed.sim.barriers).
                wait = host.barrier_wait(len(t.group), carry.get(t.device, 0.0))
                carry[t.device] = 0.0
                if wait > 0:
                    holds[i] = (wait, True)
                    continue
            work.extend(begin(i))

    def begin(i: int) -> list[int]:
        nonlocal dirty_comm, dirty_compute
        if durations[i] <= 0:
            return finish(i)
        active[i] = 1.0
        if is_comm[i]:
            ledger.add(i, Flow(1.0 / durations[i], task_loads[i] or {}))
            dirty_comm = True
        else:
            dirty_compute = True
        return []

    def computed(i: int) -> list[int]:
        """A task's work is done: a compute task on a skewed host may still wait at its barriers."""
        t = tasks[i]
        if skewed and t.kind is TaskKind.COMPUTE:
            seconds, before = now - start[i], carry.get(t.device, 0.0)
            carry[t.device] = 0.0 if t.syncs else before + seconds
            wait = interleaved_wait(host, t.syncs, seconds, before)
            if wait > 0:
                holds[i] = (wait, False)
                worked[i] = now
                return []
        return finish(i)

    def finish(i: int) -> list[int]:
        end[i] = now
        busy[row_of[i]] = False
        rows = [row_of[i]]
        for d in dependents[i]:
            pending[d] -= 1
            if pending[d] == 0:
                rows.append(row_of[d])
        return rows

    try_rows(range(len(ordered)))
    while active or holds:
        if dirty_comm:
            rate.update(ledger.rates())
            dirty_comm = False
        if dirty_compute:
            comp = [i for i in active if not is_comm[i]]
            # The programs computing at once: one per stage representative (MPMD pipeline stages are separate
            # programs; an SPMD step is one), which share the host worse than one program's devices do.
            programs = len({tasks[i].device for i in comp if tasks[i].kind is TaskKind.COMPUTE}) or 1
            share = sharing.host_share(sum(weight[i] for i in comp), programs) if sharing.shares_host else 1.0
            for i in comp:
                rate[i] = share / durations[i]
            dirty_compute = False
        first = min(active, key=lambda i: active[i] / rate[i]) if active else -1
        dt = active[first] / rate[first] if active else math.inf
        held = min(holds, key=lambda i: holds[i][0]) if holds else -1
        if holds and holds[held][0] < dt:
            first, dt = -1, holds[held][0]
        now += dt
        done = []
        for i in active:
            left = active[i] - rate[i] * dt
            active[i] = left
            if left <= _DONE or i == first:
                done.append(i)
        rows: list[int] = []
        for i in [i for i in holds if (first < 0 and i == held) or holds[i][0] <= dt]:
            _, work_follows = holds.pop(i)
            rows.extend(begin(i) if work_follows else finish(i))
        for i in holds:
            holds[i] = (holds[i][0] - dt, holds[i][1])
        for i in done:
            del active[i]
            del rate[i]
            if is_comm[i]:
                ledger.remove(i)
                dirty_comm = True
            else:
                dirty_compute = True
            rows.extend(computed(i))
        try_rows(rows)
    if any(math.isnan(e) for e in end):
        stuck = [tasks[i].name for i in range(n) if math.isnan(end[i])][:5]
        raise RuntimeError(f"the task graph deadlocks; unfinished tasks include {stuck}")
    # The step ends when the last device of every stage is done: each representative's devices meet there.
    last: dict[int, float] = {}
    for t, e in zip(tasks, end):
        last[t.device] = max(last.get(t.device, 0.0), e)
    step = max((e + step_end_wait(host, program.multiplicity[d], carry.get(d, 0.0)) if skewed else e
                for d, e in last.items()), default=0.0)
    return _timeline(program, ordered, row_of, start, end, step, worked)


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
    from testbed.model.memory import memory_breakdown
    from testbed.model.costs import model_flops_per_step

    step = timeline.step_time_s
    peak = topology.device.flops(plan.precision.compute_dtype)
    mfu = model_flops_per_step(plan) / (topology.num_devices * peak * step) if step > 0 else 0.0
    memory = memory_breakdown(plan, topology).as_dict()
    memory.pop("per_stage", None)
    return Report(step_time_s=step, compute_s=timeline.compute_s(), exposed_comm_s=timeline.exposed_comm_s(),
                  bubble_fraction=timeline.bubble_fraction(), mfu=mfu, memory=memory, plan=plan.name,
                  topology=topology.name, devices=topology.num_devices, tasks=tasks, source=timeline.source)


def simulate(plan: Plan, topology: Topology) -> Simulation:
    """Simulate one training step of ``plan`` on ``topology`` (raises InputError on a mismatched mesh)."""
    host = topology.calibration.host
    program = build_program(plan, place(plan, topology), controller=topology.calibration.controller is not None,
                            combine_bytes=topology.calibration.collectives.combine_bytes,
                            serial=host is not None and host.serial_programs)
    priced = price(program, topology, plan.precision.compute_dtype)
    timeline = run(program, priced, calibration=topology.calibration)
    return Simulation(report=report(plan, topology, timeline, len(program.tasks)), timeline=timeline, program=program)
