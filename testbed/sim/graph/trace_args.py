"""What a trace's slices say when opened: the ``args`` of each span of a simulated step.

A Perfetto user who clicks a communication slice should learn more than its
name: the collective's op, the bytes it moves, its group's size, how many
groups run it at once, the algorithm the simulator chose and the links the
representative device's part of it crosses. A compute slice carries what the
simulator priced it from (FLOPs, HBM bytes, kernels, activation bytes), a
controller slice its programs and buffers. Spans that are not tasks (a
compute task's wait at its barriers, the pipeline's bubbles) get a short note
or nothing.

:func:`span_args` reads the program the timeline was played from; the
engine lists the tasks' spans first, in program order, and each one is
checked against its task (same name, same device) before it gets arguments,
so a timeline from elsewhere simply gets none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from testbed.errors import InputError
from testbed.sim.graph.tasks import Program, Task, TaskKind
from testbed.sim.report.timeline import Timeline
from testbed.sim.report.trace_files import write_gantt, write_trace
from testbed.topology import Topology

__all__ = ["span_args", "write_outputs", "MAX_LINKS"]

#: Links listed per slice at most (a 1024-rank group's neighbours are few, a torus plane's are not).
MAX_LINKS = 16


def _link_text(topology: Topology, link: tuple) -> str:
    u, v = link
    kind = topology.graph.edges[link].get("kind", "")
    return f"{u}->{v}" + (f" ({kind})" if kind else "")


def _links(topology: Topology, links) -> dict[str, Any]:
    shown = sorted(links, key=str)
    out: dict[str, Any] = {"links": [_link_text(topology, link) for link in shown[:MAX_LINKS]]}
    if len(shown) > MAX_LINKS:
        out["links_total"] = len(shown)
    return out


def _collective(topology: Topology, task: Task, memo: dict) -> dict[str, Any]:
    from testbed.collectives.timing import collective_time

    out: dict[str, Any] = {"op": task.op, "bytes": task.nbytes, "count": task.count, "group_size": len(task.group),
                           "groups_at_once": max(1, len(task.instances))}
    if task.nbytes <= 0 or len(task.group) < 2:
        return out
    key = (task.op, task.group, task.nbytes)
    if key not in memo:
        try:
            algorithm = collective_time(topology, task.op, task.group, task.nbytes).algorithm
        except InputError:  # a group the timing model refuses to route: the slice still has its sizes
            algorithm = None
        group, rep = list(task.group), task.device
        links: set = set()
        if rep in group:  # the representative's routes to its ring neighbours, as pricing watches them
            i = group.index(rep)
            for a, b in ((rep, group[(i + 1) % len(group)]), (group[i - 1], rep)):
                links.update(topology.route(a, b))
                links.update(topology.route(b, a))
        memo[key] = {**({"algorithm": algorithm} if algorithm else {}), **_links(topology, links)}
    return {**out, **memo[key]}


def _task_args(topology: Topology, task: Task, memo: dict) -> dict[str, Any]:
    if task.kind is TaskKind.COMPUTE:
        out = {"flops": task.flops, "hbm_bytes": task.hbm_bytes, "kernels": task.kernels}
        for name in ("replicated_bytes", "split_bytes", "tensor_bytes"):
            if getattr(task, name):
                out[name] = getattr(task, name)
        return out
    if task.kind is TaskKind.HOST:
        return {"op": task.op, "programs": task.count, "buffers": task.buffers}
    if task.kind is TaskKind.SEND:
        src, dst = task.group if len(task.group) == 2 else (task.device, task.device)
        return {"op": "send", "bytes": task.nbytes, "count": task.count, "src": src, "dst": dst, "group_size": 2,
                "pairs_at_once": max(1, len(task.instances)), **_links(topology, topology.route(src, dst))}
    return _collective(topology, task, memo)


def span_args(program: Program, timeline: Timeline, topology: Topology) -> tuple[Mapping[str, Any] | None, ...]:
    """One ``args`` mapping (or None) per span of ``timeline``, for :func:`testbed.sim.report.trace_files.write_trace`."""
    out: list[Mapping[str, Any] | None] = [None] * len(timeline.label)
    memo: dict = {}
    tasks = program.tasks
    for i, task in enumerate(tasks[: len(out)]):
        device, _ = timeline.rows[int(timeline.row[i])]
        if timeline.label[i] != task.name or device != task.device:
            return tuple([None] * len(out))  # not this program's timeline: no arguments rather than wrong ones
        out[i] = _task_args(topology, task, memo)
    for i in range(len(tasks), len(out)):
        label = timeline.label[i]
        if label.startswith("wait "):
            out[i] = {"waiting_for": label[len("wait "):], "why": "the task's barriers waited for the other devices"}
        elif label == "bubble":
            out[i] = {"why": "the stage runs no pipeline action here (schedule bubble)"}
    return tuple(out)


def write_outputs(timeline: Timeline, program: Program, topology: Topology, trace: str | None, gantt: str | None,
                  max_trace_bytes: float | None, title: str) -> dict[str, str]:
    """The files ``simulate`` writes, for a plan or a traced program alike: a Perfetto trace whose slices carry
    :func:`span_args`, and a Gantt chart; ``{"trace": path, "gantt": path}`` for those asked."""
    written = {}
    if trace:
        written["trace"] = str(write_trace(timeline, trace, max_bytes=max_trace_bytes,
                                           args=span_args(program, timeline, topology)))
    if gantt:
        written["gantt"] = str(write_gantt(timeline, gantt, title=title))
    return written
