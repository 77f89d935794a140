"""Predicted against measured: relative errors, field by field, and the ``testbed validate`` summary (pure; no JAX).

:func:`compare_reports` compares two :class:`~testbed.sim.report.timeline.Report`
(the simulator's prediction and a runner's measurement) field by field;
:func:`validation_summary` builds validate's JSON from per-plan rows with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from testbed.sim.report.timeline import Report

__all__ = ["relative_error", "compare_reports", "REPORT_FIELDS", "validation_summary", "collective_rows"]

#: Fields :func:`compare_reports` compares (``memory``: the ``total`` bytes per device).
REPORT_FIELDS: tuple[str, ...] = ("step_time_s", "compute_s", "exposed_comm_s", "bubble_fraction", "mfu", "memory")


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured; 0 when both are 0, inf when only measured is."""
    if measured == 0:
        return 0.0 if predicted == 0 else math.inf
    return (predicted - measured) / measured


def _field(report: Report, name: str) -> float | None:
    return report.memory_total if name == "memory" else getattr(report, name)


def compare_reports(predicted: Report, measured: Report) -> dict[str, float | None]:
    """Per field of :data:`REPORT_FIELDS`, the signed :func:`relative_error` of ``predicted`` against ``measured``.

    None where either side does not know the field (a measurement leaves
    compute, exposed communication and bubble unknown; MFU without a peak;
    memory unless XLA reported it) or where the error is undefined (a
    measured 0 against a non-zero prediction), so the result is strict JSON.
    Raises ValueError when both reports name different plans.
    """
    if predicted.plan and measured.plan and predicted.plan != measured.plan:
        raise ValueError(f"reports of different plans: {predicted.plan!r} and {measured.plan!r}")
    out: dict[str, float | None] = {}
    for name in REPORT_FIELDS:
        p, m = _field(predicted, name), _field(measured, name)
        error = None if p is None or m is None else relative_error(p, m)
        out[name] = error if error is not None and math.isfinite(error) else None
    return out


def _reports(row: Mapping[str, Any]) -> tuple[Report, Report]:
    """The row's predicted and measured Reports; rows without them are built from their numbers."""
    predicted, measured = row.get("predicted_report"), row.get("measured_report")
    if isinstance(predicted, Report) and isinstance(measured, Report):
        return predicted, measured
    pm, mm = row.get("predicted_memory"), row.get("measured_memory")
    common = {"compute_s": None, "exposed_comm_s": None, "bubble_fraction": None, "mfu": None,
              "plan": str(row.get("plan", ""))}
    return (Report(step_time_s=row["predicted_s"], memory={} if pm is None else {"total": pm}, **common),
            Report(step_time_s=row["measured_s"], memory={} if mm is None else {"total": mm}, source="measured",
                   **common))


def _median_max(values: list[float]) -> tuple[float | None, float | None]:
    return (float(np.median(values)), float(np.max(values))) if values else (None, None)


def validation_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ``testbed validate`` JSON object from per-plan rows.

    Each row has ``plan, predicted_s, measured_s, predicted_memory,
    measured_memory`` (memory may be None when XLA does not report it) and,
    from :func:`testbed.runner.validate.measure_plans`, the ``predicted_report`` and
    ``measured_report`` (:class:`Report`; built from the numbers when
    absent). :func:`compare_reports` compares them: its errors go in
    ``errors``, the step time's is ``error`` and the memory's
    ``memory_error``; the reports are written as dicts. The headline is the
    median / max absolute step-time and memory errors. Rows with
    ``step_times_s`` also get ``error_fastest`` against their fastest step
    (less disturbed by other processes on a shared host), summarised as
    ``*_abs_error_fastest``.

    ``diagnostics`` (host drift, not the model's accuracy): rows whose
    ``diagnostics`` hold ``measured_at_calibrated_speed_s`` get
    ``diagnostics.error_at_calibrated_speed``, summarised in the top-level
    ``diagnostics`` as ``*_abs_error_at_calibrated_speed``: the error left
    when each round is scaled by the host's speed then (the reference step
    beside it), i.e. without the host's drift since calibration.
    """
    plans = []
    for row in rows:
        out = dict(row)
        predicted, measured = _reports(row)
        errors = compare_reports(predicted, measured)
        out.update(predicted_report=predicted.to_dict(), measured_report=measured.to_dict(), errors=errors,
                   error=errors["step_time_s"], memory_error=errors["memory"])
        if row.get("step_times_s"):
            out["error_fastest"] = relative_error(predicted.step_time_s, min(row["step_times_s"]))
        diagnostics = dict(row.get("diagnostics") or {})
        if diagnostics.get("measured_at_calibrated_speed_s"):
            diagnostics["error_at_calibrated_speed"] = relative_error(predicted.step_time_s,
                                                                      diagnostics["measured_at_calibrated_speed_s"])
        if diagnostics:
            out["diagnostics"] = diagnostics
        plans.append(out)
    errors = [abs(p["error"]) for p in plans if p["error"] is not None]
    fastest = [abs(p["error_fastest"]) for p in plans if "error_fastest" in p]
    steady = [abs(p["diagnostics"]["error_at_calibrated_speed"]) for p in plans
              if "error_at_calibrated_speed" in p.get("diagnostics", {})]
    memory = [abs(p["memory_error"]) for p in plans if p["memory_error"] is not None]
    median_error, max_error = _median_max(errors)
    median_memory, max_memory = _median_max(memory)
    median_fastest, max_fastest = _median_max(fastest)
    median_steady, max_steady = _median_max(steady)
    return {
        "plans": plans,
        "median_abs_error": median_error if errors else 0.0,
        "max_abs_error": max_error if errors else 0.0,
        "median_abs_memory_error": median_memory,
        "max_abs_memory_error": max_memory,
        "median_abs_error_fastest": median_fastest,
        "max_abs_error_fastest": max_fastest,
        "diagnostics": {"median_abs_error_at_calibrated_speed": median_steady,
                        "max_abs_error_at_calibrated_speed": max_steady},
    }


def collective_rows(predicted: Mapping[str, Mapping[str, float]],
                    compiled: Mapping[str, Mapping[str, float]]) -> list[dict[str, Any]]:
    """Per mesh axes and kind (``{axes: {kind: bytes}}`` both sides, per device per step): the predicted and the
    compiled program's bytes side by side (0 where a side has none), sorted; ``equal`` where they match."""
    keys = sorted({(a, k) for side in (predicted, compiled) for a, kinds in side.items() for k in kinds})
    rows = []
    for axes, kind in keys:
        p, c = float(predicted.get(axes, {}).get(kind, 0.0)), float(compiled.get(axes, {}).get(kind, 0.0))
        rows.append({"axes": axes, "kind": kind, "predicted_bytes": p, "compiled_bytes": c, "equal": p == c})
    return rows
