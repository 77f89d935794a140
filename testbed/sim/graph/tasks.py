"""The simulator's IR: tasks on representative devices' streams, a step's program, and mesh-axis groups.

testbed.sim.graph.program builds a :class:`Program` from a plan (its docstring says
what each stream and task stands for); testbed.sim.graph.engine prices and plays
it; testbed.sim.report.timeline reports what ran when. Kept apart from the builder
so the three read one small definition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np

from testbed.model.gemm import Gemm
from testbed.pipeline.schedules import Schedule
from testbed.plan.placement import Placement
from testbed.plan.spec import MESH_AXES, Axis, Plan
from testbed.sim.price.barriers import merge

__all__ = ["TaskKind", "Task", "Program", "Builder", "axis_groups", "axis_groups_cached", "rep_group"]


class TaskKind(StrEnum):
    COMPUTE = "compute"
    COLLECTIVE = "collective"
    SEND = "send"
    HOST = "host"


@dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    """One task on one representative device's stream.

    Compute tasks carry ``flops``, ``hbm_bytes`` and ``kernels`` (the FLOPs of
    one kernel decide its efficiency), and the activation bytes they write,
    ``replicated_bytes`` and ``split_bytes`` over the tensor axis (priced by
    the elementwise passes of the calibration); ``tensor_bytes`` is one
    ``[tokens, d_model]`` activation of the task's microbatch (how much of its
    passes run from cache: ``Calibration.cached_fraction``). Collectives carry ``op``, ``nbytes``
    (DESIGN.md convention), ``count`` back-to-back repeats and the
    representative's ``group``; sends carry ``group = (src, dst)``.
    ``instances`` are all groups or pairs running the same task at once.
    ``pipeline`` marks F/B/W actions and their tensor all-reduces. Host tasks
    are the controller's: a dispatch of ``count`` programs passing
    ``buffers`` device buffers in all (testbed.model.buffers), or the step's
    preparation (``op="step"`` or ``"pipeline step"``, ``count=0``).
    On a shared host (testbed.sim.price.barriers) a compute task's ``syncs`` are the
    ``(group size, count)`` barriers its action's program meets among its
    kernels, and a collective counted there is ``interleaved`` (it does not
    wait for stragglers again). ``spans``: a compute task's spans between blocking tensor collectives (share of
    its matmuls, HBM bytes; testbed.model.spans), each its own roofline where the calibration has no
    elementwise passes (testbed.sim.price.compute.compute_seconds). ``epilogue_flops``/``epilogue_bytes``: of a compute
    task's ``hbm_bytes``, those that run as the epilogue of other tasks' matmuls of that many FLOPs
    (testbed.sim.price.compute.epilogue_seconds; the optimizer update fused into the weight gradients').
    """

    name: str
    device: int
    stream: str
    kind: TaskKind
    deps: tuple[int, ...] = ()
    flops: float = 0.0
    hbm_bytes: float = 0.0
    replicated_bytes: float = 0.0
    split_bytes: float = 0.0
    tensor_bytes: float = 0.0
    kernels: int = 1
    op: str = ""
    nbytes: float = 0.0
    count: int = 1
    group: tuple[int, ...] = ()
    instances: tuple[tuple[int, ...], ...] = ()
    pipeline: bool = False
    buffers: int = 0
    gemms: tuple[Gemm, ...] = ()
    syncs: tuple[tuple[int, float], ...] = ()
    interleaved: bool = False
    spans: tuple[tuple[float, float], ...] = ()
    epilogue_flops: float = 0.0
    epilogue_bytes: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Program:
    """The tasks of one step, in program order, and the device -> representative map."""

    tasks: tuple[Task, ...]
    representative: np.ndarray
    multiplicity: dict = field(default_factory=dict)
    schedule: Schedule | None = None

    def __post_init__(self) -> None:
        rep = np.asarray(self.representative, dtype=np.int64)
        rep.setflags(write=False)
        object.__setattr__(self, "representative", rep)
        reps, counts = np.unique(rep, return_counts=True)
        object.__setattr__(self, "multiplicity", {int(r): int(c) for r, c in zip(reps, counts)})
        for i, task in enumerate(self.tasks):
            if any(not 0 <= d < i for d in task.deps):
                raise ValueError(f"task {i} ({task.name}) depends on a later or missing task: {task.deps}")

    @property
    def num_devices(self) -> int:
        return int(self.representative.size)

    @property
    def representatives(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(t.device for t in self.tasks))


def axis_groups(placement: Placement, axes: Sequence[Axis | str]) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Per pipeline stage, the device groups that vary along ``axes`` (mesh order inside a group)."""
    ids = placement.device_ids
    dims = [MESH_AXES.index(Axis(a)) for a in axes]
    keep = [d for d in range(ids.ndim) if d not in dims]
    moved = np.transpose(ids, keep + sorted(dims))
    size = int(np.prod([ids.shape[d] for d in dims])) if dims else 1
    out: dict[int, tuple[tuple[int, ...], ...]] = {}
    for s in range(ids.shape[0]):
        block = moved[s].reshape(-1, size)
        out[s] = tuple(map(tuple, block.tolist()))  # Python ints, a row per group
    return out


class Builder:
    """Appends tasks and keeps per-stage bookkeeping while the program is built."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []

    def add(self, **kwargs) -> int:
        self.tasks.append(Task(**kwargs))
        return len(self.tasks) - 1

    def interleave(self, computes: Sequence[int], collectives: Sequence[int]) -> None:
        """Count ``collectives`` (task ids) as barriers among the kernels of ``computes`` (an action's compute
        tasks, an equal share on each): the computes gain their ``syncs``, the collectives are marked
        ``interleaved`` (testbed.sim.price.barriers)."""
        if not computes:
            return
        parts = []
        for i in collectives:
            t = self.tasks[i]
            if t.kind is TaskKind.COLLECTIVE and len(t.group) > 1:
                parts.append((len(t.group), t.count / len(computes)))
                _set(t, interleaved=True)
        alone = merge(parts)  # a compute without barriers of its own gains these (the same sums)
        for i in computes:
            task = self.tasks[i]
            _set(task, syncs=merge((*task.syncs, *parts)) if task.syncs else alone)

    def serialize(self, programs: Sequence[tuple[range, int]]) -> None:
        """Run ``programs`` (``(task ids, devices)``, in dispatch order) one at a time, each once the previous
        one has completed on all its devices (testbed.topology.HostCalibration.serial_programs).

        A program's first tasks (those that depend on none of its own) also wait for the previous one's last
        tasks (those none of its own depend on), and its end is a meeting of its devices: its last compute
        task gains one barrier of ``devices`` among its ``syncs`` (testbed.sim.price.barriers). The controller's
        tasks and the sends between stages are not a program's own.
        """
        previous: tuple[int, ...] = ()
        for ids, devices in programs:
            own = [i for i in ids if self.tasks[i].kind not in (TaskKind.HOST, TaskKind.SEND)]
            inside = set(own)
            needed = {d for i in own for d in self.tasks[i].deps if d in inside}
            for i in own if previous else ():
                task = self.tasks[i]
                if not inside.intersection(task.deps):
                    self.tasks[i] = replace(task, deps=task.deps + previous)
            computes = [i for i in own if self.tasks[i].kind is TaskKind.COMPUTE]
            if computes:
                task = self.tasks[computes[-1]]
                self.tasks[computes[-1]] = replace(task, syncs=merge((*task.syncs, (devices, 1.0))))
            previous = tuple(i for i in own if i not in needed) or previous


def _set(task: Task, **changes) -> None:
    """Changes a task the builder holds in place: its tasks are its own (each :meth:`Builder.add` makes a new one,
    none is shared until the program is made), so this is ``replace`` without the copy of every field."""
    for name, value in changes.items():
        object.__setattr__(task, name, value)


#: id(groups) -> (groups, {device: the first of its groups holding it}), for :func:`rep_group`.
_GROUP_OF: dict[int, tuple[tuple, dict[int, tuple[int, ...]]]] = {}


def rep_group(groups: tuple[tuple[int, ...], ...], rep: int) -> tuple[int, ...]:
    """The first of ``groups`` that holds device ``rep`` (a map of each device's, kept per groups object: a
    program's builder asks it of the same groups once per task)."""
    hit = _GROUP_OF.get(id(groups))
    if hit is None or hit[0] is not groups:
        if len(_GROUP_OF) > 4096:
            _GROUP_OF.clear()
        first: dict[int, tuple[int, ...]] = {}
        for g in groups:
            for device in g:
                first.setdefault(device, g)
        hit = _GROUP_OF[id(groups)] = (groups, first)
    return hit[1][rep]


def axis_groups_cached(cache: dict, plan: Plan, axes: list[Axis], stage: int) -> tuple[tuple[int, ...], ...]:
    """:func:`axis_groups` of ``axes`` for ``stage``, memoized in ``cache`` (which holds the placement)."""
    key = tuple(axes)
    if key not in cache:
        cache[key] = axis_groups(cache["placement"], list(axes))
    return cache[key][stage]
