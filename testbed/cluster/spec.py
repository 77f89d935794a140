"""An emulated cluster's plan: which namespaces, bridges, links, addresses and rates a topology becomes.

Pure: a :class:`ClusterSpec` is computed from a topology's levels and a
scale factor, with no I/O; :mod:`testbed.cluster.netns` turns it into Linux
network namespaces, veth pairs, bridges and ``tbf`` shaping.

How a levels topology maps onto one machine:

- the leading levels whose links are not a network (NVLink, NVSwitch, PCIe,
  a host's memory) are *inside a node*: a node is one network namespace and
  later one worker process holding those devices; its devices talk over the
  namespace's loopback, which is not shaped;
- every following level (Ethernet, InfiniBand, DCN) is a *switch level*:
  each group of it is one Linux bridge, and each member (a node, or an inner
  switch) reaches it over one veth pair shaped to the level's bandwidth times
  ``scale``, in both directions. A level with ``attach: device`` (one NIC per
  device) becomes one link carrying the node's NICs together, so the
  emulated topology the simulator prices (:meth:`ClusterSpec.emulated_topology`)
  says ``attach: switch`` with that aggregate bandwidth.

Latency is not emulated: this kernel has no ``netem``. The links keep only
the latency the host's TCP stack itself adds, which ``emulated_topology``
takes as a measured value (``hop_latency_s``), not the topology's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from testbed.errors import InputError
from testbed.collectives.gloo import GLOO_ALGORITHMS, NETWORK_KINDS  # re-exported: the cluster's view of them
from testbed.topology import Topology
from testbed.topology.parts import Form, Level, LinkKind

__all__ = ["PREFIX", "check_name", "MIN_RATE_BPS", "MAX_RATE_BPS", "NETWORK_KINDS", "GLOO_ALGORITHMS", "NodeSpec", "ShapedLink", "ClusterSpec", "cluster_spec",
           "goodput_fraction",
           "namespace_name", "parse_namespace"]

#: Every namespace this project creates starts with it; ``down --all`` and leftover cleanup look for it.
PREFIX = "tbc"
#: The test range the nodes' addresses come from (RFC 2544 benchmarking; each cluster's namespaces are
#: isolated stacks, so clusters may reuse it).
SUBNET = "198.18.0"
_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")
#: The slowest link rate (bits/s) a cluster's links are shaped to: tbf's rate is whole bytes/s and a link of
#: 8 kb/s already takes 1.5 s per full frame.
MIN_RATE_BPS = 8e3
#: The fastest: tbf's queue limit (50 ms of the rate plus the bucket, testbed.cluster.queue) is a 32-bit byte
#: count in the kernel, which 100 Gb/s keeps well under (625 MB); tc refuses limits past 4 GiB (about 680 Gb/s).
MAX_RATE_BPS = 1e11
#: Bytes on the wire (what tbf counts: Ethernet header + IP packet) per TCP packet beyond the MTU's payload.
_ETH_HEADER = 14
_TCPIP_HEADERS = 20 + 20 + 12  # IPv4, TCP, TCP timestamps option (Linux default)


def check_name(name: object, field: str = "name") -> str:
    """``name`` if it is a cluster name (1-12 lowercase letters and digits, a letter first), else InputError."""
    if not isinstance(name, str) or not _NAME.match(name):
        shown = repr(name)[:40]
        raise InputError(f"a cluster name is 1-12 lowercase letters and digits starting with a letter, got {shown}",
                         field=field)
    return name


def goodput_fraction(mtu: int) -> float:
    """TCP payload bytes per byte tbf counts on a link of this MTU (headers, not a fit: 1448/1514 at 1500)."""
    return (mtu - _TCPIP_HEADERS) / (mtu + _ETH_HEADER)


def namespace_name(cluster: str, owner: str, role: str) -> str:
    """``tbc-<cluster>-<owner>-<role>``: owner is ``keep`` or ``<pid>x<start time>`` of the owning process."""
    return f"{PREFIX}-{cluster}-{owner}-{role}"


def parse_namespace(name: str) -> tuple[str, str, str] | None:
    """(cluster, owner, role) of one of this project's namespace names, else None."""
    parts = name.split("-")
    if len(parts) != 4 or parts[0] != PREFIX:
        return None
    return parts[1], parts[2], parts[3]


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSpec:
    """One node: its namespace role, its address and the devices its worker holds."""

    index: int
    role: str
    address: str
    devices: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ShapedLink:
    """A veth pair from ``lower`` (a node role or a bridge) up to ``bridge``, shaped both ways at ``rate_bps``.

    ``lower_dev``/``upper_dev`` are the two ends' interface names (``eth0`` in a node's namespace; ``pN``
    ports and ``uN`` uplinks in the fabric namespace, at most 15 characters).
    """

    lower: str
    lower_dev: str
    bridge: str
    upper_dev: str
    level: str
    rate_bps: float

    def __post_init__(self) -> None:
        if not self.rate_bps > 0:
            raise InputError(f"a link's rate must be positive, got {self.rate_bps}", field=f"link {self.lower_dev}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    """Namespaces, bridges and shaped links of one emulated cluster (all in one fabric namespace but the nodes)."""

    name: str
    topology: Topology
    scale: float
    mtu: int
    nodes: tuple[NodeSpec, ...]
    bridges: tuple[str, ...]
    links: tuple[ShapedLink, ...]
    inner_levels: int

    def __post_init__(self) -> None:
        check_name(self.name)
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale) and self.scale > 0):
            raise InputError(f"must be a positive factor (0.01 emulates 100 Gb/s at 1 Gb/s), got {self.scale!r}",
                             field="scale")
        if not 576 <= self.mtu <= 65535:
            raise InputError(f"must be 576..65535 bytes, got {self.mtu}", field="mtu")

    @property
    def devices_per_node(self) -> int:
        return len(self.nodes[0].devices)

    def coordinator(self, port: int) -> str:
        """Node 0's address and ``port``: where the job's coordinator listens."""
        return f"{self.nodes[0].address}:{port}"

    def emulated_topology(self, *, inner_bandwidth: float, inner_latency_s: float, hop_latency_s: float,
                          overhead_s: float | None = None, link_efficiency: float = 1.0,
                          launch_s: float | None = None) -> Topology:
        """The topology this cluster is, for the simulator to price.

        Switch levels get the shaped rate's TCP goodput (bytes/s) with one
        uplink per member (``attach: switch``) and ``hop_latency_s`` (the
        host's measured one-way TCP latency per hop; no delay is emulated).
        The levels inside a node become one ``host`` level at
        ``inner_bandwidth`` and ``inner_latency_s`` (the namespace's
        measured loopback TCP), as gloo's ranks of one process talk over
        loopback (:mod:`testbed.cluster.probe` measures all three).
        ``overhead_s`` (a measured per-round cost) and ``launch_s`` (per
        call) replace the calibration's when given; ``link_efficiency``
        (default 1) is the share of the goodput a job gets from the links,
        fitted on the host by ``benchmarks/emulated_cluster.py``. Its
        calibration has ``collectives.rounds_overlap``: gloo's rings overlap a
        round's host cost with its wire (:mod:`testbed.collectives.gloo`).
        """
        if not 0 < link_efficiency <= 1:
            raise InputError(f"must be in (0, 1], got {link_efficiency}", field="link_efficiency")
        levels = self.topology.levels
        inner = Level(name="node", size=self.devices_per_node, bandwidth=inner_bandwidth,
                      latency=inner_latency_s, kind=LinkKind.HOST)
        net = []
        for level in levels[self.inner_levels:]:
            rate = next(l.rate_bps for l in self.links if l.level == level.name)
            goodput = rate / 8 * goodput_fraction(self.mtu) * link_efficiency
            net.append(replace(level, bandwidth=goodput, latency=hop_latency_s,
                               attach="switch", in_network_reduction=None))
        # gloo runs here, its rounds' host cost hidden under their wire (testbed.collectives.gloo), the form
        # testbed.cluster.fit fits the per-round cost in.
        measured = {k: v for k, v in (("overhead_s", overhead_s), ("launch_s", launch_s)) if v is not None}
        calibration = self.topology.calibration.updated(collectives={**measured, "rounds_overlap": True})
        return replace(self.topology, name=f"{self.topology.name}-emulated-{self.name}",
                       levels=(inner, *net), calibration=calibration)

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "topology": self.topology.name, "scale": self.scale, "mtu": self.mtu,
                "nodes": [{"index": n.index, "role": n.role, "address": n.address, "devices": list(n.devices)}
                          for n in self.nodes],
                "bridges": list(self.bridges),
                "links": [{"lower": l.lower, "lower_dev": l.lower_dev, "bridge": l.bridge, "upper_dev": l.upper_dev,
                           "level": l.level, "rate_bps": l.rate_bps} for l in self.links]}


def _inner_levels(topology: Topology) -> int:
    """How many leading levels lie inside a node (their links are no network)."""
    count = 0
    for level in topology.levels:
        if level.kind in NETWORK_KINDS:
            break
        count += 1
    rest = topology.levels[count:]
    if not rest:
        raise InputError(f"{topology.name} has no network level (ethernet, infiniband or dcn) to emulate: its "
                         f"levels are {', '.join(f'{l.name} ({l.kind})' for l in topology.levels)}", field="topology")
    odd = [l.name for l in rest if l.kind not in NETWORK_KINDS]
    if odd:
        raise InputError(f"levels {odd} of {topology.name} are inside a node but sit outside its network levels; "
                         "an emulated cluster needs the node's levels first", field="topology")
    return count


def _check_rates(topology: Topology, unit_bps: float, scale: float) -> None:
    """A link of ``unit_bps`` at scale 1 shaped within what tc shapes (:data:`MIN_RATE_BPS`..:data:`MAX_RATE_BPS`)
    at ``scale``, else InputError saying the scales that keep this link in range."""
    if MIN_RATE_BPS <= unit_bps * scale <= MAX_RATE_BPS:
        return
    raise InputError(f"{scale:g} shapes a link of {topology.name} ({unit_bps:.3g} bit/s) at "
                     f"{unit_bps * scale:.3g} bit/s, but tc shapes {MIN_RATE_BPS:.0f} bit/s to {MAX_RATE_BPS:.0e} "
                     f"bit/s: give a scale from {MIN_RATE_BPS / unit_bps:.3g} to {MAX_RATE_BPS / unit_bps:.3g}",
                     field="scale")


def cluster_spec(topology: Topology, *, name: str, scale: float, mtu: int = 1500) -> ClusterSpec:
    """The emulated cluster of a levels topology: one namespace per node, a bridge per switch.

    Link rates are the levels' bandwidths (bytes/s, times the devices under
    each member for ``attach: device``) in bits/s times ``scale``.
    """
    if topology.form is not Form.LEVELS:
        raise InputError(f"{topology.name} is a {topology.form} topology; an emulated cluster is built from a "
                         "levels topology (nodes on switches)", field="topology")
    if isinstance(scale, bool) or not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise InputError(f"must be a positive factor (0.01 emulates 100 Gb/s at 1 Gb/s), got {scale!r}", field="scale")
    inner = _inner_levels(topology)
    per_node = math.prod(l.size for l in topology.levels[:inner])
    count = topology.num_devices // per_node
    if count < 2 or count > 250:
        raise InputError(f"{topology.name} has {count} node(s); an emulated cluster has 2..250", field="topology")
    nodes = tuple(NodeSpec(index=i, role=f"n{i}", address=f"{SUBNET}.{i + 1}",
                           devices=tuple(range(i * per_node, (i + 1) * per_node))) for i in range(count))
    bridges: list[str] = []
    links: list[ShapedLink] = []
    members = [n.role for n in nodes]  # what the current level's switches connect (nodes, then inner bridges)
    under = per_node  # devices under each member
    for depth, level in enumerate(topology.levels[inner:]):
        assert level.bandwidth is not None  # a levels topology's levels all have one (generators.hierarchical)
        unit = level.bandwidth * 8 * (under if level.attach == "device" else 1)  # bits/s at scale 1
        _check_rates(topology, unit, scale)
        rate = unit * scale
        groups = len(members) // level.size
        names = [f"b{depth}x{g}" for g in range(groups)]
        bridges.extend(names)
        for m, member in enumerate(members):
            bridge = names[m // level.size]
            lower_dev = "eth0" if depth == 0 else f"u{member}"
            links.append(ShapedLink(lower=member, lower_dev=lower_dev, bridge=bridge,
                                    upper_dev=f"p{len(links)}", level=level.name, rate_bps=rate))
        members, under = names, under * level.size
    return ClusterSpec(name=name, topology=topology, scale=float(scale), mtu=mtu, nodes=nodes,
                       bridges=tuple(bridges), links=tuple(links), inner_levels=inner)


