"""Pricing a task graph: each task's standalone duration and, for communication, its link loads.

:func:`price` turns each task of a :class:`~testbed.sim.graph.tasks.Program` into a
standalone duration (compute: testbed.sim.price.compute's roofline of the
calibrated device; host tasks: the controller's calibrated costs,
:func:`controller_seconds`; collectives and sends: testbed.collectives.timing)
and, for transfers, the bytes every group running the task at once puts on
the links the representative's own traffic crosses (its ring neighbours'
routes, or the send route), normalised for the engine's max-min sharing
(testbed.sim.price.contention). :class:`_Symmetry` keeps 4096-device programs quick
(locality and translation symmetry of hierarchies and tori; exact).
testbed.sim.graph.engine plays the priced program.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from testbed.collectives import timing, torus
from testbed.sim.price.compute import compute_seconds
from testbed.collectives.routed import topology_memo
from testbed.sim.price.contention import Flow, normalised_loads
from testbed.sim.step.step_rules import PREPARE_PIPELINE, PREPARE_STEP, dispatch_seconds, prepare_seconds
from testbed.sim.graph.tasks import Program, Task, TaskKind
from testbed.topology import Calibration, Form, Topology

__all__ = ["Priced", "price", "controller_seconds", "collective_flow"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Priced:
    """Standalone seconds per task and, for transfers, bytes per directed link (normalised); how much longer
    compute takes beside its device's communication (the topology's ``device.comm_slowdown``)."""

    durations: tuple[float, ...]
    loads: tuple[Mapping | None, ...]
    bandwidth: Mapping
    comm_slowdown: float = 0.0


def controller_seconds(calibration: Calibration, task: Task) -> float:
    """Controller time of a host task: the step's preparation, or a dispatch (per program and per device buffer;
    testbed.sim.step.step_rules' costs, which the analytic tier reads too).

    0 when the calibration has no ``controller`` group (such a topology's programs have no host tasks).
    """
    controller = calibration.controller
    if controller is None:
        return 0.0
    if task.op in (PREPARE_STEP, PREPARE_PIPELINE):  # testbed.sim.step.step_rules.step_prepare
        return prepare_seconds(controller, task.op)
    return dispatch_seconds(controller, task.count, task.buffers)



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
    durations: list[float] = []
    loads: list[Mapping | None] = []
    bandwidth: dict = {}
    memo: dict = {}
    computed: dict[tuple, float] = {}  # a compute task's seconds by what compute_seconds reads of it
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
            # Every microbatch's tasks of an action alike: priced once (the program holds their GEMMs and spans, so
            # their ids are theirs while it prices).
            key = (task.flops, task.hbm_bytes, task.kernels, task.replicated_bytes, task.split_bytes,
                   task.tensor_bytes, id(task.gemms), id(task.spans), task.epilogue_flops, task.epilogue_bytes)
            seconds = computed.get(key)
            if seconds is None:
                seconds = computed[key] = compute_seconds(
                    topology, dtype, task.flops, task.hbm_bytes, task.kernels, task.replicated_bytes, task.split_bytes,
                    task.tensor_bytes, task.gemms, task.spans, (task.epilogue_flops, task.epilogue_bytes))
            durations.append(seconds)
            loads.append(None)
            continue
        key = (task.kind, task.op, task.group, task.nbytes, task.count, id(task.instances))
        cached = memo.get(key)
        if cached is None:
            cached = memo[key] = _price_transfer(topology, timing, task, bw, sym)
        durations.append(cached[0])
        loads.append(cached[1])
    return Priced(durations=tuple(durations), loads=tuple(loads), bandwidth=bandwidth,
                  comm_slowdown=topology.device.comm_slowdown)


def collective_flow(topology: Topology, op: str, groups: tuple[tuple[int, ...], ...], nbytes: float
                    ) -> tuple[Flow | None, Mapping]:
    """One collective ``op`` of ``nbytes`` over every one of ``groups`` at once (the first holds the representative
    device, its first member) as :func:`price` prices its task for the engine: a Flow at its standalone speed over
    its normalised loads on the representative's links (None: it moves nothing), and the links' bandwidths. For a
    tier that plays transfers side by side without the engine (testbed.sim.price.contention.shared_factor)."""
    memo = topology_memo(topology).setdefault("flow pricing", {})
    if not memo:
        memo["bandwidth"], memo["sym"] = {}, _Symmetry(topology)
    bandwidth = memo["bandwidth"]

    def bw(link) -> float:
        value = bandwidth.get(link)
        if value is None:
            value = bandwidth[link] = float(topology.graph.edges[link]["bandwidth"])
        return value
    task = Task(name=op, device=groups[0][0], stream="", kind=TaskKind.COLLECTIVE, op=op, nbytes=nbytes,
                group=groups[0], instances=groups)
    seconds, loads = _price_transfer(topology, timing, task, bw, memo["sym"])
    return (Flow(1.0 / seconds, loads) if seconds > 0 and loads else None), bandwidth


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
