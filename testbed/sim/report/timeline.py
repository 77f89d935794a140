"""Timeline and Report: what one training step did, predicted or measured.

A :class:`Timeline` holds the spans (start, end, label, category) of one step
on *representative* streams: identical data replicas and tensor ranks execute
identical tasks, so the simulator times one device per class and records in
``representative`` which class every device belongs to. Traces expand the
classes lazily, so a 4096-device timeline stays small until it is written.
A runner uses the same types with ``source="measured"``
(:mod:`testbed.sim.report.measured`): its timeline has one span per timed step on
device 0's ``compute`` stream, which every device repeats (the host times
whole steps of all devices at once), and its :class:`Report` leaves what it
did not measure as None; predictions and measurements then compare field by
field (:func:`testbed.calibration.validation.compare_reports`) and write the
same traces (:func:`testbed.sim.report.trace_files.write_trace`).

Categories are ``compute``, ``comm``, ``bubble`` (idle stage time inside
the pipeline phase) and ``host`` (the controller dispatching programs). Traces and Gantt charts of a
timeline: :mod:`testbed.sim.report.trace_files`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["CATEGORIES", "REPORT_OPTIONAL", "Span", "Timeline", "Report"]

#: Span categories, in the order of :attr:`Timeline.category` codes.
CATEGORIES: tuple[str, ...] = ("compute", "comm", "bubble", "host")


@dataclass(frozen=True, slots=True)
class Span:
    """One interval on one stream of one device."""

    device: int
    stream: str
    start: float
    end: float
    label: str
    category: str

    @property
    def duration(self) -> float:
        return self.end - self.start


def _union_length(starts: np.ndarray, ends: np.ndarray, lo: float, hi: float) -> float:
    """Length of the union of intervals clipped to [lo, hi]."""
    if starts.size == 0 or hi <= lo:
        return 0.0
    s = np.clip(starts, lo, hi)
    e = np.clip(ends, lo, hi)
    order = np.argsort(s, kind="stable")
    total, cur_s, cur_e = 0.0, None, None
    for a, b in zip(s[order].tolist(), e[order].tolist()):
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = a, b
        elif b > cur_e:
            cur_e = b
    if cur_e is not None:
        total += cur_e - cur_s
    return total


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    """Spans of one step on representative (device, stream) rows.

    Args:
        rows: ``(representative device, stream name)`` of each row.
        row, start, end, category: one entry per span (category indexes CATEGORIES).
        label: one text per span.
        representative: for every device id, the representative device whose rows it repeats.
        step_time_s: end of the step (the last span may end earlier for measured steps).
        pipeline_end_s: end of the pipeline phase (last forward/backward), for the bubble
            (default: the step time).
        source: ``predicted`` or ``measured``.
    """

    rows: tuple[tuple[int, str], ...]
    row: np.ndarray
    start: np.ndarray
    end: np.ndarray
    category: np.ndarray
    label: tuple[str, ...]
    representative: np.ndarray
    step_time_s: float
    pipeline_end_s: float | None = None
    source: str = "predicted"
    _by_device: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.label)
        for name, dtype in (("row", np.int64), ("start", np.float64), ("end", np.float64), ("category", np.int8)):
            arr = np.asarray(getattr(self, name), dtype=dtype)
            if arr.shape != (n,):
                raise ValueError(f"{name} must have one entry per span ({n}), got shape {arr.shape}")
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        rep = np.asarray(self.representative, dtype=np.int64)
        rep.setflags(write=False)
        object.__setattr__(self, "representative", rep)
        object.__setattr__(self, "rows", tuple((int(d), str(s)) for d, s in self.rows))
        if self.source not in ("predicted", "measured"):
            raise ValueError(f"source must be `predicted` or `measured`, got {self.source!r}")
        if n and (np.any(self.end < self.start) or self.row.min() < 0 or self.row.max() >= len(self.rows)):
            raise ValueError("spans need end >= start and a valid row")
        object.__setattr__(self, "_by_device", {})
        if self.pipeline_end_s is None:
            object.__setattr__(self, "pipeline_end_s", float(self.step_time_s))

    @property
    def num_devices(self) -> int:
        return int(self.representative.size)

    @property
    def representatives(self) -> tuple[int, ...]:
        """Representative devices, in row order."""
        return tuple(dict.fromkeys(d for d, _ in self.rows))

    def streams(self, device: int) -> tuple[str, ...]:
        """Stream names of ``device`` (those of its representative)."""
        rep = int(self.representative[device])
        return tuple(s for d, s in self.rows if d == rep)

    def _indices(self, device: int) -> np.ndarray:
        rep = int(self.representative[device])
        cached = self._by_device.get(rep)
        if cached is None:
            rows = np.array([i for i, (d, _) in enumerate(self.rows) if d == rep], dtype=np.int64)
            cached = np.flatnonzero(np.isin(self.row, rows))
            self._by_device[rep] = cached
        return cached

    def spans(self, device: int) -> Iterator[Span]:
        """Spans of ``device`` (its representative's, relabelled with its id)."""
        for i in self._indices(device).tolist():
            yield Span(device, self.rows[self.row[i]][1], float(self.start[i]), float(self.end[i]),
                       self.label[i], CATEGORIES[self.category[i]])

    def busy(self, device: int, category: str, until: float | None = None) -> float:
        """Time ``device`` spends in ``category`` spans (their union), up to ``until``."""
        idx = self._indices(device)
        code = CATEGORIES.index(category)
        idx = idx[self.category[idx] == code]
        hi = self.step_time_s if until is None else until
        return _union_length(self.start[idx], self.end[idx], 0.0, hi)

    def active(self, device: int, until: float | None = None) -> float:
        """Time ``device`` has any compute or comm span running, up to ``until``."""
        idx = self._indices(device)
        idx = idx[np.isin(self.category[idx], [CATEGORIES.index("compute"), CATEGORIES.index("comm")])]
        hi = self.step_time_s if until is None else until
        return _union_length(self.start[idx], self.end[idx], 0.0, hi)

    def exposed_comm(self, device: int) -> float:
        """Time ``device`` communicates while computing nothing."""
        return self.active(device) - self.busy(device, "compute")

    def busiest(self) -> int:
        """The representative with the most compute (ties: the most exposed communication)."""
        reps = self.representatives
        if not reps:
            return 0
        return max(reps, key=lambda d: (round(self.busy(d, "compute"), 15), self.exposed_comm(d)))

    def compute_s(self) -> float:
        """Busy compute time of the busiest device."""
        return self.busy(self.busiest(), "compute") if self.representatives else 0.0

    def exposed_comm_s(self) -> float:
        """Exposed communication of the busiest device (so compute + exposed comm <= step time)."""
        return self.exposed_comm(self.busiest()) if self.representatives else 0.0

    def bubble_fraction(self) -> float:
        """Bubble spans / (stages x pipeline phase).

        A bubble span is time inside the pipeline phase (step start to the
        last forward/backward) when a stage runs none of its schedule's
        actions; each representative is one stage's class of devices. The
        trailing gradient sync and optimizer are not pipeline bubble.
        """
        reps, phase = self.representatives, self.pipeline_end_s
        if not reps or phase <= 0:
            return 0.0
        mask = self.category == CATEGORIES.index("bubble")
        idle = float(np.sum(np.minimum(self.end[mask], phase) - np.minimum(self.start[mask], phase)))
        return max(0.0, idle / (len(reps) * phase))


#: Report fields a runner may leave unknown (None): it times whole steps, not their parts.
REPORT_OPTIONAL: tuple[str, ...] = ("compute_s", "exposed_comm_s", "bubble_fraction", "mfu")


def _finite(name: str, value: Any, optional: bool) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"Report.{name} must be a number{' or None' if optional else ''}, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"Report.{name} must be finite and >= 0, got {value}")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """Summary of one step, predicted by the simulator or measured by a runner (``source``).

    Both sides use this one type so they compare field by field
    (:func:`testbed.calibration.validation.compare_reports`). A measurement
    is honest about what it does not know:

    - ``step_time_s``: predicted, the simulated step; measured, the median of
      the timed steps (always known);
    - ``compute_s``, ``exposed_comm_s``, ``bubble_fraction``: the simulator's
      busiest device; None when measured (a runner times whole steps, not
      the compute and communication inside them);
    - ``mfu``: model FLOPs / (devices x peak x step time); None when the
      runner does not know the device's peak FLOP/s (e.g. CPU devices);
    - ``memory``: predicted, the memory breakdown (bytes per device,
      ``total`` among them); measured, ``{"total": XLA's compiled bytes per
      device}`` when they were measured, else empty;
    - ``tasks``: the simulated task graph's size; 0 for measurements.

    Every number is finite and non-negative, so :meth:`to_dict` is strict
    JSON (None where unknown, never NaN or inf).
    """

    step_time_s: float
    compute_s: float | None
    exposed_comm_s: float | None
    bubble_fraction: float | None
    mfu: float | None
    memory: Mapping[str, Any] = field(default_factory=dict)
    plan: str = ""
    topology: str = ""
    devices: int = 0
    tasks: int = 0
    source: str = "predicted"

    def __post_init__(self) -> None:
        if self.source not in ("predicted", "measured"):
            raise ValueError(f"source must be `predicted` or `measured`, got {self.source!r}")
        object.__setattr__(self, "step_time_s", _finite("step_time_s", self.step_time_s, optional=False))
        for name in REPORT_OPTIONAL:
            object.__setattr__(self, name, _finite(name, getattr(self, name), optional=True))
        memory = dict(self.memory)
        for key, value in memory.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"Report.memory[{key!r}] must be finite, got {value}")
        object.__setattr__(self, "memory", memory)

    @property
    def memory_total(self) -> float | None:
        """Bytes per device (``memory["total"]``), or None when not known."""
        total = self.memory.get("total")
        return None if total is None else float(total)

    def to_dict(self) -> dict[str, Any]:
        """The JSON keys of `testbed simulate` (DESIGN.md contract) plus context; None where unknown."""
        return {"step_time_s": self.step_time_s, "compute_s": self.compute_s, "exposed_comm_s": self.exposed_comm_s,
                "bubble_fraction": self.bubble_fraction, "mfu": self.mfu, "memory": dict(self.memory),
                "plan": self.plan, "topology": self.topology, "devices": self.devices, "tasks": self.tasks,
                "source": self.source}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Report:
        """The inverse of :meth:`to_dict` (results passed between processes as JSON)."""
        return cls(step_time_s=data["step_time_s"], compute_s=data.get("compute_s"),
                   exposed_comm_s=data.get("exposed_comm_s"), bubble_fraction=data.get("bubble_fraction"),
                   mfu=data.get("mfu"), memory=data.get("memory") or {}, plan=data.get("plan", ""),
                   topology=data.get("topology", ""), devices=int(data.get("devices", 0)),
                   tasks=int(data.get("tasks", 0)), source=data.get("source", "predicted"))
