"""Fitting a topology's calibration groups from microbenchmark tables.

``testbed.runner.measure`` times matmuls, memory streams, empty programs and
collectives on real (or emulated) devices and returns :class:`Sample` rows;
this module turns those rows into calibration fields (``GROUP.FIELD``,
testbed.topology.calibration) with (non-negative, relative-error weighted)
least squares, numpy only:

- dispatch: ``compute.launch_overhead_s`` is the median time of an empty program;
- compute: a kernel of ``f`` FLOPs takes ``launch + (f + half) / R`` (the
  simulator's ``eff(f) = eff_max * f / (f + half)``, ``R = peak * eff_max``),
  a line in ``f`` per dtype; training steps of small models then refit
  ``eff_max`` and ``half`` (``compute.efficiency``,
  ``compute.efficiency_half_flops``) on the model's own kernels
  (:func:`testbed.calibration.steps.fit_step_compute`);
- memory: a stream of ``b`` bytes takes ``launch + b / (bandwidth * eff)``
  (``memory.efficiency``); a transposing pass over ``b`` bytes ``c + b / (bandwidth * transpose_efficiency)``
  (``memory.transpose_efficiency``, :func:`fit_transpose`);
- host: :mod:`testbed.calibration.host` (``k`` devices at once vs one alone: the ``host`` group);
- collectives: :mod:`testbed.calibration.collectives`.

Everything here is pure; :func:`testbed.calibration.calibrated.calibrated_topology` builds the new Topology.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from testbed.errors import InputError
from testbed.fields import MAX_DEVICES, check_keys, expect_mapping, get_float, get_int, get_str

__all__ = [
    "Sample", "Fit", "SAMPLE_KINDS", "nonnegative_lstsq", "fit_quality", "fit_line", "weighted_fit", "of_kind",
    "fit_dispatch", "fit_compute", "fit_memory", "fit_transpose", "BARRIER_COLLECTIVES", "samples_to_rows",
    "samples_from_rows",
]

#: Kinds of measurement rows: an empty program, a matmul on one device (square, or a ``gemm`` of any shape), a small
#: MLP training step on ``devices`` devices at once, a memory stream, a
#: collective, a data-parallel training step of a model, a pipeline (MPMD)
#: training step of a model.
SAMPLE_KINDS = ("dispatch", "matmul", "gemm", "concurrent", "programs", "launches", "barriers", "memory", "transpose",
                "collective", "step", "pipeline")
#: Collectives in a ``barriers`` sample's chain (one between each two of its matmuls).
BARRIER_COLLECTIVES = 24


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One measured row: median ``seconds`` of a microbenchmark.

    flops: FLOPs of one kernel on one device (matmul kinds).
    bytes: bytes read + written (memory) or the collective's buffer (DESIGN.md convention).
    devices: how many devices ran it at once (``concurrent``: 1, or all of them).
    op / ranks: the collective and its group size (consecutive device ids);
        for a ``step`` or ``pipeline`` (one training step of a plan) ``op``
        names the plan (testbed.calibration.steps); for a ``dispatch``,
        ``ranks`` is the arrays the program takes (and returns).
    host_s: CPU seconds the controller thread spent dispatching one step
        (``step`` and ``pipeline`` samples) or one program (``dispatch``);
        0 if not measured.
    alone_s: ``concurrent`` on several devices: the same per-device program
        on one device, timed in the same rounds (alternating), as
        ``seconds`` times the median over rounds of alone / at once: the
        ratio is what the host's throughput curve needs, and timing both
        side by side keeps the host's drift out of it. 0: not measured (the
        one-device ``concurrent`` sample is used instead). ``programs``: the
        same per-device work as ONE program over all ``devices``, timed in the
        same rounds, against ``seconds``: it run as ``ranks`` one-device
        programs at once (testbed.runner.host_sharing). ``launches``: when the first
        of its two programs over ``ranks`` devices each completed, ``seconds``
        when both had. ``barriers``: the chain without its collectives, timed
        in the same rounds.
    count: ``barriers``: how many times the chain's groups meet (0:
        :data:`BARRIER_COLLECTIVES`).
    m, n, k: a ``gemm``'s shape, an ``m x k`` by ``k x n`` product (0 for other kinds).
    """

    kind: str
    seconds: float
    flops: float = 0.0
    bytes: float = 0.0
    dtype: str = "fp32"
    devices: int = 1
    op: str = ""
    ranks: int = 1
    host_s: float = 0.0
    alone_s: float = 0.0
    count: int = 0
    m: int = 0
    n: int = 0
    k: int = 0

    def __post_init__(self) -> None:
        if self.kind not in SAMPLE_KINDS:
            raise InputError(f"unknown sample kind `{self.kind}`; valid: {', '.join(SAMPLE_KINDS)}", field="kind")
        if not (self.seconds > 0 and math.isfinite(self.seconds)):
            raise InputError(f"must be a positive finite time, got {self.seconds}", field="seconds")
        if (self.flops < 0 or self.bytes < 0 or self.host_s < 0 or self.alone_s < 0 or self.devices < 1
                or self.ranks < 1 or self.count < 0 or min(self.m, self.n, self.k) < 0):
            raise InputError("flops, bytes and count must be non-negative, devices and ranks positive", field=self.kind)


@dataclass(frozen=True, slots=True, kw_only=True)
class Fit:
    """Fitted coefficients (named) and how well they explain the samples.

    r2: coefficient of determination of the fitted times; rel_residuals:
    (predicted - measured) / measured per sample, in sample order.
    """

    name: str
    values: Mapping[str, float]
    r2: float
    rel_residuals: tuple[float, ...] = ()
    samples: int = 0

    median_abs_rel = property(lambda self: float(np.median(np.abs(self.rel_residuals or (0.0,)))))
    max_abs_rel = property(lambda self: float(np.max(np.abs(self.rel_residuals or (0.0,)))))

    def summary(self) -> dict[str, Any]:
        return {"values": dict(self.values), "r2": self.r2, "median_abs_rel_residual": self.median_abs_rel,
                "max_abs_rel_residual": self.max_abs_rel, "samples": self.samples}


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson-Hanson active set, small problems).

    Columns that are all zero get coefficient 0. Rank-deficient passive sets
    use the minimum-norm solution of numpy.linalg.lstsq.
    """
    b = np.asarray(b, dtype=float)
    # Unit-norm columns: coefficients of very different scales (seconds vs seconds per byte).
    norms = np.linalg.norm(np.asarray(a, dtype=float), axis=0)
    usable = norms > 0
    a = np.asarray(a, dtype=float) / np.where(usable, norms, 1.0)
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 1e-12 * max(float(np.linalg.norm(b)), 1e-300)
    for _ in range(3 * n + 3):
        gradient = a.T @ (b - a @ x)
        candidates = np.where(~passive & usable & (gradient > tol))[0]
        if candidates.size == 0:
            break
        passive[candidates[np.argmax(gradient[candidates])]] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if np.all(z[passive] > 0):
                x = z
                break
            bad = passive & (z <= 0)
            alpha = np.min(x[bad] / np.maximum(x[bad] - z[bad], 1e-300))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
            if not passive.any():
                break
    return x / np.where(usable, norms, 1.0)


def fit_quality(predicted: Sequence[float], measured: Sequence[float]) -> tuple[float, tuple[float, ...]]:
    """(R^2, relative residuals) of predicted vs measured times."""
    p = np.asarray(predicted, dtype=float)
    m = np.asarray(measured, dtype=float)
    total = float(np.sum((m - m.mean()) ** 2))
    r2 = 1.0 - float(np.sum((p - m) ** 2)) / total if total > 0 else 1.0
    return r2, tuple(float(v) for v in (p - m) / m)


def weighted_fit(columns: np.ndarray, y: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
    """Non-negative least squares on relative errors (each row divided by ``scale``, default y)."""
    w = 1.0 / (y if scale is None else scale)
    return nonnegative_lstsq(columns * w[:, None], y * w)


def fit_line(x: Sequence[float], y: Sequence[float], name: str = "line",
             scale: Sequence[float] | None = None) -> Fit:
    """y = intercept + slope * x, both non-negative, minimising residuals relative to ``scale`` (default y)."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if len(x) < 2 or len(set(x.tolist())) < 2:
        raise InputError("a line needs samples at two or more distinct sizes", field=name)
    coef = weighted_fit(np.column_stack([np.ones_like(x), x]), y, None if scale is None else np.asarray(scale, float))
    r2, residuals = fit_quality(coef[0] + coef[1] * x, y)
    return Fit(name=name, values={"intercept": float(coef[0]), "slope": float(coef[1])}, r2=r2,
               rel_residuals=residuals, samples=len(x))


def of_kind(samples: Sequence[Sample], kind: str) -> list[Sample]:
    """The samples of one kind (:data:`SAMPLE_KINDS`), in order."""
    return [s for s in samples if s.kind == kind]


def fit_dispatch(samples: Sequence[Sample]) -> float:
    """Per-program launch overhead: median of the one-array empty-program samples (on 1, N/2, N devices; 0 if none)."""
    times = [s.seconds for s in of_kind(samples, "dispatch") if s.ranks == 1]
    return float(np.median(times)) if times else 0.0


def _rate_line(rows: Sequence[Sample], size: str, launch_s: float, name: str) -> tuple[float, float, Fit]:
    """(rate, intercept, fit) of ``t = launch + intercept + size / rate`` over ``rows``."""
    x = np.array([getattr(r, size) for r in rows])
    t = np.array([r.seconds for r in rows])
    line = fit_line(x, t - launch_s, name=name, scale=t)
    if not line.values["slope"] > 0:
        raise InputError(f"{name} times do not grow with size; measure larger sizes", field=name)
    rate, intercept = 1.0 / line.values["slope"], line.values["intercept"]
    r2, residuals = fit_quality(launch_s + intercept + x / rate, t)
    return rate, intercept, Fit(name=name, values={f"{size}_per_s": rate, "half": intercept * rate}, r2=r2,
                                rel_residuals=residuals, samples=len(rows))


def fit_compute(samples: Sequence[Sample], launch_s: float) -> tuple[dict[str, float], float, list[Fit]]:
    """Sustained FLOP/s per dtype and the half-efficiency kernel size.

    Per dtype, ``t - launch = (f + half) / R`` is a line in ``f`` with slope
    ``1/R`` and intercept ``half / R``. Returns ({dtype: R}, half, fits); half
    is the median over dtypes (Calibration has one).
    """
    by_dtype: dict[str, list[Sample]] = {}
    for s in of_kind(samples, "matmul"):
        by_dtype.setdefault(s.dtype, []).append(s)
    if not by_dtype:
        raise InputError("no matmul samples to fit compute throughput", field="matmul")
    lines = {dtype: _rate_line(rows, "flops", launch_s, f"matmul {dtype}") for dtype, rows in sorted(by_dtype.items())}
    halves = [rate * intercept for rate, intercept, _ in lines.values()]
    return {d: v[0] for d, v in lines.items()}, float(np.median(halves)), [v[2] for v in lines.values()]


def fit_memory(samples: Sequence[Sample], launch_s: float) -> tuple[float, Fit]:
    """Sustained memory bandwidth (bytes/s) from streams: t = launch + c + b / B."""
    rows = of_kind(samples, "memory")
    if not rows:
        raise InputError("no memory samples to fit bandwidth", field="memory")
    rate, _, fit = _rate_line(rows, "bytes", launch_s, "memory")
    return rate, fit


def fit_transpose(samples: Sequence[Sample]) -> tuple[float, Fit] | None:
    """The transposing passes' rate (bytes/s) from ``transpose`` samples: ``t = c + b / rate``, a line in the bytes
    read and written whose intercept ``c`` holds the program's launch and the pass's fixed cost. None without
    such samples (an accelerator's calibration) or where their times do not grow with their bytes."""
    rows = of_kind(samples, "transpose")
    if len(rows) < 2:
        return None
    try:
        rate, _, fit = _rate_line(rows, "bytes", 0.0, "transpose")
    except InputError:
        return None
    return rate, fit


def samples_to_rows(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """Plain dicts (for the ``.measurements.json`` file), defaults left out."""
    defaults = Sample(kind="dispatch", seconds=1.0)
    return [{k: getattr(s, k) for k in Sample.__slots__ if k in ("kind", "seconds") or getattr(s, k) != getattr(defaults, k)}
            for s in samples]


def samples_from_rows(rows: Sequence[Mapping[str, Any]]) -> list[Sample]:
    """Samples back from :func:`samples_to_rows` output (InputError naming the bad row)."""
    names = [f.name for f in fields(Sample)]
    out = []
    for i, row in enumerate(rows):
        field = f"samples[{i}]"
        row = expect_mapping(row, field)
        check_keys(row, names, field, required=("kind", "seconds"))
        values: dict[str, Any] = {"kind": get_str(row, "kind", field, choices=SAMPLE_KINDS),
                                  "seconds": get_float(row, "seconds", field, positive=True)}
        for name in ("flops", "bytes", "host_s", "alone_s"):
            values[name] = get_float(row, name, field, default=0.0, minimum=0.0)
        for name in ("devices", "ranks"):
            values[name] = get_int(row, name, field, default=1, maximum=MAX_DEVICES)
        values["count"] = get_int(row, "count", field, default=0, minimum=0)
        for name in ("m", "n", "k"):
            values[name] = get_int(row, name, field, default=0, minimum=0, maximum=1 << 24)
        values["dtype"] = get_str(row, "dtype", field, default="fp32", max_length=32)
        values["op"] = get_str(row, "op", field, default="", max_length=200)
        try:
            out.append(Sample(**values))
        except InputError as exc:
            raise exc.within(field) from None
    return out
