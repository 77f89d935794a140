"""Play a pipeline schedule table with per-action costs: timeline, step time, bubble.

Each stage runs its actions in table order; an action starts when its stage
is free and every dependency has finished (plus ``send`` seconds when the
dependency ran on another stage). Sends are asynchronous: they delay the
receiver, never the sender.

Cost convention: ``forward``, ``backward`` (input gradient) and ``weight``
(weight gradient) are the times of one microbatch through one whole stage
(all its layers). Schedules without a split backward run ``B`` as the full
backward, costing ``backward + weight``. An interleaved stage holds ``v``
chunks, so each chunk action costs ``1/v`` of the stage's time. With these
conventions every schedule does the same work, ``m * (F + B + W)`` per stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from testbed.errors import InputError
from testbed.viz.gantt import Bar
from testbed.pipeline.schedules import Action, Schedule, dependency_keys, execution_order

__all__ = ["ActionCosts", "Interval", "ScheduleTiming", "play", "gantt_bars"]

Cost = float | Sequence[float]


def _per_stage(value: Cost, stages: int, name: str) -> tuple[float, ...]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        values = (float(value),) * stages
    else:
        values = tuple(float(x) for x in value)
        if len(values) != stages:
            raise InputError(f"needs one value per stage ({stages}), got {len(values)}", field=name)
    if any(not x >= 0 for x in values):
        raise InputError(f"times must be >= 0, got {values}", field=name)
    return values


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionCosts:
    """Seconds per microbatch per stage: forward F, input-gradient B, weight-gradient W; send per hop.

    Each of ``forward``, ``backward``, ``weight`` is one number for every
    stage or a sequence with one per stage.
    """

    forward: Cost = 1.0
    backward: Cost = 2.0
    weight: Cost = 0.0
    send: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "weight"):
            _per_stage(getattr(self, name), 1 if isinstance(getattr(self, name), (int, float)) else
                       len(getattr(self, name)), name)
        if not self.send >= 0:
            raise InputError(f"must be >= 0, got {self.send}", field="send")

    def durations(self, schedule: Schedule) -> list[dict[str, float]]:
        """Per stage, seconds of one F, B and W action under ``schedule``'s conventions."""
        p, v = schedule.stages, schedule.virtual
        f = _per_stage(self.forward, p, "forward")
        b = _per_stage(self.backward, p, "backward")
        w = _per_stage(self.weight, p, "weight")
        if schedule.split_backward:
            return [{"F": f[s] / v, "B": b[s] / v, "W": w[s] / v} for s in range(p)]
        return [{"F": f[s] / v, "B": (b[s] + w[s]) / v, "W": 0.0} for s in range(p)]

    def duration(self, schedule: Schedule, stage: int, action: Action) -> float:
        """Seconds ``action`` takes on ``stage`` under ``schedule``'s conventions."""
        return self.durations(schedule)[stage][action.kind]


@dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    """One action on one stage from ``start`` to ``end`` seconds."""

    stage: int
    start: float
    end: float
    action: Action


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleTiming:
    """The played timeline: ``intervals[stage]`` in execution order, step time, bubble."""

    schedule: Schedule
    intervals: tuple[tuple[Interval, ...], ...]
    step_time: float

    @property
    def busy(self) -> tuple[float, ...]:
        """Seconds each stage computes."""
        return tuple(sum(i.end - i.start for i in row) for row in self.intervals)

    @property
    def idle(self) -> tuple[float, ...]:
        """Seconds each stage is idle inside ``[0, step_time]``."""
        return tuple(self.step_time - b for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Idle time of the stages inside the step / (stages x step time)."""
        if self.step_time <= 0:
            return 0.0
        return sum(self.idle) / (self.schedule.stages * self.step_time)

    @property
    def spans(self) -> tuple[float, ...]:
        """Per stage, first start to last end: the iteration period when steps overlap.

        With the optimizer step not synchronising the stages (as the
        zero-bubble paper assumes for ZB-H2), stage ``s`` can begin the next
        step as soon as it is done with this one, so consecutive steps run
        every ``max(spans)`` seconds.
        """
        return tuple((row[-1].end - row[0].start) if row else 0.0 for row in self.intervals)

    @property
    def steady_bubble_fraction(self) -> float:
        """Bubble fraction with the period ``max(spans)`` instead of the step time."""
        period = max(self.spans, default=0.0)
        if period <= 0:
            return 0.0
        return sum(period - b for b in self.busy) / (self.schedule.stages * period)


def play(schedule: Schedule, costs: ActionCosts | None = None) -> ScheduleTiming:
    """Run ``schedule`` as a dependency graph with ``costs``; raises InputError if it deadlocks."""
    costs = costs or ActionCosts()
    durations = costs.durations(schedule)
    end: dict[tuple, float] = {}
    free = [0.0] * schedule.stages
    rows: list[list[Interval]] = [[] for _ in range(schedule.stages)]
    for stage, action in execution_order(schedule):
        start = free[stage]
        for key in dependency_keys(schedule, stage, action.kind, action.microbatch, action.chunk):
            arrive = end[key] + (costs.send if key[0] != stage else 0.0)
            start = max(start, arrive)
        finish = start + durations[stage][action.kind]
        end[(stage, action.kind, action.microbatch, action.chunk)] = finish
        free[stage] = finish
        rows[stage].append(Interval(stage=stage, start=start, end=finish, action=action))
    step = max((r[-1].end for r in rows if r), default=0.0)
    return ScheduleTiming(schedule=schedule, intervals=tuple(tuple(r) for r in rows), step_time=step)


def gantt_bars(timing: ScheduleTiming) -> list[Bar]:
    """One Gantt bar per action: row = stage, label = kind and microbatch (``F3``; ``F3.1`` with chunk 1)."""
    v = timing.schedule.virtual
    return [Bar(row=i.stage, start=i.start, end=i.end, category=i.action.kind,
                label=f"{i.action.kind}{i.action.microbatch}" + (f".{i.action.chunk}" if v > 1 else ""))
            for row in timing.intervals for i in row]
