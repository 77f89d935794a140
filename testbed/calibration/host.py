"""Fitting the ``host`` calibration group: what devices that share a host's cores cost each other.

From ``testbed.runner.measure``'s samples (testbed.calibration.fit.Sample): the cores' worth of throughput
``k`` devices at once get (``concurrent``: the throughput curve), how much slower separate programs at once
run (``programs``), whether programs over several devices run one at a time (``launches``), and how long the
last of a group meeting between kernels keeps the others waiting (``barriers``). Pure, numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from testbed.calibration.fit import BARRIER_COLLECTIVES, Sample, of_kind
from testbed.topology.curves import skew_growth

__all__ = ["fit_host_cores", "fit_host_throughput", "fit_host_programs", "fit_host_serial", "fit_host_skew",
           "SERIAL_SHARE"]


def fit_host_cores(samples: Sequence[Sample]) -> float:
    """Host cores' worth of throughput emulated devices share: ``k * t(alone) / t(k at once)``.

    The ``concurrent`` samples run the same per-device work on one device
    alone and on ``k`` devices at once; this takes the largest ``k``. 0
    (nothing shared) when all at once is within 25% of alone (real
    accelerators); else the median ratio, at least 1. A fraction (1.5) is fine: see :func:`testbed.calibration.calibrated.calibrated_topology`.
    """
    done = _work_done(samples)
    if not done:
        return 0.0
    k = max(done)  # all devices at once (the curve's other counts: fit_host_throughput)
    cores = float(np.median(done[k]))
    return 0.0 if cores >= 0.8 * k else max(1.0, cores)


def _work_done(samples: Sequence[Sample]) -> dict[int, list[float]]:
    """``k -> [k * t(alone) / t(k at once)]`` over the ``concurrent`` samples on ``k > 1`` devices.

    ``t(alone)`` is the sample's own ``alone_s`` (timed in the same rounds)
    when measured, else the one-device sample of the same program.
    """
    rows = of_kind(samples, "concurrent")
    alone = {(s.flops, s.dtype): s.seconds for s in rows if s.devices == 1}
    done: dict[int, list[float]] = {}
    for s in rows:
        reference = s.alone_s or alone.get((s.flops, s.dtype), 0.0)
        if s.devices > 1 and reference > 0:
            done.setdefault(s.devices, []).append(s.devices * reference / s.seconds)
    return done


def fit_host_throughput(samples: Sequence[Sample]) -> tuple[tuple[int, float], ...]:
    """The shared host's throughput curve: ``(k, T(k))`` with ``T(k) = k * t(alone) / t(k at once)``.

    Median over the ``concurrent`` sample sizes at each device count ``k``;
    ``T(1) = 1``, and each ``T(k)`` is kept within ``[T(previous), k]`` (more
    devices never get less done in the model). Empty when there are no
    concurrent samples on more than one device, or when :func:`fit_host_cores`
    finds nothing shared (real accelerators).
    """
    done = _work_done(samples)
    if not done or not fit_host_cores(samples):
        return ()
    curve = [(1, 1.0)]
    for k in sorted(done):
        curve.append((k, float(np.clip(np.median(done[k]), curve[-1][1], k))))
    return tuple(curve)


def fit_host_programs(samples: Sequence[Sample]) -> tuple[tuple[int, float], ...]:
    """How much slower devices compute in ``P`` separate programs at once: ``(P, S(P))``, ``S = t(P programs) /
    t(one program)`` over the ``programs`` samples (median over their sizes), ``S(1) = 1``.

    An MPMD pipeline runs each stage as its own program; ``concurrent`` (the throughput curve) times one SPMD
    program. The samples time one-device programs: programs over several devices may not run at once at all
    (:func:`fit_host_serial`). Each ``S(P)`` is kept within ``[S(previous), P]`` (more programs are never faster
    in the model). Empty without ``programs`` samples.
    """
    ratios: dict[int, list[float]] = {}
    for s in of_kind(samples, "programs"):
        if s.ranks > 1 and s.alone_s > 0:
            ratios.setdefault(s.ranks, []).append(s.seconds / s.alone_s)
    if not ratios:
        return ()
    curve = [(1, 1.0)]
    for p in sorted(ratios):
        curve.append((p, float(np.clip(np.median(ratios[p]), curve[-1][1], p))))
    return tuple(curve)


#: A ``launches`` sample whose first program completes within this share of the time both take ran them one at
#: a time (one after the other: 1/2; at once: about 1).
SERIAL_SHARE = 0.75


def fit_host_serial(samples: Sequence[Sample]) -> bool | None:
    """Whether the host runs programs over several devices one at a time (HostCalibration.serial_programs): the
    ``launches`` samples' median share of the time both programs took that the first one took is below
    :data:`SERIAL_SHARE`. None without samples."""
    shares = [s.alone_s / s.seconds for s in of_kind(samples, "launches") if s.alone_s > 0]
    return bool(np.median(shares) < SERIAL_SHARE) if shares else None


def fit_host_skew(samples: Sequence[Sample], priced: Callable[[Sample], float]
                  ) -> tuple[tuple[tuple[int, float], ...], float, float]:
    """The shared host's stragglers from the ``barriers`` samples: ``((g, s), ...)``, the onset ``a`` and the
    saturation ``z``, so that ``g`` devices meeting after ``t`` seconds of computing wait ``w_g(t) =
    sqrt(s_g min(t, z)) min(1, sqrt(t / a))`` for the last of them (HostCalibration.barrier_wait).

    A sample's chain meets its groups ``L`` times (``count``, default :data:`BARRIER_COLLECTIVES`) after phases
    of ``T = alone / L`` (the chain without collectives, same rounds) and ends with all ``n`` devices meeting
    after one phase; the chain without ends with them meeting after all ``L``. So ``seconds - alone - L *
    priced(sample)`` (the collectives' own time as the simulator prices them) is ``L w_g(T) + w_n(T) - w_n(L
    T)``. For each onset (0.1-10 ms) and saturation (none, 2-200 ms) on a grid, ``sqrt(s_n)`` is the median
    ratio over the groups of all ``n`` devices, then each smaller group's (at least 0, at most the larger
    group's); the pair kept explains the samples best (least squares in log time). Empty without samples.
    """
    rows = [s for s in of_kind(samples, "barriers") if s.alone_s > 0 and s.ranks > 1]
    if not rows:
        return (), 0.0, 0.0
    n = max(s.devices for s in rows)
    meetings = {id(s): s.count or BARRIER_COLLECTIVES for s in rows}
    net = {id(s): s.seconds - s.alone_s - meetings[id(s)] * priced(s) for s in rows}
    by_group: dict[int, list[Sample]] = {}
    for s in rows:
        by_group.setdefault(s.ranks, []).append(s)

    def fit(onset: float, saturation: float) -> tuple[dict[int, float], float]:
        def shape(t: float) -> float:  # w(t) / sqrt(s)
            return skew_growth(t, onset, saturation)

        def terms(s: Sample) -> tuple[float, float]:  # (the group's meetings, the end's with and without)
            L = meetings[id(s)]
            t = s.alone_s / L
            return L * shape(t), shape(t) - shape(L * t)

        roots: dict[int, float] = {}
        for g in sorted(by_group, reverse=True):
            ratios = []
            for s in by_group[g]:
                own, end = terms(s)
                ratios.append(net[id(s)] / (own + end) if g == n else (net[id(s)] - roots.get(n, 0.0) * end) / own)
            larger = [roots[h] for h in roots if h > g]
            roots[g] = float(np.clip(np.median(ratios), 0.0, min(larger) if larger else math.inf))
        loss = 0.0
        for g, group in by_group.items():
            for s in group:
                own, end = terms(s)
                model = roots[g] * own + roots.get(n, 0.0) * end
                loss += math.log(max(model, 1e-6) / max(net[id(s)], 1e-6)) ** 2
        return roots, loss

    grid = [(float(a), float(z)) for a in np.geomspace(1e-4, 1e-2, 11) for z in (0.0, *np.geomspace(2e-3, 0.2, 11))
            if z == 0.0 or z > a]
    onset, saturation = min(grid, key=lambda pair: fit(*pair)[1])
    roots = fit(onset, saturation)[0]
    return tuple((g, roots[g] ** 2) for g in sorted(roots)), onset, saturation
