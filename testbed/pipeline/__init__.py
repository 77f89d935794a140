"""Pipeline schedules as tables (GPipe, 1F1B, interleaved, zero bubble) and playing them with per-action costs."""

from testbed.pipeline.schedules import Action, Schedule, build_schedule, schedule_for_plan
from testbed.pipeline.timing import ActionCosts, ScheduleTiming, play

__all__ = ["Action", "Schedule", "build_schedule", "schedule_for_plan", "ActionCosts", "ScheduleTiming", "play"]
