"""Fitting the interconnect: per-level latency and bandwidth, the per-round overhead and the per-rank rendezvous.

A collective's time in the simulator is affine in each level's latency and
inverse bandwidth and in the calibration's ``collectives.overhead_s`` (per
round) and ``collectives.rendezvous_s`` (per rank beyond the first) once the algorithm
(which ``auto`` picks) is fixed: so the caller's timing model (the
simulator's, :func:`testbed.cli.calibrate.simulator_collective_time`)
gives the design matrix column by column, one probe per parameter, and a
relative-error weighted non-negative least squares fits the measured
``collective`` samples. The algorithm choices depend on the parameters, so
the fit is repeated until they settle. The fields then mean exactly what
the simulator does with them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from testbed.calibration.fit import Fit, Sample, fit_quality, of_kind, weighted_fit
from testbed.errors import InputError
from testbed.topology import Form, Topology

__all__ = ["CollectiveParams", "Predictor", "level_groups", "with_collective_params", "collective_columns",
           "fit_collectives"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveParams:
    """Per-level latency (s/hop) and bandwidth (bytes/s), the per-round overhead and the per-rank rendezvous."""

    latency: Mapping[str, float]
    bandwidth: Mapping[str, float]
    overhead_s: float = 0.0
    rendezvous_s: float = 0.0


def level_groups(topology: Topology) -> list[list[str]]:
    """Levels whose link parameters are fitted together (a torus has one bandwidth in YAML; its slices' DCN
    links, ``torus.slices``, their own)."""
    if topology.form is Form.TORUS and topology.slice_level is not None:
        return [list(topology.level_names[:-1]), [topology.level_names[-1]]]
    if topology.form is Form.TORUS or topology.form is Form.GRAPH:
        return [list(topology.level_names) or ["all"]]
    return [[name] for name in topology.level_names]


def with_collective_params(topology: Topology, params: CollectiveParams) -> Topology:
    """The topology with its levels' (or explicit links') latency/bandwidth, overhead and rendezvous replaced."""
    calibration = topology.calibration.updated(collectives={"overhead_s": params.overhead_s,
                                                            "rendezvous_s": params.rendezvous_s})
    if topology.form is Form.GRAPH:
        key = next(iter(params.bandwidth))
        links = tuple(replace(l, bandwidth=params.bandwidth[key], latency=params.latency[key]) for l in topology.links)
        return replace(topology, links=links, calibration=calibration)
    levels = tuple(replace(l, bandwidth=params.bandwidth.get(l.name, l.bandwidth),
                           latency=params.latency.get(l.name, l.latency)) for l in topology.levels)
    return replace(topology, levels=levels, calibration=calibration)


#: predict(topology, sample, reference) -> seconds. ``reference`` fixes discrete choices
#: (which algorithm ``auto`` picks) so the time is affine in the link parameters.
Predictor = Callable[[Topology, Sample, "Topology | None"], float]


def collective_columns(topology: Topology, samples: Sequence[Sample], predict: Predictor,
                       reference: Topology | None = None) -> tuple[np.ndarray, list[str]]:
    """Design matrix of collective times: d time / d parameter for each sample.

    Parameters are, per fitted level group, the latency and the inverse
    bandwidth, plus the per-round overhead and the per-rank rendezvous; the time model (``predict``) is
    affine in them once ``reference`` fixes the algorithm, so one probe per
    parameter from a zero-cost base gives the exact coefficients.
    """
    reference = reference or topology
    groups = level_groups(topology)
    zero = CollectiveParams(latency={n: 0.0 for g in groups for n in g},
                            bandwidth={n: 1e30 for g in groups for n in g}, overhead_s=0.0)

    def column(params: CollectiveParams, step: float) -> np.ndarray:
        probe = with_collective_params(topology, params)
        return (np.array([predict(probe, s, reference) for s in samples]) - base) / step

    base_topo = with_collective_params(topology, zero)
    base = np.array([predict(base_topo, s, reference) for s in samples])
    columns, labels = [], []
    step_lat, step_inv = 1e-3, 1e-9
    for group in groups:
        columns.append(column(replace(zero, latency=dict(zero.latency, **{n: step_lat for n in group})), step_lat))
        columns.append(column(replace(zero, bandwidth=dict(zero.bandwidth, **{n: 1 / step_inv for n in group})),
                              step_inv))
        labels += [f"latency:{group[0]}", f"inverse_bandwidth:{group[0]}"]
    columns.append(column(replace(zero, overhead_s=step_lat), step_lat))
    columns.append(column(replace(zero, rendezvous_s=step_lat), step_lat))
    labels += ["overhead", "rendezvous"]
    return np.column_stack(columns), labels


def fit_collectives(topology: Topology, samples: Sequence[Sample], predict: Predictor, iterations: int = 3,
                    ) -> tuple[CollectiveParams, Fit]:
    """Fit per-level latency, bandwidth, the per-round overhead and the per-rank rendezvous to measured collectives.

    Levels the samples never exercise keep the base topology's values.
    """
    rows = of_kind(samples, "collective")
    if not rows:
        raise InputError("no collective samples to fit link latency and bandwidth", field="collective")
    t = np.array([r.seconds for r in rows])
    reference, best = topology, None
    # Algorithm choices depend on the parameters: refit until the choices settle.
    for _ in range(iterations):
        columns, labels = collective_columns(topology, rows, predict, reference)
        coef = weighted_fit(columns, t)
        params, values = _params_from(topology, columns, labels, coef)
        fitted = with_collective_params(topology, params)
        r2, residuals = fit_quality([predict(fitted, s, None) for s in rows], t)
        fit = Fit(name="collectives", values=values, r2=r2, rel_residuals=residuals, samples=len(rows))
        if best is None or fit.median_abs_rel < best[1].median_abs_rel:
            best = (params, fit)
        reference = fitted
    return best


def _params_from(topology: Topology, columns: np.ndarray, labels: list[str], coef: np.ndarray,
                 ) -> tuple[CollectiveParams, dict[str, float]]:
    latency, bandwidth = {}, {}
    values: dict[str, float] = {}
    for group in level_groups(topology):
        label = group[0]
        i_lat, i_bw = labels.index(f"latency:{label}"), labels.index(f"inverse_bandwidth:{label}")
        base = next((l for l in topology.levels if l.name in group and l.bandwidth), None) or topology.links[0]
        # Parameters no sample exercises keep the base topology's values.
        lat = float(coef[i_lat]) if np.any(columns[:, i_lat] != 0) else base.latency
        bw = (1.0 / coef[i_bw] if coef[i_bw] > 0 else base.bandwidth * 1e3) if np.any(columns[:, i_bw] != 0) \
            else base.bandwidth
        for name in group:
            latency[name], bandwidth[name] = lat, float(bw)
        values[f"{label}.latency_s"], values[f"{label}.bandwidth"] = lat, float(bw)
    params = CollectiveParams(latency=latency, bandwidth=bandwidth, overhead_s=float(coef[labels.index("overhead")]),
                              rendezvous_s=float(coef[labels.index("rendezvous")]))
    values["collective_overhead_s"] = params.overhead_s
    values["collective_rendezvous_s"] = params.rendezvous_s
    return params, values
