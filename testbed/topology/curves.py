"""The shapes of the shared host's measured curves (testbed.topology.calibration.HostCalibration): a piecewise-linear
curve of ``(n, value)`` points, and how a straggler's lag grows with the time devices computed since they last met.

Pure functions of plain numbers, shared by the calibration group that prices them and by the fit that fits them
(testbed.calibration.host.fit_host_skew), so both use one shape.
"""

from __future__ import annotations

import math

__all__ = ["skew_growth", "interpolate"]


def skew_growth(seconds: float, onset: float, saturation: float) -> float:
    """A straggler's lag after ``seconds`` of computing, per ``sqrt(skew_s)``: ``sqrt(min(t, saturation)) *
    min(1, sqrt(t / onset))`` (0 for either: no limit). The one shape :meth:`HostCalibration.barrier_wait`
    prices and testbed.calibration.host.fit_host_skew fits."""
    if seconds <= 0:
        return 0.0
    grown = min(seconds, saturation) if saturation > 0 else seconds
    return math.sqrt(grown) * (min(1.0, math.sqrt(seconds / onset)) if onset > 0 else 1.0)


def interpolate(curve: tuple[tuple[int, float], ...], x: float, default: float) -> float:
    """A piecewise-linear curve of ``(n, value)`` points at ``x``: flat after its last point; ``default`` when empty."""
    if not curve or x <= curve[0][0]:
        return curve[0][1] if curve else default
    for (n0, v0), (n1, v1) in zip(curve, curve[1:]):
        if x <= n1:
            return v0 + (v1 - v0) * (x - n0) / (n1 - n0)
    return curve[-1][1]
