"""How much tbf's bucket hides: collectives on one emulated cluster, the links' bucket changed between phases.

tbf lets a bucket of bytes leave at memory speed after the link idles; gloo's
ring leaves the links idle between its segments, so the bucket can give back
part of that idle time, which a real link cannot. This builds the 4 x 2
``eth-4x2`` cluster at one rate (``--rate``, Mb/s) and, in one job
(:mod:`testbed.runner.link_phases`: the same processes, the bucket sizes
interleaved, ``--rounds`` passes), times all-reduce and all-gather over the 8
devices at 4 KiB to 1 MiB with each bucket of ``--buckets`` (bytes) on every
link end. Per op, size and bucket: the median and the fastest call (ms, the
slowest process's), and the wire at the links' TCP goodput. The result chose
the cluster's bucket (:func:`testbed.cluster.netns.bucket_bytes`).

Needs root or CAP_NET_ADMIN. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from testbed.cluster import cluster_spec, netns
from testbed.cluster.fit import link_goodput
from testbed.collectives.ops import parse_op
from testbed.topology.io import load_topology

CALLS = [[op, size, repeats] for op in ("all_reduce", "all_gather")
         for size, repeats in ((4096, 15), (65536, 20), (262144, 12), (1048576, 5))]


def _set_bucket(spec, owner: str, burst: int) -> None:
    """Every link end's tbf at the spec's rate with a bucket of ``burst`` bytes."""
    fabric = netns.namespace_name(spec.name, owner, "sw")
    roles = {n.role for n in spec.nodes}
    for link in spec.links:
        lower = netns.namespace_name(spec.name, owner, link.lower) if link.lower in roles else fabric
        for ns, dev in ((lower, link.lower_dev), (fabric, link.upper_dev)):
            netns._run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                        f"{int(link.rate_bps)}bit", "burst", str(burst), "latency", "50ms"])


def _wire_ms(spec, op: str, size: int) -> float:
    """The busiest node link's bytes at TCP goodput: gloo's ring carries (n-1)/n of the buffer (x2 reducing)."""
    n = len(spec.nodes) * spec.devices_per_node
    share = (2 if parse_op(op).name == "ALL_REDUCE" else 1) * (n - 1) / n
    return share * size / link_goodput(spec) * 1e3


def main(argv: list[str] | None = None) -> int:
    from testbed.runner.link_phases import run_phases
    from testbed.runner.on_cluster import cluster_launch, slowest_medians

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100.0, help="link rate in Mb/s (default 100)")
    parser.add_argument("--buckets", default="3028,12500,50000", help="tbf bucket sizes in bytes")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the bucket sizes (default 2)")
    args = parser.parse_args(argv)
    problem = netns.unavailable()
    if problem:
        print(json.dumps({"skipped": problem}))
        return 0
    buckets = [int(b) for b in args.buckets.split(",")]
    topology = load_topology("eth-4x2")
    spec = cluster_spec(topology, name="bucket", scale=args.rate * 1e6 / (topology.levels[-1].bandwidth * 8))
    phases = [str(b) for b in buckets] * args.rounds
    load = [os.getloadavg()[0]]
    with netns.ephemeral(spec) as owner, tempfile.TemporaryDirectory(prefix="testbed-phases-") as sync:
        results = run_phases(lambda payload: cluster_launch(spec, owner, payload, timeout_s=900),
                             {"phase_calls": [CALLS] * len(phases)}, phases, len(spec.nodes),
                             lambda name: _set_bucket(spec, owner, int(name)), Path(sync), body="collective_phases")
    load.append(os.getloadavg()[0])
    rows: dict[str, dict] = {}
    for burst in buckets:
        passes = [slowest_medians([{"rows": r["phases"][k]} for r in results])
                  for k, name in enumerate(phases) if name == str(burst)]
        for same in zip(*passes):
            pooled = sorted(t for row in same for t in row["calls_s"])
            key = f"{same[0]['op']} {same[0]['bytes']}"
            row = rows.setdefault(key, {"wire_ms": round(_wire_ms(spec, same[0]["op"], same[0]["bytes"]), 2)})
            row[str(burst)] = {"median_ms": round(statistics.median(pooled) * 1e3, 2),
                               "fastest_ms": round(pooled[0] * 1e3, 2)}
    print(json.dumps({"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "nice": os.nice(0),
                      "load": load, "rate_mbps": args.rate, "buckets_bytes": buckets, "rounds": args.rounds,
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
