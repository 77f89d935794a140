"""A shaped link end's queue: tbf's rate and bucket, with sparse packets served before bulk data.

Pure: the ``tc`` commands of a link end's qdisc tree, as lists of arguments; :mod:`testbed.cluster.netns` runs
them. Two trees, the same rate, bucket and queue depth:

- **sparse first** (as built where the kernel has ``htb`` and the ``u32`` classifier)::

      tbf 1: (rate, bucket, limit)            the link: its rate and bucket, unchanged
        htb 10: (default 10:2)                 a strict priority between two classes, never the limiter
          10:1 prio 0  <- u32: IPv4 total length under SPARSE_BELOW bytes    bfifo (limit)
          10:2 prio 1  everything else                                          bfifo (limit)

- **fifo** (the fallback): tbf alone, its one FIFO of ``limit`` bytes.

Why: a Linux host's NIC is fed by a per-flow scheduler, fq_codel, most distributions' default qdisc, which
serves a flow with no packets queued ahead of the flows that keep a queue (RFC 8290 section 4, "new" and "old"
flows; tc-fq_codel(8)). On the emulated cluster the flows that keep no queue are those carrying only gloo's
48-byte rendezvous messages (NOTIFY_SEND_READY / NOTIFY_RECV_READY, ``gloo/transport/tcp/pair.cc``) and TCP's
pure acknowledgements: a ring rank's connection towards the rank it receives from carries nothing else. In
tbf's one FIFO those wait behind up to ``limit`` bytes of the node's outgoing data (50 ms of the rate), and
the sender on the other end idled (docs/cluster.md, "The links"). This kernel has
neither fq_codel nor prio, sfq or skbedit, but it has htb (strict priority between classes: ``prio``, tc-htb(8))
and u32, so the sparse flows are recognised by what their packets are, small: a pure ACK is at most 80 bytes of
IP (20 IP, 20 TCP, 40 of options), a gloo message 100 (48 bytes, TCP/IP with timestamps), while bulk data
leaves in full-MSS segments. ``SPARSE_BELOW`` (256) sits between the two: counted per length bin
(``benchmarks/cluster_qdisc_probe.py --bins 128,256,512,1024``), every job of 64 KiB or 1 MiB calls at 10, 30 and
100 Mb/s moved 1,000-1,700 packets between 128 and 1024 bytes (of 8,900-123,000), most of them its 4 KiB calls',
which load no queue, against 5,200-50,000 under 128; so any threshold from 128 to 1024 serves the same packets of
the goal's sizes first: not a fitted value.

The queue's depth is tbf's: ``QUEUE_S`` (50 ms) of the rate plus the bucket, in bytes, each class's
bfifo at that limit. Unlike fq_codel, which never reorders a flow, a small packet of a flow that has data
queued (a gloo message behind its own connection's segments) passes them; docs/cluster.md says what that costs.
"""

from __future__ import annotations

__all__ = ["QUEUE_S", "SPARSE_BELOW", "SPARSE_FIRST", "FIFO", "queue_bytes", "length_mask", "fifo_commands",
           "sparse_first_commands", "classifier_rate_bps"]

#: tbf's queue in seconds of the link's rate (its ``latency``: the longest a packet may wait; tc-tbf(8)).
QUEUE_S = 0.05
#: IPv4 packets shorter than this many bytes (total length) are served first: ACKs and gloo's messages.
SPARSE_BELOW = 256
SPARSE_FIRST = "sparse-first"
FIFO = "fifo"
#: The htb classes' rate as a multiple of the link's: far above it, so tbf alone sets the pace.
_CLASS_RATE_FACTOR = 10


def queue_bytes(rate_bps: float, bucket: int) -> int:
    """tbf's queue limit in bytes: ``QUEUE_S`` of the rate plus the bucket, what ``latency 50ms`` gives (tc-tbf(8):
    limit = rate x latency + burst)."""
    return int(rate_bps / 8 * QUEUE_S) + bucket


def length_mask(below: int) -> int:
    """The u32 mask on IPv4's total-length field that matches lengths under ``below`` (a power of two, 64-32768):
    the bits at and above ``below`` all zero."""
    if below < 64 or below > 32768 or below & (below - 1):
        raise ValueError(f"the sparse threshold must be a power of two from 64 to 32768 bytes, got {below}")
    return 0xFFFF & ~(below - 1)


def classifier_rate_bps(rate_bps: float) -> int:
    """The htb classes' rate and ceiling: ``_CLASS_RATE_FACTOR`` x the link's, never throttling what tbf lets out."""
    return int(max(rate_bps, 8000) * _CLASS_RATE_FACTOR)


def _tbf(ns: str, dev: str, rate: int, bucket: int, verb: str) -> list[str]:
    return ["tc", "-n", ns, "qdisc", verb, "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{rate}bit",
            "burst", str(bucket), "limit", str(queue_bytes(rate, bucket))]


def fifo_commands(ns: str, dev: str, rate_bps: float, bucket: int) -> list[list[str]]:
    """tbf alone on ``dev``'s egress: its one FIFO of :func:`queue_bytes`."""
    return [_tbf(ns, dev, max(int(rate_bps), 8000), bucket, "add")]


def sparse_first_commands(ns: str, dev: str, rate_bps: float, bucket: int, mtu: int,
                          sparse_below: int = SPARSE_BELOW) -> list[list[str]]:
    """tbf with an htb child: IPv4 packets under ``sparse_below`` bytes (class 10:1, prio 0) before the rest
    (10:2, prio 1), each class a bfifo of :func:`queue_bytes`; tbf's rate and bucket as in :func:`fifo_commands`."""
    rate = max(int(rate_bps), 8000)
    limit, klass = queue_bytes(rate, bucket), classifier_rate_bps(rate)
    # htb's own bucket: a millisecond of its rate or two frames, so that it never holds a packet back.
    burst = str(max(2 * (mtu + 14), klass // 8 // 1000))
    tc = ["tc", "-n", ns]
    commands = [_tbf(ns, dev, rate, bucket, "add"),
                [*tc, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "htb", "default", "2"]]
    for minor, prio in ((1, 0), (2, 1)):
        commands.append([*tc, "class", "add", "dev", dev, "parent", "10:", "classid", f"10:{minor}", "htb",
                         "rate", f"{klass}bit", "ceil", f"{klass}bit", "burst", burst, "cburst", burst,
                         "quantum", str(mtu + 14), "prio", str(prio)])
        commands.append([*tc, "qdisc", "add", "dev", dev, "parent", f"10:{minor}", "handle", f"1{minor}:",
                         "bfifo", "limit", str(limit)])
    commands.append([*tc, "filter", "add", "dev", dev, "parent", "10:", "protocol", "ip", "prio", "1", "u32",
                     "match", "u16", "0", f"{length_mask(sparse_below):#06x}", "at", "2", "flowid", "10:1"])
    return commands
