"""Exposed communication split by kind: which collectives the busiest device waits on.

The timeline's exposed communication (:meth:`Timeline.exposed_comm_s`) is
the time the busiest representative communicates while computing nothing.
Here that time is split by the stream its communication runs on, named by
:data:`COMM_KINDS`; where several kinds run at once outside compute, the
instant is shared evenly among them, so the parts sum to the total.
"""

from __future__ import annotations

from testbed.sim.report.timeline import Timeline

__all__ = ["COMM_KINDS", "KIND_LEGEND", "exposed_by_kind", "cached_exposed_by_kind"]

#: Communication stream -> the kind a table and a plot name it by.
COMM_KINDS: dict[str, str] = {
    "tensor": "tensor", "sequence": "tensor",   # tensor-parallel all-reduces, or sequence-parallel RS/AG
    "pipe": "pipeline", "recv": "pipeline",     # pipeline point-to-point sends of activations and gradients
    "grad": "grad sync",                        # data-parallel gradient all-reduce / reduce-scatter
    "gather": "gathers",                        # fsdp / ZeRO-3 parameter all-gathers
    "expert": "all-to-all",                     # MoE dispatch and combine
    "ring": "ring",                             # ring attention's K/V sends
    "loss": "loss",                             # the vocabulary-parallel loss's reductions
}

#: One line per kind, for a table's legend.
KIND_LEGEND: dict[str, str] = {
    "tensor": "tensor-parallel collectives",
    "pipeline": "sends between stages",
    "grad sync": "data-parallel gradient reduction",
    "gathers": "fsdp / ZeRO-3 parameter gathers",
    "all-to-all": "MoE dispatch and combine",
    "ring": "ring attention's K/V sends",
    "loss": "vocabulary-parallel loss reductions",
    "other": "other communication",
}


def exposed_by_kind(timeline: Timeline) -> dict[str, float]:
    """Seconds of the busiest representative's exposed communication per kind (:data:`COMM_KINDS`).

    Kinds with no exposed time are left out; the values sum to
    ``timeline.exposed_comm_s()`` up to rounding.
    """
    if not timeline.representatives:
        return {}
    device = timeline.busiest()
    events: list[tuple[float, int, str | None]] = []  # (time, +1 start / -1 end, kind; None: compute)
    for s in timeline.spans(device):
        if s.end > s.start and s.category in ("compute", "comm"):
            kind = None if s.category == "compute" else COMM_KINDS.get(s.stream, "other")
            events += [(s.start, 1, kind), (s.end, -1, kind)]
    events.sort(key=lambda e: e[0])
    active: dict[str | None, int] = {}
    out: dict[str, float] = {}
    last = None
    for time, step, kind in events:
        if last is not None and time > last and not active.get(None):
            kinds = [k for k, n in active.items() if n > 0 and k is not None]
            for k in kinds:
                out[k] = out.get(k, 0.0) + (time - last) / len(kinds)
        active[kind] = active.get(kind, 0) + step
        last = time
    return {k: v for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v > 0}


def cached_exposed_by_kind(timeline: Timeline, memo: dict) -> dict[str, float]:
    """:func:`exposed_by_kind` of ``timeline``, kept in ``memo`` by the timeline's identity (a search's replays of
    equal task graphs share one timeline: testbed.sim.graph.engine.simulate's memo); a copy each call."""
    hit = memo.get(id(timeline))
    if hit is None or hit[0] is not timeline:
        if len(memo) > 64:
            memo.clear()
        hit = memo[id(timeline)] = (timeline, exposed_by_kind(timeline))
    return dict(hit[1])
