"""The host's costs of gloo over TCP on an emulated cluster, fitted from timed collectives (pure).

The links' shaped rate and TCP's headers (:meth:`ClusterSpec.emulated_topology`)
price the wire; what XLA:CPU's gloo collectives cost beyond it is the host's,
and ``testbed calibrate --cluster`` measures it
(:mod:`testbed.runner.cluster_calibrate`). Three numbers, all written into the
calibrated topology where the simulator reads them:

- **per call**: ``call_s``, written as ``collectives.launch_s`` (the
  simulator charges it once per collective) -
  XLA's dispatch, the rendezvous of a process's device threads, gloo's
  set-up; measured on a 2-core host at 8-16 ms for either op;
- **per round**: ``collectives.overhead_s``, charged per round of the
  collective's algorithm (gloo's ring: 2(n-1) rounds for an all-reduce, n-1
  for an all-gather): the handshakes between segments and the wake-ups of
  processes that share the cores;
- **per byte**: ``link_efficiency``, the share of the links' TCP goodput a
  collective gets (gloo's ring waits between segments for its neighbour,
  the link idles meanwhile), folded into the network level's bandwidth. The
  same measurement read as a rate-independent host cost per byte is
  ``per_byte_s = (1 / efficiency - 1) / goodput``; the two differ only in how
  they carry over to another link rate, which
  ``benchmarks/emulated_cluster.py`` tests leave-one-rate-out.

The fit minimises the squared log ratio predicted / measured over the timed
rows of :data:`FIT_MIN_BYTES` (4 KiB) and up by a grid over the three (the
model is linear in the two costs for a given efficiency). The 4 KiB calls
are what fixes the per-call and per-round costs; the larger ones the
efficiency. Until tbf's bucket was two frames at every rate
(:func:`testbed.cluster.netns.bucket_bytes`) the fit started at 64 KiB: a
bucket of 1 ms of rate (eight frames at 100 Mb/s) gave the links back the
idle time of gloo's host gaps, so a 64 KiB all-reduce at 100 Mb/s ran at
its wire time while a 4 KiB call took 8-16 ms, which no cost added per
call or round could say. With the link as it is, the 4 KiB calls carry the
costs the larger ones pay (held out, ``benchmarks/emulated_cluster.py``:
22-23 of 24 sizes within 15% fitted from 4 KiB, 21-22 from 64 KiB, largest
error 17.5-22.8% against 30.7-57.3%, in the three runs so measured).

A second form of the same three costs is evaluated beside the additive one
(``form="hidden"``, :func:`price_rows`; the simulator prices only the
additive): each round of gloo's ring takes ``max(overhead, wire)`` instead of
their sum, the reading of gloo keeping one segment on the wire while it
reduces the other (``gloo/allreduce.cc``), fitted with the 4 KiB calls too
(they are what shows the hidden per-round cost at the slow rates).
``benchmarks/emulated_cluster.py --refit`` reports both held out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from testbed.cluster.spec import GLOO_ALGORITHMS, ClusterSpec, goodput_fraction
from testbed.collectives.timing import groups_time
from testbed.errors import InputError
from testbed.topology import Topology

__all__ = ["FIT_MIN_BYTES", "fit_from_bytes", "FORMS", "HostProbe", "HostCosts", "emulated", "predict", "fit_host_costs", "costs_at_rate",
           "price_rows", "row_errors"]

#: The smallest call the fit uses (see the module doc): ``calibrate --cluster``'s tiny call.
FIT_MIN_BYTES = 2**12
#: How a round's host cost meets its wire: ``added`` (the simulator's) or ``hidden`` under it (``max``).
FORMS = ("added", "hidden")
_EFFICIENCIES = [round(0.40 + 0.005 * k, 3) for k in range(121)]  # 0.40 .. 1.00
_OVERHEADS = np.arange(101) * 2e-5  # 0 .. 2 ms a round
_CALLS = np.arange(121) * 2.5e-4  # 0 .. 30 ms a call

#: Where the fit started for measurements that record no ``bucket_bytes``: taken on links with a bucket of 1 ms
#: of rate, whose 4 KiB calls did not carry the larger calls' costs (the module doc).
LEGACY_FIT_MIN_BYTES = 2**16


def fit_from_bytes(measurements: Mapping[str, Any]) -> int:
    """The smallest call to fit for a measurement (``calibrate --cluster``'s raw dict): :data:`FIT_MIN_BYTES` where
    it records the links' bucket, :data:`LEGACY_FIT_MIN_BYTES` for the earlier measurements, refitted as they were."""
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
           ) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the time with no host costs, and seconds per second of overhead a round (the rounds)."""
    goodput = link_goodput(spec)
    base = emulated(spec, probe, HostCosts(call_s=0.0, overhead_s=0.0, link_efficiency=efficiency, goodput=goodput))
    step = emulated(spec, probe, HostCosts(call_s=0.0, overhead_s=1e-3, link_efficiency=efficiency, goodput=goodput))
    t0 = np.array([predict(base, row["op"], row["bytes"]) for row in rows])
    t1 = np.array([predict(step, row["op"], row["bytes"]) for row in rows])
    return t0, (t1 - t0) / 1e-3


def _check_form(form: str) -> None:
    if form not in FORMS:
        raise InputError(f"must be one of {', '.join(FORMS)}, got {form!r}", field="form")


def fit_host_costs(spec: ClusterSpec, probe: HostProbe, rows: Sequence[Mapping[str, Any]], *,
                   form: str = "added", min_bytes: int = FIT_MIN_BYTES) -> HostCosts:
    """The per-call and per-round costs and link efficiency that price ``rows`` (``op``, ``bytes``,
    ``measured_s``; those of ``min_bytes`` and up) best in ``form``: least squares of log(predicted / measured)
    over a grid of efficiencies 0.40-1.00 (step 0.005), per-round costs 0-2 ms (step 20 us) and per-call costs
    0-30 ms (step 0.25 ms)."""
    _check_form(form)
    rows = [row for row in rows if row["bytes"] >= min_bytes]
    if not rows:
        raise InputError(f"no timed collective of {min_bytes} bytes or more to fit the host's costs to",
                         field="rows")
    measured = np.log(np.array([row["measured_s"] for row in rows]))
    best = (np.inf, 0.0, 0.0, 1.0)
    for efficiency in _EFFICIENCIES:
        t0, rounds = _terms(spec, probe, rows, efficiency)
        # [call, overhead, row]: every combination at once.
        if form == "added":
            per_rounds = t0 + _OVERHEADS[None, :, None] * rounds
        else:
            per_rounds = np.maximum(_OVERHEADS[None, :, None], t0 / rounds) * rounds
        predicted = per_rounds + _CALLS[:, None, None]
        loss = ((np.log(predicted) - measured) ** 2).sum(axis=2)
        i, j = np.unravel_index(int(np.argmin(loss)), loss.shape)
        if loss[i, j] < best[0]:
            best = (float(loss[i, j]), float(_CALLS[i]), float(_OVERHEADS[j]), efficiency)
    return HostCosts(call_s=best[1], overhead_s=best[2], link_efficiency=best[3], goodput=link_goodput(spec))


def price_rows(spec: ClusterSpec, probe: HostProbe, costs: HostCosts, rows: Sequence[Mapping[str, Any]], *,
               form: str = "added") -> list[float]:
    """Seconds of each row priced with ``costs``: by the simulator (``added``), or each of gloo's rounds
    ``max(overhead, wire)`` plus the call's cost (``hidden``; the ring's rounds on the cluster are alike, so
    a round's wire is the call's wire over its rounds)."""
    _check_form(form)
    if form == "added":
        topology = emulated(spec, probe, costs)
        return [predict(topology, row["op"], row["bytes"]) for row in rows]
    t0, rounds = _terms(spec, probe, rows, costs.link_efficiency)
    return [float(t) for t in costs.call_s + np.maximum(costs.overhead_s, t0 / rounds) * rounds]


def row_errors(spec: ClusterSpec, probe: HostProbe, costs: HostCosts, rows: Sequence[Mapping[str, Any]], *,
               form: str = "added") -> list[dict[str, Any]]:
    """Each row priced with ``costs`` in ``form``: predicted seconds and error (predicted / measured - 1)."""
    return [{**row, "predicted_s": p, "error": p / row["measured_s"] - 1}
            for row, p in zip(rows, price_rows(spec, probe, costs, rows, form=form))]
