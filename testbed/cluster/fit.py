"""The host's costs of gloo over TCP on an emulated cluster, fitted from timed collectives (pure).

The links' shaped rate and TCP's headers (:meth:`ClusterSpec.emulated_topology`)
price the wire; what XLA:CPU's gloo collectives cost beyond it is the host's,
and ``testbed calibrate --cluster`` measures it
(:mod:`testbed.runner.cluster_calibrate`). Three numbers, all written into the
calibrated topology where the simulator reads them:

- **per call**: ``call_s``, written as ``collectives.launch_s`` (the
  simulator charges it once per collective) -
  XLA's dispatch, the rendezvous of a process's device threads, gloo's
  set-up; fitted at 0-12 ms on a 2-core host (it follows the load);
- **per round**: ``collectives.overhead_s``, the host's work for a round
  of the collective's algorithm (gloo's ring: 2(n-1) rounds for an
  all-reduce, n-1 for an all-gather; its halving-doubling reduce-scatter
  log2(n) + 1): the wake-up of the thread a segment arrived for, the
  reduction, the next send; a ring's round lasts the longer of it and its
  wire, since gloo keeps a second segment on the wire meanwhile, a
  reduce-scatter's adds the two (:mod:`testbed.collectives.gloo`, the
  simulator's form);
- **per byte**: ``link_efficiency``, the share of the links' TCP goodput a
  collective gets, folded into the network level's bandwidth. The
  same measurement read as a rate-independent host cost per byte is
  ``per_byte_s = (1 / efficiency - 1) / goodput``; the two differ only in how
  they carry over to another link rate, which
  ``benchmarks/emulated_cluster.py`` tests leave-one-rate-out.

The fit minimises the squared log ratio predicted / measured over the timed
rows of :data:`FIT_MIN_BYTES` (4 KiB) and up by a grid over the three (for a
given efficiency the time is a function of the two costs evaluated on their
whole grid at once).

Why this form (each ring round's host cost hidden under its wire, the fit from 4 KiB, the reduce-scatter
priced but not fitted) and the measurements behind it: docs/cluster.md, "Calibrating gloo's host costs".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from testbed.cluster.spec import GLOO_ALGORITHMS, ClusterSpec, goodput_fraction
from testbed.collectives.gloo import gloo_pipelined
from testbed.collectives.timing import groups_time
from testbed.errors import InputError
from testbed.topology import Topology

__all__ = ["CAPPED_OPS", "FITTED_OPS", "FIT_MIN_BYTES", "fit_from_bytes", "FORMS", "HostProbe", "HostCosts", "emulated", "predict",
           "fit_host_costs", "costs_at_rate",
           "price_rows", "row_errors"]

#: The smallest call the fit uses (docs/cluster.md, "Calibrating gloo's host costs"): ``calibrate --cluster``'s tiny call.
FIT_MIN_BYTES = 2**12
#: How a round's host cost meets its wire: ``hidden`` under it (``max``, the simulator's for gloo's rings) or
#: ``added`` (each round's host cost added to its wire; kept for comparison).
FORMS = ("hidden", "added")
_EFFICIENCIES = [round(0.40 + 0.005 * k, 3) for k in range(121)]  # 0.40 .. 1.00
_OVERHEADS = np.arange(101) * 2e-5  # 0 .. 2 ms a round
_CALLS = np.arange(121) * 2.5e-4  # 0 .. 30 ms a call

#: Ops ``calibrate --cluster`` times only below a size (bytes), and the fit with ``capped=CAPPED_OPS`` takes only
#: below it: the reduce-scatter's host-bound 4 KiB call, a third round count that would pin the split of a call's
#: cost and a round's (docs/cluster.md) where its call costs what the rings' does (:data:`FITTED_OPS`); its larger calls took,
#: beyond their 4 KiB call, 1.7-3.6x their priced wire in the (loaded) runs that timed them
#: (``cluster_runs/rs-probe-loaded.json``, docs/cluster.md), links idle for a reason not found yet, which would pull
#: the links' efficiency the rings are scored on. They are reported, not fitted. ``{"reduce_scatter": 0}``: the
#: rings alone.
CAPPED_OPS: Mapping[str, int] = {"reduce_scatter": 2**16}

#: The ops the fit takes (its default ``capped``): the rings alone. The reduce-scatter's 4 KiB call shares the
#: rings' per-call and per-round costs only if it sits on their line ``call + rounds x round``; on a quiet run
#: (``cluster_runs/run22.json``) it sat above that line at every rate
#: (10 / 30 / 100 Mb/s: 7.63 / 7.86 / 5.27 ms measured, the rings' line at its 4 rounds 6.51 / 7.04 / 4.19 ms), a
#: call cost of its own; fitted with the rings it moved the 10 Mb/s split (a call 0.25 ms, the rings alone 1.25)
#: and priced that rate's 64 KiB all-gather 15.3% under (the rings alone: every size within 13.6%, in sample and
#: held out by rate). ``calibrate --cluster`` still times it (:data:`CAPPED_OPS`) and reports it priced; pass
#: ``capped=CAPPED_OPS`` to fit it too.
FITTED_OPS: Mapping[str, int] = {"reduce_scatter": 0}

#: Where the fit started for measurements that record no ``bucket_bytes``: taken on links with a bucket of 1 ms
#: of rate, whose 4 KiB calls did not carry the larger calls' costs (docs/cluster.md).
LEGACY_FIT_MIN_BYTES = 2**16


def fit_from_bytes(measurements: Mapping[str, Any]) -> int:
    """The smallest call to fit for a measurement (``calibrate --cluster``'s raw dict): :data:`FIT_MIN_BYTES` where
    it records the links' bucket, :data:`LEGACY_FIT_MIN_BYTES` for measurements taken with a bucket of 1 ms of rate."""
    return FIT_MIN_BYTES if measurements.get("bucket_bytes") else LEGACY_FIT_MIN_BYTES


@dataclass(frozen=True, slots=True, kw_only=True)
class HostProbe:
    """What :mod:`testbed.cluster.probe` measured: loopback TCP in a node (bytes/s, one-way s), latency across."""

    loopback_bandwidth: float
    loopback_latency_s: float
    across_latency_s: float

    def __post_init__(self) -> None:
        if not self.loopback_bandwidth > 0:
            raise InputError(f"must be positive, got {self.loopback_bandwidth}", field="probe.loopback_bandwidth")
        for name in ("loopback_latency_s", "across_latency_s"):
            if not 0 <= getattr(self, name) < 1:
                raise InputError(f"must be in [0, 1) s, got {getattr(self, name)}", field=f"probe.{name}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "HostProbe":
        return cls(loopback_bandwidth=float(data["loopback_bandwidth"]),
                   loopback_latency_s=float(data["loopback_latency_s"]),
                   across_latency_s=float(data["across_latency_s"]))

    def to_dict(self) -> dict[str, float]:
        return {"loopback_bandwidth": self.loopback_bandwidth, "loopback_latency_s": self.loopback_latency_s,
                "across_latency_s": self.across_latency_s}


@dataclass(frozen=True, slots=True, kw_only=True)
class HostCosts:
    """gloo's host costs on one cluster: per call and per round of a call (s), the share of goodput it gets."""

    call_s: float
    overhead_s: float
    link_efficiency: float
    goodput: float  # bytes/s of the links they were measured on (for per_byte_s)

    def __post_init__(self) -> None:
        for name in ("call_s", "overhead_s"):
            if not 0 <= getattr(self, name) < 1:
                raise InputError(f"must be in [0, 1) s, got {getattr(self, name)}", field=name)
        if not 0 < self.link_efficiency <= 1:
            raise InputError(f"must be in (0, 1], got {self.link_efficiency}", field="link_efficiency")

    @property
    def per_byte_s(self) -> float:
        """The efficiency read as a host cost per byte on the wire, independent of the link's rate."""
        return (1 / self.link_efficiency - 1) / self.goodput

    def to_dict(self) -> dict[str, float]:
        return {"call_s": self.call_s, "overhead_s": self.overhead_s, "link_efficiency": self.link_efficiency,
                "per_byte_s": self.per_byte_s, "goodput": self.goodput}


def link_goodput(spec: ClusterSpec) -> float:
    """TCP payload bytes/s of the cluster's slowest switch level's links."""
    return min(link.rate_bps for link in spec.links) / 8 * goodput_fraction(spec.mtu)


def costs_at_rate(costs: Sequence[HostCosts], goodput: float, *, per_byte: bool = False) -> HostCosts:
    """The mean of costs fitted on other clusters, carried to links of ``goodput``: the efficiency as is, or
    (``per_byte``) the per-byte cost, which gives another efficiency at another rate."""
    call = sum(c.call_s for c in costs) / len(costs)
    overhead = sum(c.overhead_s for c in costs) / len(costs)
    if per_byte:
        per_byte_s = sum(c.per_byte_s for c in costs) / len(costs)
        efficiency = 1 / (1 + per_byte_s * goodput)
    else:
        efficiency = sum(c.link_efficiency for c in costs) / len(costs)
    return HostCosts(call_s=call, overhead_s=overhead, link_efficiency=efficiency, goodput=goodput)


def emulated(spec: ClusterSpec, probe: HostProbe, costs: HostCosts | None = None) -> Topology:
    """The topology the simulator prices for this cluster: probed TCP inside and across nodes, with ``costs``."""
    return spec.emulated_topology(
        inner_bandwidth=probe.loopback_bandwidth, inner_latency_s=probe.loopback_latency_s / 2,
        hop_latency_s=max(probe.across_latency_s - probe.loopback_latency_s, 0.0) / 2,
        overhead_s=0.0 if costs is None else costs.overhead_s,
        launch_s=0.0 if costs is None else costs.call_s,
        link_efficiency=1.0 if costs is None else costs.link_efficiency)


def predict(topology: Topology, op: str, nbytes: float) -> float:
    """Seconds of ``op`` over every device of ``topology`` with gloo's algorithm."""
    group = [tuple(range(topology.num_devices))]
    return groups_time(topology, op, group, nbytes, GLOO_ALGORITHMS[op]).time_s


def _terms(spec: ClusterSpec, probe: HostProbe, rows: Sequence[Mapping[str, Any]], efficiency: float
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: the time with no host costs (the wire), the rounds of gloo's algorithm, and whether the simulator
    hides a round's host cost under its wire (gloo's rings) or adds it (the reduce-scatter's single sends)."""
    base = emulated(spec, probe, HostCosts(call_s=0.0, overhead_s=0.0, link_efficiency=efficiency,
                                           goodput=link_goodput(spec)))
    group = [tuple(range(base.num_devices))]
    timings = [groups_time(base, row["op"], group, row["bytes"], GLOO_ALGORITHMS[row["op"]]) for row in rows]
    hidden = [gloo_pipelined(base, row["op"], GLOO_ALGORITHMS[row["op"]]) for row in rows]
    return (np.array([t.time_s for t in timings]), np.array([float(t.rounds) for t in timings]),
            np.array(hidden, dtype=bool))


def _check_form(form: str) -> None:
    if form not in FORMS:
        raise InputError(f"must be one of {', '.join(FORMS)}, got {form!r}", field="form")


def fit_host_costs(spec: ClusterSpec, probe: HostProbe, rows: Sequence[Mapping[str, Any]], *,
                   form: str = "hidden", min_bytes: int = FIT_MIN_BYTES,
                   capped: Mapping[str, int] = FITTED_OPS) -> HostCosts:
    """The per-call and per-round costs and link efficiency that price ``rows`` (``op``, ``bytes``,
    ``measured_s``; those of ``min_bytes`` and up, and of an op in ``capped`` only below its size) best in
    ``form``: least squares of log(predicted / measured) over a grid of efficiencies 0.40-1.00 (step 0.005),
    per-round costs 0-2 ms (step 20 us) and per-call costs 0-30 ms (step 0.25 ms)."""
    _check_form(form)
    rows = [row for row in rows if min_bytes <= row["bytes"] < capped.get(row["op"], float("inf"))]
    if not rows:
        raise InputError(f"no timed collective of {min_bytes} bytes or more to fit the host's costs to",
                         field="rows")
    measured = np.log(np.array([row["measured_s"] for row in rows]))
    best = (np.inf, 0.0, 0.0, 1.0)
    for efficiency in _EFFICIENCIES:
        t0, rounds, hidden = _terms(spec, probe, rows, efficiency)
        # [call, overhead, row]: every combination at once.
        per_rounds = t0 + _OVERHEADS[None, :, None] * rounds
        if form == "hidden":
            per_rounds = np.where(hidden, np.maximum(_OVERHEADS[None, :, None], t0 / rounds) * rounds, per_rounds)
        predicted = per_rounds + _CALLS[:, None, None]
        loss = ((np.log(predicted) - measured) ** 2).sum(axis=2)
        i, j = np.unravel_index(int(np.argmin(loss)), loss.shape)
        if loss[i, j] < best[0]:
            best = (float(loss[i, j]), float(_CALLS[i]), float(_OVERHEADS[j]), efficiency)
    return HostCosts(call_s=best[1], overhead_s=best[2], link_efficiency=best[3], goodput=link_goodput(spec))


def price_rows(spec: ClusterSpec, probe: HostProbe, costs: HostCosts, rows: Sequence[Mapping[str, Any]], *,
               form: str = "hidden") -> list[float]:
    """Seconds of each row priced with ``costs``: by the simulator (``hidden``: each of gloo's rounds
    ``max(overhead, wire)``, :func:`testbed.collectives.gloo.round_s`), or with each round's host cost added to
    its wire (``added``, kept for comparison; the ring's rounds on the
    cluster are alike, so a round's wire is the call's wire over its rounds)."""
    _check_form(form)
    if form == "hidden":
        topology = emulated(spec, probe, costs)
        return [predict(topology, row["op"], row["bytes"]) for row in rows]
    t0, rounds, _ = _terms(spec, probe, rows, costs.link_efficiency)
    return [float(t) for t in costs.call_s + t0 + costs.overhead_s * rounds]


def row_errors(spec: ClusterSpec, probe: HostProbe, costs: HostCosts, rows: Sequence[Mapping[str, Any]], *,
               form: str = "hidden") -> list[dict[str, Any]]:
    """Each row priced with ``costs`` in ``form``: predicted seconds and error (predicted / measured - 1)."""
    return [{**row, "predicted_s": p, "error": p / row["measured_s"] - 1}
            for row, p in zip(rows, price_rows(spec, probe, costs, rows, form=form))]
