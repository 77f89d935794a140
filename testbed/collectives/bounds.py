"""Lower bounds on collective time: bytes that must cross a bottleneck at full bandwidth.

No algorithm can beat :func:`lower_bound`; tests check every algorithm against
it. Two kinds of bottleneck are used (the bound is the larger):

- injection: each rank must send and receive a minimum number of bytes
  through its own links (all-reduce: (n-1)/n*S each way; all-gather: receive
  (n-1)/n*S; reduce-scatter: send (n-1)/n*S; all-to-all: (n-1)/n*S each way;
  broadcast: the root sends S, every other rank receives S), divided by the
  sum of the rank's link bandwidths per direction;
- cut: for every switch whose subtree holds some but not all of the group
  (hierarchies), and for the halves of each torus dim (bisection), the bytes
  that must enter or leave that side (all-reduce: S each way, since every
  output element depends on inputs on both sides) divided by the bandwidth of
  the links crossing the cut.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from testbed.collectives.ops import Op, parse_op
from testbed.topology import Form, Topology

__all__ = ["lower_bound", "injection_bandwidth", "subtree_cuts", "torus_cuts"]


def injection_bandwidth(topology: Topology, device: int) -> float:
    """Sum of the bandwidths (per direction) of the links at ``device``."""
    return sum(data["bandwidth"] for _, _, data in topology.graph.edges(device, data=True))


def _rank_needs(op: Op, n: int, nbytes: float, is_root: bool, is_peer: bool) -> tuple[float, float]:
    """(bytes a rank must send, bytes it must receive)."""
    share = (n - 1) / n * nbytes
    if op is Op.ALL_REDUCE or op is Op.ALL_TO_ALL:
        return share, share
    if op is Op.ALL_GATHER:
        return nbytes / n, share
    if op is Op.REDUCE_SCATTER:
        return share, nbytes / n
    if op is Op.BROADCAST:
        return (nbytes, 0.0) if is_root else (0.0, nbytes)
    return (nbytes if is_root else 0.0), (nbytes if is_peer else 0.0)


def _crossing(topology: Topology, nodes: set[object]) -> float:
    return sum(data["bandwidth"] for u in nodes for _, v, data in topology.graph.edges(u, data=True) if v not in nodes)


def torus_cuts(topology: Topology) -> list[tuple[frozenset[int], float]]:
    """(devices below the middle of a dim, bandwidth per direction across that cut) for each torus dim."""
    if topology.form is not Form.TORUS:
        return []
    cuts = []
    for i, level in enumerate(topology.levels):
        if level.size < 2:
            continue
        devices = {d for d in range(topology.num_devices) if topology.coords(d)[i] < level.size // 2}
        cuts.append((frozenset(devices), _crossing(topology, set(devices))))
    return cuts


def subtree_cuts(topology: Topology) -> list[tuple[frozenset[int], float]]:
    """(devices under a switch, bandwidth per direction of the links leaving its subtree), levels form only."""
    if topology.form is not Form.LEVELS or len(topology.levels) < 2:
        return []
    cuts = []
    block = 1
    for k, level in enumerate(topology.levels[:-1]):
        block *= level.size
        for start in range(0, topology.num_devices, block):
            devices = set(range(start, start + block))
            nodes: set[object] = set(devices)
            for j in range(k + 1):
                inner = math.prod(l.size for l in topology.levels[: j + 1])
                nodes.update(f"{topology.levels[j].name}{d // inner}" for d in devices)
            cuts.append((frozenset(devices), _crossing(topology, nodes)))
    return cuts


def _cut_needs(op: Op, n: int, m: int, nbytes: float, has_root: bool, has_peer: bool) -> tuple[float, float]:
    """(bytes that must leave, bytes that must enter) a subtree holding m of the n ranks."""
    if op is Op.ALL_REDUCE:
        return nbytes, nbytes
    if op is Op.ALL_GATHER:
        return m / n * nbytes, (n - m) / n * nbytes
    if op is Op.REDUCE_SCATTER:
        return (n - m) / n * nbytes, m / n * nbytes
    if op is Op.ALL_TO_ALL:
        both = m * (n - m) / n * nbytes
        return both, both
    if op is Op.BROADCAST:
        return (nbytes, 0.0) if has_root else (0.0, nbytes)
    return (nbytes if has_root and not has_peer else 0.0), (nbytes if has_peer and not has_root else 0.0)


def lower_bound(topology: Topology, op: Op | str, group: Sequence[int], nbytes: float,
                root: int = 0, peer: int | None = None) -> float:
    """Seconds the bytes that must cross the group's bottleneck need at full bandwidth (a true lower bound).

    ``root``/``peer`` are ranks (indices into ``group``) for broadcast and send.
    """
    op = parse_op(op)
    n = len(group)
    if n <= 1 or nbytes <= 0:
        return 0.0
    peer = (root + 1) % n if peer is None else peer
    bound = 0.0
    for rank, device in enumerate(group):
        send, recv = _rank_needs(op, n, nbytes, rank == root, rank == peer)
        bandwidth = injection_bandwidth(topology, device)
        bound = max(bound, send / bandwidth, recv / bandwidth)
    members = set(group)
    root_device, peer_device = group[root], group[peer]
    for block, bandwidth in _level_cuts(topology):
        # levels form: every subtree of a level is alike, so count members per subtree instead of intersecting sets
        counts: dict[int, int] = {}
        for d in group:
            counts[d // block] = counts.get(d // block, 0) + 1
        for index, inside in counts.items():
            if 0 < inside < n and bandwidth > 0:
                out, into = _cut_needs(op, n, inside, nbytes, root_device // block == index,
                                       peer_device // block == index)
                bound = max(bound, out / bandwidth, into / bandwidth)
    for devices, bandwidth in _cached_cuts(topology):
        inside = len(members & devices)
        if 0 < inside < n and bandwidth > 0:
            out, into = _cut_needs(op, n, inside, nbytes, root_device in devices, peer_device in devices)
            bound = max(bound, out / bandwidth, into / bandwidth)
    return bound


def _cached_cuts(topology: Topology) -> list[tuple[frozenset[int], float]]:
    # Stored beside the topology's route cache: a pure function of the topology. Levels-form subtree cuts are
    # in _level_cuts (one per level, by symmetry), so only torus cuts are listed here.
    key = ("__torus_cuts__",)
    cuts = topology._routes.get(key)
    if cuts is None:
        cuts = torus_cuts(topology)
        topology._routes[key] = cuts
    return cuts


def _level_cuts(topology: Topology) -> list[tuple[int, float]]:
    """(devices per subtree, bandwidth leaving one subtree) per inner level of a hierarchy; every subtree of a
    level has the same links (the levels form is symmetric), so the first one's stands for all."""
    key = ("__level_cuts__",)
    cuts = topology._routes.get(key)
    if cuts is None:
        cuts = []
        if topology.form is Form.LEVELS and len(topology.levels) >= 2:
            block = 1
            for k, level in enumerate(topology.levels[:-1]):
                block *= level.size
                devices = set(range(block))
                nodes: set[object] = set(devices)
                for j in range(k + 1):
                    inner = math.prod(l.size for l in topology.levels[: j + 1])
                    nodes.update(f"{topology.levels[j].name}{d // inner}" for d in devices)
                cuts.append((block, _crossing(topology, nodes)))
        topology._routes[key] = cuts
    return cuts
