"""Time plans beside their predictions: what ``testbed validate`` measures.

Each plan's trainer is compiled once (:class:`testbed.runner.step_timer.PlanTimer`) and
timed in ``rounds`` rounds (later rounds in reverse order), and after every
round of a plan the reference step (:class:`ReferenceStep`) is timed too: the
host's speed for that round: a diagnostic of host drift, kept apart from the
headline. Each plan's prediction and measurement are the simulator's
:class:`~testbed.sim.report.timeline.Report` (``source`` predicted / measured); the
summary, :func:`testbed.calibration.validation.validation_summary`, compares
them field by field.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from testbed.runner.step_timer import PlanTimer
from testbed.calibration import steps as cal_steps
from testbed.plan.spec import Plan
from testbed.sim.graph.engine import controller_seconds, simulate
from testbed.sim.report.measured import measured_report
from testbed.sim.graph.program import TaskKind
from testbed.topology import Topology

__all__ = ["measure_plans", "ReferenceStep"]


def measure_plans(topology: Topology, plans: Sequence[Plan], paths: Sequence[str], devices: Sequence[Any], *,
                  steps: int, rounds: int,
                  progress: Callable[[str, int], None] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per plan, the predicted and measured Reports (step time, memory, MFU) and controller time; the reference step.

    Returns ``(rows, reference)``: the rows :func:`validation_summary` reads,
    and the least disturbed reference timing with every round's. A row has
    ``predicted_report`` (the simulator's :class:`~testbed.sim.report.timeline.Report`)
    and ``measured_report`` (``source="measured"``: the least disturbed
    round's median step, XLA's memory, MFU at the topology's peak), their
    numbers as ``predicted_s``, ``measured_s``, ``predicted_memory``,
    ``measured_memory``, every round's median and step; and under
    ``diagnostics`` the host's speed per round and
    ``measured_at_calibrated_speed_s`` (host drift, not model accuracy).
    ``progress(description, rounds done)`` is called before each plan's round.
    """
    rows = [_predicted_row(topology, plan, path) for path, plan in zip(paths, plans)]
    # Each plan's trainer is compiled once and timed in every round (testbed.runner.step_timer.PlanTimer) when all of
    # them fit in a device's memory at once (half of it, by the simulator's estimates); else it is rebuilt per round.
    keep = sum(row["predicted_memory"] for row in rows) <= 0.5 * topology.device.memory_bytes
    timers: dict[int, Any] = {}

    def timer(i: int) -> Any:
        if i not in timers:
            timers[i] = PlanTimer(plans[i], list(devices))
        return timers[i]

    reference_step = ReferenceStep(topology, devices)
    references: list[dict[str, Any]] = []
    for r in range(rounds):
        # Later rounds in reverse order: a slow spell of a shared host does not hit the same plans twice.
        order = list(range(len(plans)))[::1 if r % 2 == 0 else -1]
        for k, i in enumerate(order):
            if progress is not None:
                progress(f"{plans[i].name} (round {r + 1})", r * len(plans) + k)
            median, times, host = timer(i).round(steps)
            # The reference step right after the plan: how fast the host ran for this round of the plan.
            references.append(reference_step.time())
            row = rows[i]
            row["round_medians_s"].append(median)
            row["diagnostics"]["host_speeds"].append(references[-1]["speed"])
            row["step_times_s"] += times
            row["controller_s"] += host
            if r == 0:
                row["measured_memory"] = timer(i).memory()
            if not keep:
                del timers[i]
    reference = dict(min(references, key=lambda ref: ref["measured_s"]),
                     measured_rounds_s=[ref["measured_s"] for ref in references])
    for plan, row in zip(plans, rows):
        _finish_row(topology, plan, row, len(devices))
    return rows, reference


def _predicted_row(topology: Topology, plan: Plan, path: str) -> dict[str, Any]:
    """A plan's row before it is measured: its simulated Report and the controller's CPU seconds per step, as the
    simulation priced its host tasks."""
    sim = simulate(plan, topology)
    report = sim.report
    return {"plan": plan.name, "file": str(path), "predicted_report": report,
            "predicted_s": report.step_time_s,
            "predicted_memory": float(report.memory["total"]),
            "predicted_controller_s": sum(controller_seconds(topology.calibration, t) for t in sim.program.tasks
                                          if t.kind is TaskKind.HOST),
            "round_medians_s": [], "step_times_s": [], "controller_s": [],
            "diagnostics": {"host_speeds": []}}


def _finish_row(topology: Topology, plan: Plan, row: dict[str, Any], devices: int) -> None:
    """A measured row's summary: the least disturbed round (other load only ever slows a step) as its measured
    Report at the prediction's peak, and, as a diagnostic of the host, each round's median as if the host had
    run at its calibrated speed."""
    row["measured_s"] = min(row["round_medians_s"])
    peak = topology.device.flops(plan.precision.compute_dtype)  # the prediction's peak: MFUs compare
    row["measured_report"] = measured_report(plan, row["measured_s"], devices=devices, peak_flops=peak,
                                             memory_bytes=row.get("measured_memory"), topology=topology.name)
    diagnostics = row["diagnostics"]
    diagnostics["measured_at_calibrated_speed_s"] = float(np.median(np.array(row["round_medians_s"])
                                                                    * np.array(diagnostics["host_speeds"])))
    row["measured_controller_s"] = float(np.median(row.pop("controller_s")))


class ReferenceStep:
    """One of calibrate's own training steps, to time against its prediction: how fast is the host now?

    The data-parallel step of :data:`testbed.calibration.steps.STEP_SHAPES`
    ``cpu-m`` (``acc-m`` on accelerators) over all devices is what
    ``compute_efficiency`` was fitted on, so ``speed = predicted / measured``
    far from 1 says the host's speed has drifted since calibration (other
    load on a shared machine, clock changes) and every plan's error carries
    that drift. Compiled once (testbed.runner.step_timer.PlanTimer); ``validate``
    times it after every plan's round: the host's speed for that round.
    """

    def __init__(self, topology: Topology, devices: Sequence[Any]) -> None:
        plan = cal_steps.step_plan("cpu-m" if devices[0].platform == "cpu" else "acc-m", len(devices))
        self.timer = PlanTimer(plan, list(devices))
        self.predicted_s = simulate(plan, topology).report.step_time_s

    def time(self) -> dict[str, Any]:
        """``{plan, predicted_s, measured_s, speed}``: the median of 5 steps now."""
        measured = self.timer.round(steps=5)[0]
        return {"plan": self.timer.plan.name, "predicted_s": self.predicted_s, "measured_s": measured,
                "speed": self.predicted_s / measured}
