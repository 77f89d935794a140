"""Build and remove an emulated cluster with ``ip`` and ``tc``: namespaces, bridges, veth pairs, tbf shaping.

Everything lives in namespaces named ``tbc-<cluster>-<owner>-<role>``
(:func:`testbed.cluster.spec.namespace_name`): one per node (``n0``, ``n1``
...) and one fabric namespace (``sw``) holding the bridges, the switch ends
of the veths and the uplinks between bridges. Veth pairs are created with
both ends already inside their namespaces, so nothing ever appears in the
machine's own namespace, and deleting a cluster's namespaces removes every
link and qdisc it had. Nodes have one address each in 198.18.0.0/24 and no
default route: the cluster cannot reach anything outside itself.

The owner is ``keep`` for a cluster made by ``testbed cluster up`` (removed
by ``down``), or ``<pid>x<start time>`` of the process that made a cluster
for one command: :func:`remove_leftovers` (run before every build) removes
clusters whose owner is gone, e.g. a parent killed with SIGKILL, and kept
clusters whose build stopped before their state file was written, together
with any process still running inside them. Only namespaces whose owner
record testbed wrote (:mod:`testbed.cluster.state`) are listed or removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from testbed.cluster.queue import (FIFO, SPARSE_BELOW, SPARSE_FIRST, fifo_commands, queue_bytes,
                                   sparse_first_commands)
from testbed.cluster import state
from testbed.cluster.signals import leaving_on_signals, signals_held
from testbed.cluster.spec import ClusterSpec, check_name, namespace_name, parse_namespace
from testbed.errors import InputError

__all__ = ["ClusterUnavailable", "bucket_bytes", "ClusterError", "privilege_problem", "unavailable", "owner_token", "owner_alive",
           "namespaces",
           "build", "reshape", "remove", "remove_leftovers", "remove_all", "clusters", "ephemeral", "node_namespace",
           "ClusterInfo", "queue_in_use"]

_NET_ADMIN = 12  # capability bit


class ClusterUnavailable(RuntimeError):
    """This process may not create network namespaces (no root, no CAP_NET_ADMIN, no ``ip``)."""


class ClusterError(InputError):
    """An ``ip``/``tc`` command failed while building or removing a cluster (exit 2, one paragraph, as bad input:
    what the machine refused is named)."""

    def __init__(self, message: str, *, field: str | None = "cluster", file: str | None = None):
        super().__init__(message, field=field, file=file)


def _capabilities() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def privilege_problem(euid: int | None = None, capabilities: int | None = None,
                      userns: str | None | bool = True) -> str | None:
    """Why this process cannot build a cluster, or None when it can (root or CAP_NET_ADMIN, and ``ip``/``tc``).

    ``euid`` and ``capabilities`` (a CapEff mask) default to this process's;
    ``userns`` is :func:`testbed.cluster.rootless.userns_problem`'s answer
    (True: ask it), so the message says whether a rootless run is possible here.
    """
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    euid = os.geteuid() if euid is None else euid
    if euid == 0 or (_capabilities() if capabilities is None else capabilities) >> _NET_ADMIN & 1:
        return None
    from testbed.cluster import rootless

    refused = rootless.userns_problem() if userns is True else userns
    missing = "creating network namespaces needs root or CAP_NET_ADMIN (this process has neither)"
    if refused:
        return f"{missing}, and there is no rootless mode here: {refused}"
    return (f"{missing}. This kernel allows unprivileged user namespaces: a one-shot `testbed collective OP "
            "--execute cluster --scale S` enters one by itself; a kept cluster (`cluster up`, `--cluster NAME`) "
            "lives only as long as the namespace, so run the whole session inside one: "
            f"`{rootless.session_recipe()}`")


def unavailable() -> str | None:
    """Why no cluster can be built here (privilege, or ``ip netns add`` refused), or None: tests skip on it."""
    problem = privilege_problem()
    if problem:
        return problem
    probe = namespace_name("probe", owner_token(), "sw")
    made = _run(["ip", "netns", "add", probe], check=False)
    _run(["ip", "netns", "delete", probe], check=False)
    if made.returncode != 0:
        return f"`ip netns add` is refused here: {made.stderr.strip()}"
    return None


def _run(args: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"`{' '.join(args)}` could not run: {exc}") from None
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # field 22, counted after the command name


def owner_token(pid: int | None = None) -> str:
    """``<pid>x<start time>`` of a process: unique while it lives, never reused by a later process."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}x{_start_time(pid)}"


def owner_alive(owner: str) -> bool:
    """Whether the owner of a cluster still runs (``keep`` always does)."""
    if owner == "keep":
        return True
    pid, _, start = owner.partition("x")
    return pid.isdigit() and _start_time(int(pid)) == start


def namespaces() -> list[str]:
    """This project's network namespaces: those named ``tbc-...`` whose owner record testbed wrote
    (:mod:`testbed.cluster.state`); another tool's namespace of the same form is never listed."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if parse_namespace(n) is not None and state.owner_record(n) is not None]


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterInfo:
    """A cluster found on the machine: its name, owner, namespaces, whether its owner still runs, and whether it
    is complete (a kept cluster has its state file; a one-command cluster always is)."""

    name: str
    owner: str
    namespaces: tuple[str, ...]
    alive: bool
    complete: bool = True
    builder_alive: bool = True

    @property
    def stale(self) -> bool:
        """Left behind: its owner is gone, or a kept cluster's build stopped before its state file was written."""
        return not self.alive or (not self.complete and not self.builder_alive)


def clusters() -> list[ClusterInfo]:
    """The clusters on this machine, from their namespaces' names and owner records."""
    found: dict[tuple[str, str], list[str]] = {}
    for ns in namespaces():
        cluster, owner, _ = parse_namespace(ns)  # type: ignore[misc]
        found.setdefault((cluster, owner), []).append(ns)
    out = []
    for (c, o), names in sorted(found.items()):
        builders = {str((state.owner_record(ns) or {}).get("builder")) for ns in names}
        complete = o != "keep" or _has_state(c)
        out.append(ClusterInfo(name=c, owner=o, namespaces=tuple(sorted(names)), alive=owner_alive(o),
                               complete=complete, builder_alive=any(owner_alive(b) for b in builders)))
    return out


def _has_state(name: str) -> bool:
    try:
        return state.state_path(name).exists()
    except InputError:
        return False


def _kill_inside(ns: str) -> None:
    """SIGKILL every process still running in namespace ``ns`` (orphaned workers of a killed parent)."""
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    for pid in (int(p) for p in out.split() if p.isdigit()):
        if pid != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _delete(names: list[str], *, made_here: bool = False) -> None:
    """Remove namespaces testbed made (their owner record checked again here, unless this process has just made
    them: ``made_here``) and their records."""
    ours = [ns for ns in names if made_here or state.owner_record(ns) is not None]
    for ns in ours:
        _kill_inside(ns)
    for ns in ours:
        if _run(["ip", "netns", "delete", ns], check=False).returncode == 0 or state.netns_inode(ns) is None:
            state.remove_owner(ns)


def remove(name: str, owner: str | None = None) -> int:
    """Remove cluster ``name`` (of ``owner``, or any owner); the number of namespaces removed."""
    check_name(name)
    names = [ns for ns in namespaces() if parse_namespace(ns)[0] == name  # type: ignore[index]
             and (owner is None or parse_namespace(ns)[1] == owner)]  # type: ignore[index]
    _delete(names)
    return len(names)


def remove_leftovers() -> list[str]:
    """Remove the clusters left behind (:attr:`ClusterInfo.stale`) and owner records of namespaces gone; their
    names."""
    stale = [c for c in clusters() if c.stale]
    _delete([ns for c in stale for ns in c.namespaces])
    for ns in state.recorded_namespaces():
        if state.netns_inode(ns) is None:
            state.remove_owner(ns)
    return [c.name for c in stale]


def remove_all() -> int:
    """Remove every cluster of this project on the machine, kept or owned; the number of namespaces removed."""
    names = namespaces()
    _delete(names)
    return len(names)


def node_namespace(spec: ClusterSpec, owner: str, index: int) -> str:
    return namespace_name(spec.name, owner, spec.nodes[index].role)


def _shape(ns: str, dev: str, rate_bps: float, mtu: int, queue: str = SPARSE_FIRST,
           sparse_below: int = SPARSE_BELOW) -> str:
    """Shape ``dev``'s egress: tbf at ``rate_bps``, a bucket of :func:`bucket_bytes`, 50 ms of queue
    (:mod:`testbed.cluster.queue`), sparse packets first where ``queue`` asks and the kernel has htb and u32;
    the queue it got (``sparse-first`` or ``fifo``). Whatever the link end had is replaced."""
    bucket = bucket_bytes(max(int(rate_bps), 8000), mtu)
    _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
    if queue == SPARSE_FIRST:
        try:
            for args in sparse_first_commands(ns, dev, rate_bps, bucket, mtu, sparse_below):
                _run(args)
            return SPARSE_FIRST
        except ClusterError:  # no htb or no u32 here: the plain FIFO, recorded by queue_in_use
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
    for args in fifo_commands(ns, dev, rate_bps, bucket):
        _run(args)
    return FIFO


def queue_in_use(spec: ClusterSpec, owner: str) -> dict[str, object]:
    """What queue the cluster's links have, read from node 0's link end: ``{"kind": "sparse-first",
    "sparse_below_bytes": N, "limit_bytes": L}``, or ``{"kind": "fifo", "limit_bytes": L, "why": ...}``."""
    ns, dev = node_namespace(spec, owner, 0), spec.links[0].lower_dev
    qdiscs = json.loads(_run(["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev]).stdout or "[]")
    bfifo = [q for q in qdiscs if q.get("kind") == "bfifo"]
    if not any(q.get("kind") == "htb" for q in qdiscs) or not bfifo:
        tbf = next((q for q in qdiscs if q.get("kind") == "tbf"), {})
        rate = tbf.get("options", {}).get("rate", 0) * 8
        return {"kind": FIFO, "limit_bytes": queue_bytes(rate, bucket_bytes(rate, spec.mtu)) if rate else None,
                "why": "tbf's one FIFO, sparse packets not served first: asked for (reshape's queue='fifo'), or "
                       "this kernel refused htb or the u32 classifier (testbed.cluster.queue)"}
    filters = json.loads(_run(["tc", "-n", ns, "-j", "filter", "show", "dev", dev, "parent", "10:"]).stdout or "[]")
    masks = [int(f["options"]["match"]["mask"], 16) & 0xFFFF for f in filters
             if "match" in f.get("options", {})]
    return {"kind": SPARSE_FIRST, "sparse_below_bytes": (~masks[0] & 0xFFFF) + 1 if masks else None,
            "limit_bytes": bfifo[0]["options"]["limit"]}


def bucket_bytes(rate_bps: float, mtu: int) -> int:
    """tbf's bucket on a link: two full frames, or 0.1 ms of the rate where that is more (above 240 Mb/s).

    The bucket is what leaves at line speed after an idle spell: tbf banks up to that many bytes of a link's
    idle time and spends them at memory speed, which a real link cannot. gloo's ring leaves its links idle
    between segments, so a larger bucket gives back part of that idle time, and more of it the larger the
    bucket is against the calls. At 100 Mb/s, load ~12, one job (``benchmarks/cluster_bucket_probe.py``,
    ``benchmarks/cluster_runs/bucket-probe-100mbps.json``): a 1 MiB all-reduce got 83%, 87% and 92% of the
    goodput (median call) with buckets of two frames, 12.5 kB (1 ms of rate, the bucket until then) and
    50 kB; a 64 KiB all-gather's fastest call took 8.1, 6.9 and 4.9 ms, its wire 4.8 ms at every bucket:
    with 50 kB its host costs hid entirely. With 1 ms of rate the bucket was two frames at 10 Mb/s but eight at
    100 Mb/s, so the rates hid different amounts of host time. Two frames at the emulated rates (10-100 Mb/s)
    is the link as it is; 0.1 ms of the rate keeps the links set "unshaped" (10 Gb/s,
    :data:`testbed.cluster.step.UNSHAPED_RATE_BPS`) from costing a timer per two frames (2.4 us there).
    """
    return max(2 * (mtu + 14), int(rate_bps / 8 * 1e-4))


def build(spec: ClusterSpec, owner: str, *, queue: str = SPARSE_FIRST) -> list[str]:
    """Create the cluster's namespaces, bridges, links and shaping; its namespaces.

    Every link end gets ``queue`` (:mod:`testbed.cluster.queue`): sparse packets first where the kernel allows,
    else, on every end alike, tbf's one FIFO (:func:`queue_in_use` says which). A failure part-way removes what
    was made and raises :class:`ClusterError`.
    """
    fabric = namespace_name(spec.name, owner, "sw")
    builder = owner_token()
    made: list[str] = []
    try:
        for ns in [fabric, *(namespace_name(spec.name, owner, n.role) for n in spec.nodes)]:
            with signals_held():  # the record and the namespace together: a signal lands before or after both
                state.write_owner(ns, builder, made=False)
                try:
                    _run(["ip", "netns", "add", ns])
                except ClusterError:
                    state.remove_owner(ns, builder)
                    raise
                made.append(ns)
                state.write_owner(ns, builder)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        for bridge in spec.bridges:
            _run(["ip", "-n", fabric, "link", "add", bridge, "mtu", str(spec.mtu), "type", "bridge"])
            _run(["ip", "-n", fabric, "link", "set", bridge, "up"])
        address = {n.role: n.address for n in spec.nodes}
        for link in spec.links:
            lower_ns = namespace_name(spec.name, owner, link.lower) if link.lower in address else fabric
            _run(["ip", "link", "add", link.lower_dev, "mtu", str(spec.mtu), "netns", lower_ns, "type", "veth",
                  "peer", "name", link.upper_dev, "mtu", str(spec.mtu), "netns", fabric])
            _run(["ip", "-n", fabric, "link", "set", link.upper_dev, "master", link.bridge])
            if link.lower in address:
                _run(["ip", "-n", lower_ns, "addr", "add", f"{address[link.lower]}/24", "dev", link.lower_dev])
            else:
                _run(["ip", "-n", fabric, "link", "set", link.lower_dev, "master", link.lower])
            for ns, dev in ((lower_ns, link.lower_dev), (fabric, link.upper_dev)):
                queue = _shape(ns, dev, link.rate_bps, spec.mtu, queue)  # a first refusal: FIFO on every end
                _run(["ip", "-n", ns, "link", "set", dev, "up"])
    except BaseException:
        with signals_held():  # a second signal does not stop the removal half-way
            _delete(made, made_here=True)
        raise
    return made


def reshape(spec: ClusterSpec, owner: str, scale: float, *, queue: str | None = None,
            sparse_below: int | None = None) -> ClusterSpec:
    """Change a built cluster's link rates in place to ``scale`` (every link end's tree replaced); the new spec.

    The queue stays what the cluster has (:func:`queue_in_use`) unless ``queue``/``sparse_below`` say otherwise.
    """
    from testbed.cluster.spec import cluster_spec

    if queue is None or sparse_below is None:
        now = queue_in_use(spec, owner)
        queue = queue or str(now["kind"])
        sparse_below = sparse_below or int(now.get("sparse_below_bytes") or SPARSE_BELOW)
    new = cluster_spec(spec.topology, name=spec.name, scale=scale, mtu=spec.mtu)
    fabric = namespace_name(spec.name, owner, "sw")
    roles = {n.role for n in spec.nodes}
    for link in new.links:
        lower_ns = namespace_name(spec.name, owner, link.lower) if link.lower in roles else fabric
        for ns, dev in ((lower_ns, link.lower_dev), (fabric, link.upper_dev)):
            queue = _shape(ns, dev, link.rate_bps, spec.mtu, queue, sparse_below)
    return new


@contextlib.contextmanager
def ephemeral(spec: ClusterSpec, *, queue: str = SPARSE_FIRST) -> Iterator[str]:
    """Build ``spec`` owned by this process for the ``with`` block (its links' ``queue``: :func:`build`); yields
    the owner token.

    Leftovers of dead owners are removed first. The cluster is removed on leaving the block, on Ctrl-C and every
    signal of :data:`testbed.cluster.signals.LEAVING_SIGNALS`; after a SIGKILL the next :func:`ephemeral` or
    ``testbed cluster up`` removes it.
    """
    problem = privilege_problem()
    if problem:
        raise ClusterUnavailable(problem)
    remove_leftovers()
    owner = owner_token()
    with leaving_on_signals():
        try:
            build(spec, owner, queue=queue)
            yield owner
        finally:
            with signals_held():
                remove(spec.name, owner)

