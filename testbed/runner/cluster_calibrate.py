"""Measure gloo's host costs on a built emulated cluster: the probe and timed collectives, as raw rows.

:func:`measure` runs :mod:`testbed.cluster.probe` and then, in one job of one
worker per node (:func:`testbed.runner.on_cluster.cluster_launch`), all-reduce,
all-gather and reduce-scatter over every device at a tiny size (4 KiB: every
one of gloo's segments holds data, so every round runs; a 4-byte all-reduce
skips most) and at 64 KiB x 4^k while the call is priced under ``max_call_s``
at the links' goodput. :func:`testbed.cluster.fit.fit_host_costs` fits the
per-call and per-round costs and link efficiency to those rows: the three
ops' tiny calls have 14, 7 and 4 rounds on 8 devices (gloo's rings and its
halving-doubling reduce-scatter), which is what separates a call's cost
from a round's (:mod:`testbed.cluster.fit`). The 1-minute load average is
recorded before and after: on a shared host the per-call cost follows it.
"""

from __future__ import annotations

import os
import time
from typing import Any, Mapping, Sequence

from testbed.cluster import probe as tcp_probe
from testbed.cluster.fit import HostCosts, HostProbe, emulated, link_goodput, predict
from testbed.cluster.netns import bucket_bytes, queue_in_use
from testbed.cluster.queue import queue_bytes
from testbed.cluster.spec import ClusterSpec
from testbed.runner.on_cluster import cluster_launch, slowest_medians

__all__ = ["OPS", "TINY_BYTES", "calls_for", "sizes_for", "repeats_for", "warmup_for", "priced_s", "measure",
           "measure_interleaved"]

#: The ops timed: gloo's two rings and its reduce-scatter, whose rounds (14, 7 and 4 on 8 devices) separate the
#: per-call cost from the per-round one.
OPS = ("all_reduce", "all_gather", "reduce_scatter")
#: The call that fixes the per-call cost: 4 KiB (the all-reduce's buffer, the all-gather's result).
TINY_BYTES = 4096
_FIRST, _LAST = 2**16, 2**26  # 64 KiB .. 64 MiB, nccl-tests' sizes
_CHEAP_S = 0.5  # seconds of calls below which a size is timed more often (repeats_for)
_LONG_S = 3.0  # a call priced over this many seconds is wire-bound and timed with no warm-up call (warmup_for)


def _guess(spec: ClusterSpec, probe: HostProbe) -> Any:
    """The cluster priced with typical host costs (5 ms a call, 90% of goodput): what sizes and repeats to ask."""
    return emulated(spec, probe, HostCosts(call_s=5e-3, overhead_s=0.0, link_efficiency=0.9, goodput=link_goodput(spec)))


def sizes_for(spec: ClusterSpec, probe: HostProbe, op: str, max_call_s: float, min_call_s: float = 0.0,
              tiny: Sequence[int] = (TINY_BYTES,)) -> list[int]:
    """The tiny sizes (``tiny``, each under 64 KiB) and 64 KiB x 4^k up to 64 MiB whose call the links' goodput
    prices under ``max_call_s`` (and, with ``min_call_s``, over it: the sizes a run to ``min_call_s`` left out;
    the tiny calls are kept, they open the job's connections before the first long call, which has no warm-up
    call, :func:`warmup_for`)."""
    if not tiny or any(not 0 < t < _FIRST for t in tiny):
        raise ValueError(f"tiny sizes must be given, each in (0, {_FIRST}) bytes, got {list(tiny)}")
    guess = _guess(spec, probe)
    sizes, size = sorted(set(tiny)), _FIRST
    while size <= _LAST and predict(guess, op, size) <= max_call_s:
        if predict(guess, op, size) > min_call_s:
            sizes.append(size)
        size *= 4
    return sizes


def warmup_for(spec: ClusterSpec, probe: HostProbe, op: str, size: int, warmup: int = 2) -> int:
    """Untimed calls before ``size``'s timed ones: ``warmup``, none for a call priced over :data:`_LONG_S`.
    Its program is compiled ahead (:func:`testbed.runner.cluster_collective.collective_times`) and the job's
    connections are open (the tiny call runs first), so a warm-up would only repeat seconds to minutes of wire
    (a 64 MiB all-reduce at 10 Mb/s: ~2 minutes)."""
    return 0 if predict(_guess(spec, probe), op, size) > _LONG_S else warmup


def priced_s(spec: ClusterSpec, probe: HostProbe, calls: Sequence[Sequence]) -> float:
    """Seconds the links' goodput prices ``calls`` (``[op, bytes, repeats, warmup]`` each) at: a job's timeout."""
    guess = _guess(spec, probe)
    return sum(predict(guess, op, size) * (count + warm) for op, size, count, warm in calls)


def repeats_for(spec: ClusterSpec, probe: HostProbe, op: str, size: int, repeats: int, tiny_repeats: int) -> int:
    """Calls to time at ``size``: ``tiny_repeats`` for the tiny call, else ``repeats``, raised towards
    ``tiny_repeats`` while the calls take under :data:`_CHEAP_S` in all: cheap calls are the ones the host's
    scheduling moves most (a 64 KiB all-reduce at 100 Mb/s: 24-64 ms where the wire takes 10), so their median
    is taken over more of them."""
    if size < _FIRST:
        return tiny_repeats
    return max(repeats, min(tiny_repeats, int(_CHEAP_S / predict(_guess(spec, probe), op, size))))


def _load() -> float:
    return os.getloadavg()[0]


def calls_for(spec: ClusterSpec, probe: HostProbe, ops: Sequence[str], max_call_s: float, repeats: int,
              tiny_repeats: int, capped: Mapping[str, int] | None = None) -> list[list]:
    """``[op, bytes, repeats]`` for each op at :func:`sizes_for`'s sizes; an op in ``capped`` only below its size
    (``calibrate --cluster`` times only what it fits: the reduce-scatter's 4 KiB call,
    :data:`testbed.cluster.fit.CAPPED_OPS`)."""
    capped = capped or {}
    return [[op, size, repeats_for(spec, probe, op, size, repeats, tiny_repeats)]
            for op in ops for size in sizes_for(spec, probe, op, max_call_s) if size < capped.get(op, float("inf"))]


def measure(spec: ClusterSpec, owner: str, *, ops: tuple[str, ...] = OPS,
            max_call_s: float = 2.0, repeats: int = 3, tiny_repeats: int = 15,
            timeout_s: float | None = 900, capped: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Probe the cluster, then time ``ops`` at :func:`calls_for`'s sizes; the raw measurements (JSON-ready)."""
    load_before, started = _load(), time.perf_counter()
    measured = tcp_probe.measure(spec, owner)
    probe = HostProbe(loopback_bandwidth=measured.loopback_bandwidth,
                      loopback_latency_s=measured.loopback_latency_s, across_latency_s=measured.across_latency_s)
    calls = calls_for(spec, probe, ops, max_call_s, repeats, tiny_repeats, capped)
    # One job for every op: each launch compiles and joins the workers anew (~20 s on a busy 2-core host).
    rows = slowest_medians(cluster_launch(spec, owner, {"body": "collective", "calls": calls}, timeout_s=timeout_s))
    return {"cluster": spec.name, "topology": spec.topology.name, "scale": spec.scale, "mtu": spec.mtu,
            "bucket_bytes": bucket_bytes(min(link.rate_bps for link in spec.links), spec.mtu),
            "queue": queue_in_use(spec, owner), "link_rate_bps": min(link.rate_bps for link in spec.links),
            "goodput": link_goodput(spec),
            "probe": probe.to_dict(), "rows": rows, "max_call_s": max_call_s, "repeats": repeats,
            "load_before": load_before, "load_after": _load(), "seconds": time.perf_counter() - started}


def _queue_at(queue: dict[str, Any], spec: ClusterSpec) -> dict[str, Any]:
    """The cluster's queue (:func:`testbed.cluster.netns.queue_in_use`, read at one rate) at ``spec``'s rate: the
    same kind, its limit 50 ms of that rate plus the bucket."""
    rate = min(link.rate_bps for link in spec.links)
    return {**queue, "limit_bytes": queue_bytes(rate, bucket_bytes(rate, spec.mtu))}


def measure_interleaved(spec: ClusterSpec, owner: str, scales: Sequence[float], *, rounds: int = 2,
                        ops: tuple[str, ...] = OPS, max_call_s: float = 2.0,
                        repeats: int = 3, tiny_repeats: int = 15, min_call_s: float = 0.0,
                        tiny: Sequence[int] = (TINY_BYTES,), timeout_s: float | None = 900,
                        capped: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
    """:func:`measure` at every link scale of ``scales`` in one job, the links reshaped between phases.

    The host's per-call cost follows the load (a 4 KiB call: 8-25 ms over load averages 3-16), so rates
    measured in separate jobs minutes apart carry different host costs into each other's leave-one-out
    prediction. Here the same processes time every rate's calls, ``rounds`` passes over the rates, and each
    size's calls from every pass are pooled (median of the slowest process's per call). One dict per scale,
    as :func:`measure` returns; the links are left at ``spec.scale``. ``min_call_s``: only the sizes priced over
    it (:func:`sizes_for`: a run to 64 MiB beside one to a few seconds a call); ``tiny``: the host-bound sizes
    under 64 KiB (default 4 KiB); ``capped``: an op only below its size (:func:`calls_for`); the job's timeout
    grows with its calls' priced seconds.
    """
    import tempfile
    from pathlib import Path

    from testbed.cluster.netns import reshape
    from testbed.cluster.spec import cluster_spec
    from testbed.runner.link_phases import run_phases

    specs = [cluster_spec(spec.topology, name=spec.name, scale=s, mtu=spec.mtu) for s in scales]
    loads = [_load()]
    probes, calls = _probe_scales(spec, owner, specs, ops, max_call_s, repeats, tiny_repeats, min_call_s, tiny,
                                  capped)
    phases = [str(i) for i in range(len(specs))] * rounds
    if timeout_s:  # the job's calls priced at the links' goodput, twice over, with a margin for the host
        timeout_s = max(timeout_s, 2 * rounds * sum(priced_s(one, p, c) for one, p, c in zip(specs, probes, calls))
                        + 300)

    def job(payload: dict) -> list[dict]:
        return cluster_launch(spec, owner, payload, timeout_s=timeout_s)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="testbed-phases-") as sync:
        try:
            results = run_phases(job, {"phase_calls": [calls[int(n)] for n in phases]}, phases, len(spec.nodes),
                                 lambda name: reshape(spec, owner, specs[int(name)].scale), Path(sync),
                                 timeout_s=timeout_s or 600, body="collective_phases")
        finally:
            reshape(spec, owner, spec.scale)
    loads.append(_load())
    queue = queue_in_use(spec, owner)
    out = []
    for i, one in enumerate(specs):
        rows = _pooled_rows(results, phases, i)
        out.append({"cluster": one.name, "topology": one.topology.name, "scale": one.scale, "mtu": one.mtu,
                    "bucket_bytes": bucket_bytes(min(link.rate_bps for link in one.links), one.mtu),
                    "queue": _queue_at(queue, one), "link_rate_bps": min(link.rate_bps for link in one.links),
                    "goodput": link_goodput(one),
                    "probe": probes[i].to_dict(), "rows": rows, "max_call_s": max_call_s, "min_call_s": min_call_s,
                    "repeats": repeats, "rounds": rounds, "load_before": loads[0], "load_after": loads[-1],
                    "seconds": time.perf_counter() - started})
    return out


def _probe_scales(spec: ClusterSpec, owner: str, specs: Sequence[ClusterSpec], ops: tuple[str, ...],
                  max_call_s: float, repeats: int, tiny_repeats: int, min_call_s: float, tiny: Sequence[int],
                  capped: Mapping[str, int] | None) -> tuple[list[HostProbe], list[list[list[Any]]]]:
    """Per link scale of ``specs`` (the links reshaped to each): the TCP probe, and the calls
    ``[op, size, repeats, warmup]`` its phase times."""
    from testbed.cluster.netns import reshape

    probes, calls = [], []
    for one in specs:
        reshape(spec, owner, one.scale)
        measured = tcp_probe.measure(one, owner)
        probes.append(HostProbe(loopback_bandwidth=measured.loopback_bandwidth,
                                loopback_latency_s=measured.loopback_latency_s,
                                across_latency_s=measured.across_latency_s))
        calls.append([[op, size, repeats_for(one, probes[-1], op, size, repeats, tiny_repeats),
                       warmup_for(one, probes[-1], op, size)]
                      for op in ops for size in sizes_for(one, probes[-1], op, max_call_s, min_call_s, tiny)
                      if size < (capped or {}).get(op, float("inf"))])
    return probes, calls


def _pooled_rows(results: list[dict[str, Any]], phases: list[str], i: int) -> list[dict[str, Any]]:
    """Scale ``i``'s rows: each size's calls from every pass over its phase pooled (median of the slowest
    process's per call)."""
    import statistics

    passes = [slowest_medians([{"rows": r["phases"][k]} for r in results]) for k, n in enumerate(phases)
              if n == str(i)]
    rows = []
    for same in zip(*passes):
        pooled = [t for row in same for t in row["calls_s"]]
        rows.append({**same[0], "measured_s": statistics.median(pooled), "calls_s": pooled,
                     "ok": all(row["ok"] for row in same)})
    return rows
