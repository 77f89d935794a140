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
root or CAP_NET_ADMIN. docs/cluster.md, "Rerunning the measurements", says what it measures.
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
                "TcpExtTCPSpuriousRTOs", "TcpExtTCPSackRecovery", "TcpExtTCPRenoRecovery",
                "TcpExtTCPSACKReorder", "TcpExtTCPTSReorder", "TcpExtTCPDSACKRecv", "TcpExtTCPDSACKUndo")


def _qdiscs(ns: str) -> dict[str, dict]:
    """Each link end's counters: its tbf's (the link), and with the sparse-first queue each class's bfifo
    (``sparse``: class 10:1, ``bulk``: 10:2), whose packets say how the threshold classified them."""
    out = subprocess.run(["tc", "-n", ns, "-s", "-j", "qdisc", "show"], capture_output=True, text=True, check=True)
    found: dict[str, dict] = {}
    for q in json.loads(out.stdout):
        if q.get("kind") == "tbf":
            found[q["dev"]] = q
        elif q.get("kind") == "bfifo" and q.get("parent") in ("10:1", "10:2"):
            found[f"{q['dev']}/{'sparse' if q['parent'] == '10:1' else 'bulk'}"] = q
        elif q.get("kind") == "bfifo" and str(q.get("parent", "")).startswith("10:1"):  # --bins
            found[f"{q['dev']}/bin{q['parent'][4:]}"] = q
    return found


def _binned(spec, owner: str, sparse_below: int, bins: tuple[int, ...]) -> None:
    """Every link end as the sparse-first queue at ``sparse_below`` (:mod:`testbed.cluster.queue`), its classes
    split by IPv4 length into ``bins`` (``[0, b0), [b0, b1), ...``; class 10:1x, a bfifo each) so their counters
    give the packets' sizes: a bin under ``sparse_below`` has prio 0, one at or above it prio 1 with the bulk class
    (10:2, everything longer). The packets take the same class as with the plain threshold."""
    from testbed.cluster.queue import length_mask, queue_bytes, sparse_first_commands

    fabric = namespace_name(spec.name, owner, "sw")
    roles = [n.role for n in spec.nodes]
    for link in spec.links:
        lower = netns.node_namespace(spec, owner, roles.index(link.lower)) if link.lower in roles else fabric
        for ns, dev in ((lower, link.lower_dev), (fabric, link.upper_dev)):
            bucket = netns.bucket_bytes(link.rate_bps, spec.mtu)
            base = sparse_first_commands(ns, dev, link.rate_bps, bucket, spec.mtu, sparse_below)
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            for command in base[:2] + [c for c in base if "10:2" in c and "filter" not in c]:
                subprocess.run(command, check=True, capture_output=True)
            klass = next(c for c in base if "class" in c)
            for i, upper in enumerate(bins):
                minor = f"1{i}"
                subprocess.run([*klass[:klass.index("classid") + 1], f"10:{minor}",
                                *klass[klass.index("htb"):-1], "0" if upper <= sparse_below else "1"],
                               check=True, capture_output=True)
                subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", f"10:{minor}", "handle",
                                f"3{i}:", "bfifo", "limit", str(queue_bytes(link.rate_bps, bucket))],
                               check=True, capture_output=True)
                subprocess.run(["tc", "-n", ns, "filter", "add", "dev", dev, "parent", "10:", "protocol", "ip",
                                "prio", str(i + 1), "u32", "match", "u16", "0", f"{length_mask(upper):#06x}", "at",
                                "2", "flowid", f"10:{minor}"], check=True, capture_output=True)


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
          switch_factor: float = 1.0, latency_ms: float = 50.0, queue: str | None = None,
          sparse_below: int | None = None, bins: tuple[int, ...] = ()) -> dict:
    """One job on a fresh cluster at ``rate_mbps``: the calls' times and the counters' differences.
    ``sysctls`` (``key=value``) are set in every node's namespace first; ``switch_factor`` multiplies the rate of
    the switch's ends of the links (towards the nodes), leaving one shaped hop on each path; ``latency_ms``
    sets every link end's tbf ``latency`` (the queue: this many ms of the rate; as built 50 ms); both make every
    link end tbf's one FIFO. ``queue`` (``fifo`` or ``sparse-first``) and ``sparse_below`` reshape the links to
    that queue (default: as built, :mod:`testbed.cluster.queue`); ``bins`` splits its classes by packet length
    (:func:`_binned`), the same classification, counted per bin."""
    topology = load_topology("eth-4x2")
    spec = cluster_spec(topology, name="qprobe", scale=rate_mbps * 1e6 / (topology.levels[-1].bandwidth * 8))
    with netns.ephemeral(spec) as owner:
        for i, _ in enumerate(spec.nodes):
            for setting in sysctls:
                subprocess.run(["ip", "netns", "exec", netns.node_namespace(spec, owner, i), "sysctl", "-q", "-w",
                                setting], check=True)
        if queue or sparse_below:
            netns.reshape(spec, owner, spec.scale, queue=queue, sparse_below=sparse_below)
        if bins:
            _binned(spec, owner, sparse_below or netns.SPARSE_BELOW, bins)
        fabric = namespace_name(spec.name, owner, "sw")
        for link in spec.links if (switch_factor, latency_ms) != (1.0, 50.0) else ():
            lower = netns.node_namespace(spec, owner, [n.role for n in spec.nodes].index(link.lower))
            for ns, dev, rate in ((lower, link.lower_dev, int(link.rate_bps)),
                                  (fabric, link.upper_dev, int(link.rate_bps * switch_factor))):
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
                subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate}bit",
                                "burst", str(netns.bucket_bytes(rate, spec.mtu)), "latency", f"{latency_ms}ms"],
                               check=True)
        in_use = netns.queue_in_use(spec, owner) if not bins else {
            "kind": "sparse-first, binned", "sparse_below_bytes": sparse_below or netns.SPARSE_BELOW, "bins": bins}
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
            "latency_ms": latency_ms, "queue": in_use, "queue_asked": queue, "sparse_below_asked": sparse_below, "bytes": nbytes, "calls_s": row["calls_s"],
            "median_s": row["measured_s"], "ok": row["ok"], "job_s": seconds,
            "load_before": load, "load_after": os.getloadavg()[0],
            "drops": sum(v["drops"] for k, v in links.items() if "/" not in k), "tcp": tcp, "links": links,
            "classes": {c: {k: sum(v[k] for name, v in links.items() if name.endswith(f"/{c}"))
                            for k in ("packets", "bytes", "drops")}
                        for c in ("sparse", "bulk", *(f"bin{i}" for i in range(len(bins))))},
            "bins": list(bins),
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
    parser.add_argument("--queue", choices=("fifo", "sparse-first"), default=None,
                        help="the links' queue (default: as built, sparse-first where the kernel has htb and u32)")
    parser.add_argument("--sparse-below", type=int, default=None,
                        help="with sparse-first: IPv4 packets under this many bytes go first (default 256)")
    parser.add_argument("--bins", default="",
                        help="e.g. 128,256,512,1024: count the packets of each IPv4 length bin (under 128, 128-255, "
                             "...; longer: the bulk class), classified as with --sparse-below")
    args = parser.parse_args(argv)
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        for op in args.ops.split(","):
            rows.append(probe(rate, op, args.bytes, args.repeats, tuple(args.sysctl),
                              args.switch_factor, args.latency_ms, args.queue, args.sparse_below,
                              tuple(int(b) for b in args.bins.split(",") if b)))
            print(json.dumps({k: rows[-1][k] for k in ("rate_mbps", "op", "median_s", "drops", "tcp", "classes",
                                                         "queue", "load_before")}), file=sys.stderr, flush=True)
    print(json.dumps({"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "nice": os.nice(0),
                      "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
