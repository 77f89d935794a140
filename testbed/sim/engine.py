"""Discrete-event simulation of a task graph on a topology: one training step.

Pricing (:func:`price`) turns each task into a standalone duration and, for
communication, the bytes it moves over each directed link:

- compute (calibration groups ``compute``, ``memory``, ``elementwise``):
  ``launch_overhead_s + max(flops / (peak * eff(f)), bytes / bw) +
  (replicated_passes * replicated_bytes + split_passes * split_bytes) / bw``,
  or ``cached_passes * (replicated_bytes + split_bytes) / bw`` when the
  task's ``[tokens, d_model]`` activation fits in ``cache_bytes``
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
throughput. The result is
a :class:`~testbed.sim.timeline.Timeline` over the representatives (and the
device -> representative map) and a :class:`~testbed.sim.timeline.Report`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from testbed.sim.compute import compute_seconds, pass_seconds
from testbed.sim.contention import Flow, LinkLedger, normalised_loads
from testbed.plan.placement import place
from testbed.plan.spec import Plan
from testbed.sim.program import STREAMS, Program, Task, TaskKind, build_program
from testbed.sim.timeline import CATEGORIES, Report, Timeline
from testbed.topology import Calibration, Form, HostCalibration, Topology

__all__ = ["Priced", "Simulation", "compute_seconds", "pass_seconds", "controller_seconds", "price", "run", "simulate",
           "report"]

#: Fraction of a task's work below which it counts as finished (rounding of the fluid steps).
_DONE = 1e-9


@dataclass(frozen=True, slots=True, kw_only=True)
class Priced:
    """Standalone seconds per task and, for transfers, bytes per directed link (normalised)."""

    durations: tuple[float, ...]
    loads: tuple[Mapping | None, ...]
    bandwidth: Mapping


@dataclass(frozen=True, slots=True, kw_only=True)
class Simulation:
    """What :func:`simulate` returns: the report, the timeline and the program it ran."""

    report: Report
    timeline: Timeline
    program: Program


def controller_seconds(calibration: Calibration, task: Task) -> float:
    """Controller time of a host task: the step's preparation, or a dispatch (per program and per device buffer).

    0 when the calibration has no ``controller`` group (such a topology's programs have no host tasks).
    """
    controller = calibration.controller
    if controller is None:
        return 0.0
    if task.op == "step":
        return controller.step_s
    if task.op == "pipeline step":
        return controller.step_s + controller.pipeline_step_s
    return task.count * controller.overhead_s + task.buffers * controller.buffer_s


def _timing():
    from testbed.collectives import timing as collective_timing

    return collective_timing


def _ring_neighbours(group: Sequence[int], rep: int) -> tuple[int, int, int]:
    i = group.index(rep)
    return rep, group[(i + 1) % len(group)], group[i - 1]


def _neighbour_links(topology: Topology, group: Sequence[int], rep: int) -> set:
    """Links on the routes between ``rep`` and its ring neighbours in ``group`` (both directions)."""
    if len(group) < 2:
        return set()
    _, nxt, prv = _ring_neighbours(group, rep)
    return {*topology.route(rep, nxt), *topology.route(prv, rep), *topology.route(nxt, rep), *topology.route(rep, prv)}


def price(program: Program, topology: Topology, dtype: str) -> Priced:
    """Standalone durations and link loads of every task of ``program`` on ``topology``."""
    timing = _timing()
    durations: list[float] = []
    loads: list[Mapping | None] = []
    bandwidth: dict = {}
    memo: dict = {}
    sym = _Symmetry(topology)

    def bw(link) -> float:
        value = bandwidth.get(link)
        if value is None:
            value = bandwidth[link] = float(topology.graph.edges[link]["bandwidth"])
        return value

    for task in program.tasks:
        if task.kind is TaskKind.HOST:
            cal = topology.calibration
            durations.append(controller_seconds(cal, task))
            loads.append(None)
            continue
        if task.kind is TaskKind.COMPUTE:
            durations.append(compute_seconds(topology, dtype, task.flops, task.hbm_bytes, task.kernels,
                                             task.replicated_bytes, task.split_bytes, task.tensor_bytes, task.gemms))
            loads.append(None)
            continue
        key = (task.kind, task.op, task.group, task.nbytes, task.count, id(task.instances))
        cached = memo.get(key)
        if cached is None:
            cached = memo[key] = _price_transfer(topology, timing, task, bw, sym)
        durations.append(cached[0])
        loads.append(cached[1])
    return Priced(durations=tuple(durations), loads=tuple(loads), bandwidth=bandwidth)


class _Symmetry:
    """Locality and translation symmetry of a hierarchy, to price 4096-device programs quickly.

    On a hierarchy (levels form) a route climbs from each end to the lowest
    common switch, so it crosses a link only if one end's chain up to the top
    contains it: instances of a transfer with no such member cannot load the
    representative's links and are skipped. Shifting every level coordinate
    by a constant is an automorphism of a hierarchy, so a group is timed as
    its translate through device 0 (memoized once for all stages) and its
    link loads are mapped back hop by hop along the members' chains. On a
    torus that wraps around every dim, routes move only along the dims their
    ends differ in, and translations are automorphisms: groups are timed as
    their translate to the origin and only groups that share the
    representative's fixed coordinates are counted (testbed.collectives.torus).
    Other forms check every instance and time groups as they are. All are exact.
    """

    def __init__(self, topology: Topology) -> None:
        from testbed.collectives import torus

        self.topology = topology
        self.levels = topology.form is Form.LEVELS and len(topology.levels) > 0
        self.torus = torus if torus.translatable(topology) else None
        self.chains: dict[int, tuple] = {}
        self.arrays: dict[int, tuple] = {}  # id(instances) -> (instances, their members as an array)

    def chain(self, device: int) -> tuple:
        """Per level (size > 1), the nodes from ``device`` up to where its routes to that level turn."""
        cached = self.chains.get(device)
        if cached is None:
            t = self.topology
            coords = t.coords(device)
            paths = []
            stride = 1
            for k, level in enumerate(t.levels):
                if level.size > 1:
                    partner = device + stride * ((coords[k] + 1) % level.size - coords[k])
                    hops = t.route(device, partner)
                    paths.append((device, *(v for _, v in hops[: len(hops) // 2])))
                stride *= level.size
            cached = self.chains[device] = tuple(paths)
        return cached

    def relevant(self, instances, watched: set, ends) -> list:
        """Instances that can load a ``watched`` link (routes between the devices ``ends``)."""
        if self.torus is not None:
            return self.torus.touching(self.topology, instances, [x for link in watched for x in link])
        if not self.levels:
            return list(instances)
        keys = {frozenset(link) for link in watched}
        # A member shares a hop with an end's chain only if both sit in the same innermost group.
        inner = self.topology.levels[0].size
        near = {x // inner for x in ends}
        members = self.arrays.get(id(instances))
        if members is None or members[0] is not instances:
            members = self.arrays[id(instances)] = (instances, np.asarray(instances, dtype=np.int64).reshape(
                len(instances), -1))
        candidates = np.flatnonzero(np.isin(members[1] // inner, list(near)).any(axis=1))
        out = []
        for index in candidates.tolist():
            g = instances[index]
            if any(m // inner in near and any(frozenset(h) in keys for c in self.chain(m) for h in zip(c[:-1], c[1:]))
                   for m in g):
                out.append(g)
        return out

    def _shift(self, device: int, by: tuple[int, ...]) -> int:
        out, stride = 0, 1
        for c, b, level in zip(self.topology.coords(device), by, self.topology.levels):
            out += ((c + b) % level.size) * stride
            stride *= level.size
        return out

    def loads(self, timing, op: str, group: tuple[int, ...], nbytes: float) -> dict:
        """``timing.link_loads`` of ``group``, computed on its translate through device 0."""
        if self.torus is not None:
            canon, back = self.torus.canonical(self.topology, group)
            return self.torus.shift_loads(self.topology, timing.link_loads(self.topology, op, canon, nbytes), back)
        if not self.levels or group[0] == 0:
            return timing.link_loads(self.topology, op, group, nbytes)
        back = self.topology.coords(group[0])
        to = tuple(-c for c in back)
        canon = tuple(self._shift(d, to) for d in group)
        nodes = {}
        for d, c in zip(group, canon):
            for path_c, path_d in zip(self.chain(c), self.chain(d)):
                nodes.update(zip(path_c, path_d))
        return {(nodes[u], nodes[v]): b for (u, v), b in timing.link_loads(self.topology, op, canon, nbytes).items()}

    def time(self, timing, op: str, group: tuple[int, ...], nbytes: float) -> float:
        """Standalone seconds of ``op`` over ``group`` (timed on its translate through device 0)."""
        if self.torus is not None:
            group = self.torus.canonical(self.topology, group)[0]
        elif self.levels and group[0] != 0:
            to = tuple(-c for c in self.topology.coords(group[0]))
            group = tuple(self._shift(d, to) for d in group)
        return timing.collective_time(self.topology, op, group, nbytes).time_s


def _price_transfer(topology: Topology, timing, task: Task, bw, sym: _Symmetry) -> tuple[float, dict]:
    """(standalone seconds, normalised loads on the representative's links) of one transfer."""
    if task.nbytes <= 0 or len(task.group) < 2:
        return 0.0, {}
    if task.kind is TaskKind.SEND:
        src, dst = task.group
        seconds = timing.send_time(topology, src, dst, task.nbytes) * task.count
        watched = set(topology.route(src, dst))
        own = {link: task.nbytes * task.count for link in watched}
        total: dict = {}
        for a, b_ in sym.relevant(task.instances, watched, task.group):
            for link in topology.route(a, b_):
                if link in watched:
                    total[link] = total.get(link, 0.0) + task.nbytes * task.count
    else:
        seconds = sym.time(timing, task.op, task.group, task.nbytes) * task.count
        watched = _neighbour_links(topology, task.group, task.device)
        own = {link: b * task.count for link, b in sym.loads(timing, task.op, task.group, task.nbytes).items()}
        total = {}
        for group in sym.relevant(task.instances, watched, _ring_neighbours(task.group, task.device)):
            if group == task.group:
                loads = own
            else:
                loads = {k: b * task.count for k, b in sym.loads(timing, task.op, group, task.nbytes).items()}
            for link, b in loads.items():
                if link in watched:
                    total[link] = total.get(link, 0.0) + b
    capacity = {link: bw(link) for link in own}
    for link in total:
        bw(link)
    return seconds, normalised_loads(seconds, total, own, capacity)


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
    ledger = LinkLedger(priced.bandwidth)

    def try_rows(rows) -> None:
        nonlocal dirty_comm, dirty_compute
        work = list(rows)
        while work:
            r = work.pop()
            if busy[r] or not queues[r] or pending[queues[r][0]]:
                continue
            i = queues[r].popleft()
            busy[r] = True
            start[i] = now
            if durations[i] <= 0:
                work.extend(finish(i))
                continue
            active[i] = 1.0
            if is_comm[i]:
                ledger.add(i, Flow(1.0 / durations[i], task_loads[i] or {}))
                dirty_comm = True
            else:
                dirty_compute = True

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
    while active:
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
        first = min(active, key=lambda i: active[i] / rate[i])
        dt = active[first] / rate[first]
        now += dt
        done = []
        for i in active:
            left = active[i] - rate[i] * dt
            active[i] = left
            if left <= _DONE or i == first:
                done.append(i)
        rows: list[int] = []
        for i in done:
            del active[i]
            del rate[i]
            if is_comm[i]:
                ledger.remove(i)
                dirty_comm = True
            else:
                dirty_compute = True
            rows.extend(finish(i))
        try_rows(rows)
    if any(math.isnan(e) for e in end):
        stuck = [tasks[i].name for i in range(n) if math.isnan(end[i])][:5]
        raise RuntimeError(f"the task graph deadlocks; unfinished tasks include {stuck}")
    return _timeline(program, ordered, row_of, start, end)


def _timeline(program: Program, rows: list[tuple[int, str]], row_of, start, end) -> Timeline:
    tasks = program.tasks
    starts, ends = np.asarray(start), np.asarray(end)
    step = float(ends.max(initial=0.0))
    pipeline = [i for i, t in enumerate(tasks) if t.pipeline]
    phase = float(ends[pipeline].max()) if pipeline else step
    names = {TaskKind.COMPUTE: "compute", TaskKind.HOST: "host"}
    cats = [CATEGORIES.index(names.get(t.kind, "comm")) for t in tasks]
    labels = [t.name for t in tasks]
    out_rows, out_start, out_end, out_cat, out_label = list(row_of), list(start), list(end), cats, labels
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
    program = build_program(plan, place(plan, topology), controller=topology.calibration.controller is not None,
                            combine_bytes=topology.calibration.collectives.combine_bytes)
    priced = price(program, topology, plan.precision.compute_dtype)
    timeline = run(program, priced, calibration=topology.calibration)
    return Simulation(report=report(plan, topology, timeline, len(program.tasks)), timeline=timeline, program=program)
