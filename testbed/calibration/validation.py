"""Predicted against measured: relative errors and the ``testbed validate`` summary (pure; no JAX)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["relative_error", "validation_summary"]


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
