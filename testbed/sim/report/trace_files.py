"""A step's :class:`~testbed.sim.report.timeline.Timeline` as files: a Chrome/Perfetto trace and a Gantt chart.

The trace has one process per device and one thread per stream, ``X`` events with ``ts``/``dur`` in
microseconds (opens in ui.perfetto.dev); each representative's events are serialised once and repeated per
device, so a 4096-device trace costs string joins. The Gantt PNG draws the representative devices.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from testbed.errors import InputError
from testbed.sim.report.timeline import CATEGORIES, Timeline

__all__ = ["SpanArgs", "chrome_trace", "trace_bytes", "write_trace", "write_gantt"]

#: ``args`` of each span (one mapping or None per span), e.g. :func:`testbed.sim.graph.trace_args.span_args`.
SpanArgs = Sequence[Mapping[str, Any] | None]


def chrome_trace(timeline: Timeline, devices: Sequence[int] | None = None,
                 args: SpanArgs | None = None) -> dict[str, Any]:
    """Chrome/Perfetto trace: one process per device, one thread per stream, ``X`` events in µs.

    With ``args`` (one per span), each span's event carries its mapping as ``args``: what Perfetto shows
    when the slice is opened.
    """
    if args is not None and len(args) != len(timeline.label):
        raise ValueError(f"args needs one entry per span ({len(timeline.label)}), got {len(args)}")
    devices = range(timeline.num_devices) if devices is None else devices
    events: list[dict[str, Any]] = []
    rep_events: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for device in devices:
        device = int(device)
        rep = int(timeline.representative[device])
        streams = timeline.streams(device)
        events.append({"ph": "M", "name": "process_name", "pid": device, "tid": 0,
                       "args": {"name": f"device {device}" + ("" if rep == device else f" (as {rep})")}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": device, "tid": 0, "args": {"sort_index": device}})
        for tid, stream in enumerate(streams):
            events.append({"ph": "M", "name": "thread_name", "pid": device, "tid": tid, "args": {"name": stream}})
        cached = rep_events.get(rep)
        if cached is None:
            cached = []
            for i, s in zip(timeline._indices(rep).tolist(), timeline.spans(rep)):
                event = {"ph": "X", "name": s.label, "cat": s.category, "ts": s.start * 1e6, "dur": s.duration * 1e6}
                if args is not None and args[i]:
                    event["args"] = dict(args[i])
                cached.append((streams.index(s.stream), event))
            rep_events[rep] = cached
        events.extend({**e, "pid": device, "tid": tid} for tid, e in cached)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": timeline.source, "step_time_s": timeline.step_time_s}}


def _fragments(timeline: Timeline, rep: int, args: SpanArgs | None = None) -> list[str]:
    one = chrome_trace(timeline, devices=[rep], args=args)["traceEvents"]
    return [json.dumps({k: v for k, v in e.items() if k != "pid"}, separators=(",", ":"))[1:] for e in one]


def trace_bytes(timeline: Timeline, devices: Sequence[int] | None = None,
                fragments: dict[int, list[str]] | None = None, args: SpanArgs | None = None) -> int:
    """Bytes :func:`write_trace` would write (to within the length of device names), without writing them."""
    devices = range(timeline.num_devices) if devices is None else devices
    fragments = {} if fragments is None else fragments
    per_rep: dict[int, tuple[int, int]] = {}  # rep -> (bytes of its events, event count)
    total = 80
    for device in devices:
        device = int(device)
        rep = int(timeline.representative[device])
        if rep not in per_rep:
            cached = fragments.get(rep)
            if cached is None:
                cached = fragments[rep] = _fragments(timeline, rep, args)
            per_rep[rep] = (sum(len(t) + 9 for t in cached), len(cached))
        size, count = per_rep[rep]
        total += size + count * len(str(device)) + 2 * len(str(device)) + 20
    return total


def write_trace(timeline: Timeline, path: str | Path, devices: Sequence[int] | None = None,
                max_bytes: float | None = None, limit_field: str = "--max-trace-bytes",
                args: SpanArgs | None = None) -> Path:
    """Write :func:`chrome_trace` as JSON atomically, streamed device by device.

    Each representative's events are serialised once and repeated with each
    device's pid, so a 4096-device trace costs string joins, not millions of dicts.
    With ``max_bytes`` set, a trace estimated larger is refused (InputError
    naming ``limit_field``) before anything is written. ``args``: as :func:`chrome_trace`'s.
    """
    from testbed.output import atomic_path
    from testbed.units import format_bytes

    devices = range(timeline.num_devices) if devices is None else devices
    fragments: dict[int, list[str]] = {}
    if max_bytes is not None:
        size = trace_bytes(timeline, devices, fragments, args)
        if size > max_bytes:
            raise InputError(f"the trace of {len(devices):,} devices would be about {format_bytes(size)}, over the "
                             f"limit of {format_bytes(max_bytes)}; raise it (e.g. {limit_field} "
                             f"{math.ceil(size / 2**30)}GiB) or leave out --trace", field=limit_field)
    with atomic_path(path, "trace") as tmp, open(tmp, "w") as out:
        out.write('{"displayTimeUnit":"ms","otherData":')
        out.write(json.dumps({"source": timeline.source, "step_time_s": timeline.step_time_s}))
        out.write(',"traceEvents":[')
        first = True
        for device in devices:
            device = int(device)
            rep = int(timeline.representative[device])
            cached = fragments.get(rep)
            if cached is None:
                cached = fragments[rep] = _fragments(timeline, rep, args)
            name = json.dumps(f"device {device}" + ("" if rep == device else f" (as {rep})"))
            head = f'{{"pid":{device},'
            parts = []
            for text in cached:
                if text.startswith('"ph":"M","name":"process_name"'):
                    text = f'"ph":"M","name":"process_name","tid":0,"args":{{"name":{name}}}}}'
                elif text.startswith('"ph":"M","name":"process_sort_index"'):
                    text = f'"ph":"M","name":"process_sort_index","tid":0,"args":{{"sort_index":{device}}}}}'
                parts.append(head + text)
            out.write(("" if first else ",") + ",".join(parts))
            first = False
        out.write("]}")
    return Path(path)


def write_gantt(timeline: Timeline, path: str | Path, title: str = "") -> Path:
    """Gantt PNG of the representative devices, via testbed.viz.gantt: per device a compute row and a
    communication row (all its collective streams merged; pipeline sends apart by colour), times in ms.

    Compute spans are coloured by their pipeline action (``F``/``B``/``W`` and the microbatch in the label),
    other compute (gradient accumulation, optimizer, loss) plainly; idle gaps are hatched by testbed.viz.gantt.
    A row named ``dev D (xN)`` stands for device D and the N - 1 devices that run the same spans.
    """
    from testbed.viz.gantt import Bar, draw_gantt

    keys: list[tuple[int, str]] = []
    for device, stream in timeline.rows:
        key = (device, "host" if stream == "host" else "compute" if stream == "compute" else "comm")
        if key not in keys:
            keys.append(key)
    keys.sort(key=lambda k: (k[1] == "host", k[0], k[1] != "compute"))
    names = []
    for device, kind in keys:
        count = int(np.count_nonzero(timeline.representative == device))
        names.append("controller" if kind == "host" else f"dev {device}{f' (x{count})' if count > 1 else ''} {kind}")
    bars = []
    for r, start, end, label, code in zip(timeline.row, timeline.start, timeline.end, timeline.label,
                                          timeline.category):
        category = CATEGORIES[int(code)]
        if category == "bubble":
            continue
        device, stream = timeline.rows[int(r)]
        key = (device, "host" if stream == "host" else "compute" if stream == "compute" else "comm")
        bars.append(Bar(row=keys.index(key), start=float(start) * 1e3, end=float(end) * 1e3,
                        label=_action_label(label) if category == "compute" else "",
                        category=_gantt_category(stream, category, label)))
    note = "dev D (xN): device D and the N - 1 devices that run the same spans" if any(
        int(np.count_nonzero(timeline.representative == d)) > 1 for d, _ in keys) else ""
    return draw_gantt(names, bars, path, time_unit="ms", note=note,
                      title=title or f"{timeline.source} step: {timeline.step_time_s * 1e3:.4g} ms")


def _gantt_category(stream: str, category: str, label: str) -> str:
    """The Gantt colour of a span: F/B/W for pipeline actions, ``send`` for pipeline sends, else its category."""
    if category == "compute" and _action_label(label):
        return label[0]
    if category == "comm" and stream in ("pipe", "recv"):
        return "send"
    return category


def _action_label(label: str) -> str:
    """``F3``/``B3``/``W3`` (``.c`` for a chunk) when ``label`` is a pipeline action, else ``""``."""
    head = label.split(" ")[0]
    return head if len(head) > 1 and head[0] in "FBW" and head[1].isdigit() else ""
