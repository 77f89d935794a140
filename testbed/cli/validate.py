"""``testbed validate``: the simulator's predicted step time and memory against the runner's.

For each plan, the simulator's step time and memory on the (calibrated)
topology beside the runner's measured median step time (``--rounds``: the
least disturbed round's) and XLA's compiled memory, plus the controller's
CPU time per step both ways, and calibrate's own data-parallel step timed
again (the reference step: has the host drifted since it was calibrated?).

JAX is imported only inside ``execute``, after :func:`runners.devices.prepare`
set the device count.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from testbed.cli.calibrate import parse_devices, progress_bar
from testbed.calibration import steps as cal_steps
from testbed.errors import InputError
from testbed.output import CommandResult
from testbed.topology import Topology

__all__ = ["validate", "validation_summary", "relative_error", "ReferenceStep"]


def _validate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plans", nargs="+", metavar="PLAN", help="plan YAML files (or bundled plan names)")
    parser.add_argument("--topology", required=True, help="calibrated topology (YAML path or bundled name)")
    parser.add_argument("--devices", default=None, help="emulated:N or local (default emulated:<mesh size>)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per plan after one warm-up (default 5)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="time every plan this many times (later rounds in reverse order; each plan compiled "
                             "once) and keep each plan's least disturbed median: for shared hosts (default 5)")


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured; 0 when both are 0, inf when only measured is."""
    if measured == 0:
        return 0.0 if predicted == 0 else math.inf
    return (predicted - measured) / measured


def validation_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ``testbed validate`` JSON object from per-plan rows.

    Each row has ``plan, predicted_s, measured_s, predicted_memory,
    measured_memory`` (memory may be None when XLA does not report it);
    ``error`` and ``memory_error`` are added, and the median / max absolute
    step-time errors summarise them. Rows with ``step_times_s`` also get
    ``error_fastest`` against their fastest step (less disturbed by other
    processes on a shared host), summarised as ``*_abs_error_fastest``; rows
    with ``measured_at_calibrated_speed_s`` get ``error_at_calibrated_speed``
    (``*_abs_error_at_calibrated_speed``): the error left when each round is
    scaled by the host's speed then, as the reference step beside it
    measured it, i.e. without the host's drift since calibration.
    """
    plans = []
    for row in rows:
        out = dict(row)
        out["error"] = relative_error(row["predicted_s"], row["measured_s"])
        pm, mm = row.get("predicted_memory"), row.get("measured_memory")
        out["memory_error"] = relative_error(pm, mm) if pm is not None and mm else None
        if row.get("step_times_s"):
            out["error_fastest"] = relative_error(row["predicted_s"], min(row["step_times_s"]))
        if row.get("measured_at_calibrated_speed_s"):
            out["error_at_calibrated_speed"] = relative_error(row["predicted_s"], row["measured_at_calibrated_speed_s"])
        plans.append(out)
    errors = [abs(p["error"]) for p in plans]
    fastest = [abs(p["error_fastest"]) for p in plans if "error_fastest" in p]
    steady = [abs(p["error_at_calibrated_speed"]) for p in plans if "error_at_calibrated_speed" in p]
    memory = [abs(p["memory_error"]) for p in plans if p["memory_error"] is not None]
    return {
        "plans": plans,
        "median_abs_error": float(np.median(errors)) if errors else 0.0,
        "max_abs_error": float(np.max(errors)) if errors else 0.0,
        "median_abs_memory_error": float(np.median(memory)) if memory else None,
        "max_abs_memory_error": float(np.max(memory)) if memory else None,
        "median_abs_error_fastest": float(np.median(fastest)) if fastest else None,
        "max_abs_error_fastest": float(np.max(fastest)) if fastest else None,
        "median_abs_error_at_calibrated_speed": float(np.median(steady)) if steady else None,
        "max_abs_error_at_calibrated_speed": float(np.max(steady)) if steady else None,
    }


def _validate(args: argparse.Namespace) -> CommandResult:
    from runners import devices as dev
    from testbed.plan.spec import check_plan
    from testbed.plan.io import load_plan
    from testbed.sim.program import TaskKind
    from testbed.sim.engine import controller_seconds, simulate
    from testbed.topology.io import load_topology

    if args.steps < 1:
        raise InputError(f"must be at least 1, got {args.steps}", field="--steps")
    if args.rounds < 1:
        raise InputError(f"must be at least 1, got {args.rounds}", field="--rounds")
    topology = load_topology(args.topology)
    plans = [load_plan(p) for p in args.plans]
    for path, plan in zip(args.plans, plans):
        try:
            check_plan(plan, topology.num_devices, where=f"topology {topology.name}")
        except InputError as exc:
            raise exc.with_file(path) from None
    request = parse_devices(args.devices) if args.devices else parse_devices(f"emulated:{topology.num_devices}")
    dev.prepare(request)
    from runners import measure

    devices = dev.select_devices(topology.num_devices)
    c = topology.calibration
    rows = []
    for path, plan in zip(args.plans, plans):
        sim = simulate(plan, topology)
        report = sim.report
        rows.append({"plan": plan.name, "file": str(path), "predicted_s": report.step_time_s,
                     "predicted_memory": float(report.memory["total"]),
                     # The controller: CPU seconds the dispatching thread spends per step, as the simulation
                     # priced its host tasks, and as measured.
                     "predicted_controller_s": sum(controller_seconds(c, t) for t in sim.program.tasks
                                                   if t.kind is TaskKind.HOST),
                     "round_medians_s": [], "host_speeds": [], "step_times_s": [], "controller_s": []})
    # Each plan's trainer is compiled once and timed in every round (runners.measure.PlanTimer) when all of
    # them fit in a device's memory at once (half of it, by the simulator's estimates); else it is rebuilt per round.
    keep = sum(row["predicted_memory"] for row in rows) <= 0.5 * topology.device.memory_bytes
    timers: dict[int, Any] = {}

    def timer(i: int) -> Any:
        if i not in timers:
            timers[i] = measure.PlanTimer(plans[i], list(devices))
        return timers[i]

    reference_step = ReferenceStep(topology, devices)
    references: list[dict[str, Any]] = []
    with progress_bar() as progress:
        task = progress.add_task("", total=len(plans) * args.rounds)
        for r in range(args.rounds):
            # Later rounds in reverse order: a slow spell of a shared host does not hit the same plans twice.
            order = list(range(len(plans)))[::1 if r % 2 == 0 else -1]
            for i in order:
                progress.update(task, description=f"{plans[i].name} (round {r + 1})")
                median, times, host = timer(i).round(args.steps)
                # The reference step right after the plan: how fast the host ran for this round of the plan.
                references.append(reference_step.time())
                row = rows[i]
                row["round_medians_s"].append(median)
                row["host_speeds"].append(references[-1]["speed"])
                row["step_times_s"] += times
                row["controller_s"] += host
                if r == 0:
                    row["measured_memory"] = timer(i).memory()
                if not keep:
                    del timers[i]
                progress.advance(task)
    reference = dict(min(references, key=lambda ref: ref["measured_s"]),
                     measured_rounds_s=[ref["measured_s"] for ref in references])
    for row in rows:
        # Other load only ever slows a step: the least disturbed round is the best estimate of the plan's own time.
        row["measured_s"] = min(row["round_medians_s"])
        # Each round's median as if the host had run at its calibrated speed (the reference step's speed
        # beside it): the model's error apart from the host's drift since calibration.
        row["measured_at_calibrated_speed_s"] = float(np.median(np.array(row["round_medians_s"])
                                                                * np.array(row["host_speeds"])))
        row["measured_controller_s"] = float(np.median(row.pop("controller_s")))
    data = {"topology": topology.name, "devices": dev.describe(devices), "steps": args.steps, "rounds": args.rounds,
            "reference_step": reference, **validation_summary(rows)}
    return CommandResult(data=data, render=lambda console: _render_validation(console, data))


class ReferenceStep:
    """One of calibrate's own training steps, to time against its prediction: how fast is the host now?

    The data-parallel step of :data:`testbed.calibration.steps.STEP_SHAPES`
    ``cpu-m`` (``acc-m`` on accelerators) over all devices is what
    ``compute_efficiency`` was fitted on, so ``speed = predicted / measured``
    far from 1 says the host's speed has drifted since calibration (other
    load on a shared machine, clock changes) and every plan's error carries
    that drift. Compiled once (runners.measure.PlanTimer); ``validate``
    times it after every plan's round: the host's speed for that round.
    """

    def __init__(self, topology: Topology, devices: Sequence[Any]) -> None:
        from runners import measure
        from testbed.sim.engine import simulate

        plan = cal_steps.step_plan("cpu-m" if devices[0].platform == "cpu" else "acc-m", len(devices))
        self.timer = measure.PlanTimer(plan, list(devices))
        self.predicted_s = simulate(plan, topology).report.step_time_s

    def time(self) -> dict[str, Any]:
        """``{plan, predicted_s, measured_s, speed}``: the median of 5 steps now."""
        measured = self.timer.round(steps=5)[0]
        return {"plan": self.timer.plan.name, "predicted_s": self.predicted_s, "measured_s": measured,
                "speed": self.predicted_s / measured}


def _render_validation(console: Any, data: dict[str, Any]) -> None:
    from rich.table import Table

    from testbed.units import format_bytes, format_time

    rounds = data.get("rounds", 1)
    table = Table(title=f"predicted vs measured on {data['topology']} ({data['devices']['devices']} "
                        f"{data['devices']['platform']} devices, median of {data['steps']} steps"
                        + (f", least of {rounds} rounds)" if rounds > 1 else ")"))
    for col in ("plan", "predicted", "measured", "error", "pred. memory", "XLA memory", "mem. error"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for p in data["plans"]:
        mem = p["measured_memory"]
        table.add_row(p["plan"], format_time(p["predicted_s"]), format_time(p["measured_s"]), f"{p['error']:+.1%}",
                      format_bytes(p["predicted_memory"]), format_bytes(mem) if mem is not None else "-",
                      f"{p['memory_error']:+.1%}" if p["memory_error"] is not None else "-")
    console.print(table)
    console.print(f"step time |error|: median {data['median_abs_error']:.1%}, max {data['max_abs_error']:.1%}")
    ref = data.get("reference_step")
    if ref:
        console.print(f"reference step ({ref['plan']} over all devices, as calibrated): predicted "
                      f"{format_time(ref['predicted_s'])}, measured {format_time(ref['measured_s'])} (least "
                      f"disturbed of {len(ref['measured_rounds_s'])}): the host runs at {ref['speed']:.2f}x its "
                      f"calibrated speed")
    if data.get("median_abs_error_at_calibrated_speed") is not None:
        console.print(f"step time |error| at the calibrated host speed (each round scaled by the reference step's "
                      f"speed beside it): median {data['median_abs_error_at_calibrated_speed']:.1%}, "
                      f"max {data['max_abs_error_at_calibrated_speed']:.1%}")
    if data.get("median_abs_memory_error") is not None:
        console.print(f"memory |error|: median {data['median_abs_memory_error']:.1%}, "
                      f"max {data['max_abs_memory_error']:.1%}")


validate = SimpleNamespace(add_arguments=_validate_arguments, execute=_validate)
