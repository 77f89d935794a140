"""What the shaped links and the nodes' TCP did during one collective: tbf drops and the TCP retransmits per call.

For each link rate (Mb/s) and op, on an emulated ``eth-4x2`` cluster (:mod:`testbed.cluster`, one cluster per
rate) this runs one job (one worker per node) timing a 4 KiB all-gather (opens the connections) and ``--repeats``
calls of the op at ``--bytes``, and reads, before and after the job, every link end's ``tc -s qdisc`` counters
(tbf: bytes sent, drops, overlimits, requeues) and each node namespace's TCP counters (``nstat -az``:
segments out, retransmitted, timeouts, tail-loss probes, fast retransmits). The differences, with the calls'
times (slowest process per call) and the 1-minute load average, are printed as one JSON object.

Why: the 30 Mb/s all-gather at 1-16 MiB was measured 7-15% slower than predicted in runs 17 and 18 while the
all-reduce and the other rates were within a few %; this shows whether the links dropped packets (and TCP
recovered by timeouts) during those calls, and what changes when the nodes' TCP settings (``--sysctl``), the
switch ends' rate (``--switch-factor``) or the links' queue (``--latency-ms``, tbf's latency) change. Needs
root or CAP_NET_ADMIN. docs/cluster.md, "The 30 Mb/s all-gather at 1-16 MiB", has the results and commands.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from testbed.cluster import cluster_spec, netns
from testbed.cluster.spec import namespace_name
from testbed.runner.on_cluster import cluster_launch, slowest_medians
from testbed.topology.io import load_topology

TCP_COUNTERS = ("TcpOutSegs", "TcpRetransSegs", "TcpExtTCPTimeouts", "TcpExtTCPLossProbes",
                "TcpExtTCPFastRetrans", "TcpExtTCPSlowStartRetrans", "TcpExtTCPLostRetransmit",
                "TcpExtTCPSpuriousRTOs", "TcpExtTCPSackRecovery", "TcpExtTCPRenoRecovery")


def _qdiscs(ns: str) -> dict[str, dict]:
    out = subprocess.run(["tc", "-n", ns, "-s", "-j", "qdisc", "show"], capture_output=True, text=True, check=True)
    return {q["dev"]: q for q in json.loads(out.stdout) if q.get("kind") == "tbf"}


def _tcp(ns: str) -> dict[str, int]:
    out = subprocess.run(["ip", "netns", "exec", ns, "nstat", "-az", "-j"], capture_output=True, text=True,
                         check=True)
    kernel = json.loads(out.stdout)["kernel"]
    return {k: int(kernel.get(k, 0)) for k in TCP_COUNTERS}


def _snapshot(spec, owner: str) -> dict:
    fabric = namespace_name(spec.name, owner, "sw")
    nodes = [namespace_name(spec.name, owner, n.role) for n in spec.nodes]
    links = {}
    for ns in [fabric, *nodes]:
        for dev, q in _qdiscs(ns).items():
            links[f"{ns.rsplit('-', 1)[-1]}:{dev}"] = {k: q.get(k, 0) for k in ("bytes", "packets", "drops",
                                                                                  "overlimits", "requeues")}
    return {"links": links, "tcp": {ns.rsplit('-', 1)[-1]: _tcp(ns) for ns in nodes}}


def _minus(after: dict, before: dict) -> dict:
    if isinstance(after, dict):
        return {k: _minus(v, before.get(k, 0)) for k, v in after.items()}
    return after - before


def probe(rate_mbps: float, op: str, nbytes: int, repeats: int, sysctls: tuple[str, ...] = (),
          switch_factor: float = 1.0, latency_ms: float = 50.0) -> dict:
    """One job on a fresh cluster at ``rate_mbps``: the calls' times and the counters' differences.
    ``sysctls`` (``key=value``) are set in every node's namespace first; ``switch_factor`` multiplies the rate of
    the switch's ends of the links (towards the nodes), leaving one shaped hop on each path; ``latency_ms``
    sets every link end's tbf ``latency`` (the queue: this many ms of the rate; as built 50 ms)."""
    topology = load_topology("eth-4x2")
    spec = cluster_spec(topology, name="qprobe", scale=rate_mbps * 1e6 / (topology.levels[-1].bandwidth * 8))
    with netns.ephemeral(spec) as owner:
        for i, _ in enumerate(spec.nodes):
            for setting in sysctls:
                subprocess.run(["ip", "netns", "exec", netns.node_namespace(spec, owner, i), "sysctl", "-q", "-w",
                                setting], check=True)
        fabric = namespace_name(spec.name, owner, "sw")
        for link in spec.links if (switch_factor, latency_ms) != (1.0, 50.0) else ():
            lower = netns.node_namespace(spec, owner, [n.role for n in spec.nodes].index(link.lower))
            for ns, dev, rate in ((lower, link.lower_dev, int(link.rate_bps)),
                                  (fabric, link.upper_dev, int(link.rate_bps * switch_factor))):
                subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate}bit",
                                "burst", str(netns.bucket_bytes(rate, spec.mtu)), "latency", f"{latency_ms}ms"],
                               check=True)
        load, before = os.getloadavg()[0], _snapshot(spec, owner)
        started = time.perf_counter()
        results = cluster_launch(spec, owner, {"body": "collective",
                                               "calls": [["all_gather", 4096, 3], [op, nbytes, repeats]]},
                                 timeout_s=600)
        seconds = time.perf_counter() - started
        delta = _minus(_snapshot(spec, owner), before)
    row = slowest_medians(results)[-1]
    links = delta["links"]
    tcp = {k: sum(node[k] for node in delta["tcp"].values()) for k in TCP_COUNTERS}
    return {"rate_mbps": rate_mbps, "op": op, "sysctls": list(sysctls), "switch_factor": switch_factor,
            "latency_ms": latency_ms, "bytes": nbytes, "calls_s": row["calls_s"],
            "median_s": row["measured_s"], "ok": row["ok"], "job_s": seconds,
            "load_before": load, "load_after": os.getloadavg()[0],
            "drops": sum(v["drops"] for v in links.values()), "tcp": tcp, "links": links,
            "bucket_bytes": netns.bucket_bytes(spec.links[0].rate_bps, spec.mtu)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="10,30,100", help="link rates in Mb/s (default 10,30,100)")
    parser.add_argument("--ops", default="all_gather,all_reduce")
    parser.add_argument("--bytes", type=int, default=2**20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                        help="set in every node's namespace before the job (repeatable)")
    parser.add_argument("--switch-factor", type=float, default=1.0,
                        help="the switch ends' rate x this (default 1: both ends shaped alike, as built)")
    parser.add_argument("--latency-ms", type=float, default=50.0,
                        help="every link end's tbf latency, the queue in ms of the rate (default 50, as built)")
    args = parser.parse_args(argv)
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        for op in args.ops.split(","):
            rows.append(probe(rate, op, args.bytes, args.repeats, tuple(args.sysctl),
                              args.switch_factor, args.latency_ms))
            print(json.dumps({k: rows[-1][k] for k in ("rate_mbps", "op", "median_s", "drops", "tcp",
                                                         "load_before")}), file=sys.stderr, flush=True)
    print(json.dumps({"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "nice": os.nice(0),
                      "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
