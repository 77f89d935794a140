"""Lower bounds on collective time: bytes that must cross a bottleneck at full bandwidth.

No algorithm can beat :func:`lower_bound`; tests check every algorithm against
it. Two kinds of bottleneck are used (the bound is the larger):

- injection: each rank must send and receive a minimum number of bytes
  through its own links (all-reduce: (n-1)/n*S each way -- on a torus, where
  only ranks can add, 2(n-1)/n*S sent on average: one-way gossip needs 2n-2
  messages per element (Harary & Schwenk 1974), so the ranks together send
  2(n-1)*S over the sum of their injection bandwidths; all-gather: receive
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

import numpy as np

from testbed.collectives.ops import Op, parse_op
from testbed.topology import Form, Topology

__all__ = ["lower_bound", "injection_bandwidth", "max_injection_bandwidth", "subtree_cuts", "torus_cuts", "distinct_groups"]


def injection_bandwidth(topology: Topology, device: int) -> float:
    """Sum of the bandwidths (per direction) of the links at ``device``."""
    if topology.form is Form.TORUS:  # from the levels: a device's links are its neighbours along each dim
        total = 0.0
        for c, level in zip(topology.coords(device), topology.levels):
            if level.size == 2 or (level.switched and level.size > 1):  # one link (a slice's: to the DCN switch)
                total += level.bandwidth
            elif level.size > 2:
                total += level.bandwidth * (2 if level.wraparound or 0 < c < level.size - 1 else 1)
        return total
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
    return [(frozenset(devices.tolist()), bandwidth) for _, devices, bandwidth in _torus_halves(topology)]


def _torus_halves(topology: Topology) -> list[tuple[int, np.ndarray, float]]:
    """(dim, devices with coordinate below size // 2 along it, bandwidth crossing) per torus dim of size >= 2.

    The cut crosses one link per line of the dim, two with wraparound (size > 2); across the slices' switch
    (on the far side) the uplinks of the near half, ``size // 2`` per line.
    """
    if topology.form is not Form.TORUS:
        return []
    sizes = np.asarray([l.size for l in topology.levels], dtype=np.int64)
    strides = np.concatenate([[1], np.cumprod(sizes)[:-1]]).astype(np.int64)
    ids = np.arange(topology.num_devices, dtype=np.int64)
    out = []
    for i, level in enumerate(topology.levels):
        if level.size < 2:
            continue
        lines = topology.num_devices // level.size
        crossings = level.size // 2 if level.switched else 2 if level.wraparound and level.size > 2 else 1
        below = ids[ids // strides[i] % level.size < level.size // 2]
        out.append((i, below, float(level.bandwidth) * crossings * lines))
    return out


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
    injection = _injection(topology, group)
    others = np.delete(injection, sorted({root, peer}))
    # The root, the peer, and the slowest of the rest (every other rank needs the same bytes).
    for rank, bandwidth in ((root, injection[root]), (peer, injection[peer]),
                            *(((-1, float(others.min())),) if len(others) else ())):
        send, recv = _rank_needs(op, n, nbytes, rank == root, rank == peer)
        bound = max(bound, send / bandwidth, recv / bandwidth)
    if op is Op.ALL_REDUCE and topology.form is Form.TORUS:
        # Only ranks add on a torus: one-way gossip sends every element 2(n-1) times in all.
        bound = max(bound, 2 * (n - 1) * nbytes / float(injection.sum()))
    root_device, peer_device = group[root], group[peer]
    members = np.asarray(group, dtype=np.int64)
    for block, bandwidth in _level_cuts(topology):
        # levels form: every subtree of a level is alike, so count members per subtree instead of intersecting
        # sets; subtrees alike in (members, holds root, holds peer) need the same bytes, so each such kind once
        subtrees, counts = np.unique(members // block, return_counts=True)
        kinds = {(int(inside), int(index) == root_device // block, int(index) == peer_device // block)
                 for index, inside in zip(subtrees, counts)}
        for inside, has_root, has_peer in kinds:
            if 0 < inside < n and bandwidth > 0:
                out, into = _cut_needs(op, n, inside, nbytes, has_root, has_peer)
                bound = max(bound, out / bandwidth, into / bandwidth)
    if topology.form is Form.TORUS:
        devices = np.asarray(group, dtype=np.int64)
        roots = np.asarray([group[root], group[peer]], dtype=np.int64)
        for level, strides, bandwidth in _cached_cuts(topology):
            size = topology.levels[level].size
            below = devices // strides % size < size // 2
            inside = int(below.sum())
            if 0 < inside < n and bandwidth > 0:
                has_root, has_peer = (bool(x) for x in roots // strides % size < size // 2)
                out, into = _cut_needs(op, n, inside, nbytes, has_root, has_peer)
                bound = max(bound, out / bandwidth, into / bandwidth)
    return float(bound)


def distinct_groups(topology: Topology, groups: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """The groups of ``groups`` whose :func:`lower_bound` may differ, one of each kind (all of them off a hierarchy).

    In a levels hierarchy a group's bound depends only on its ranks' injection bandwidths and, per level, on
    which of its ranks share a subtree (every subtree of a level has the same links): two groups alike in both
    have equal bounds, so the slowest of ``groups`` is the slowest of these representatives. A search meets
    thousands of translated groups of one axis; this times one.
    """
    if topology.form is not Form.LEVELS or len(groups) < 2:
        return groups
    members = np.asarray(groups, dtype=np.int64)
    keys = [_all_injection(topology)[members]]
    for block, _ in _level_cuts(topology):
        subtree = members // block
        keys.append((subtree - subtree[:, :1]).astype(float))
    # Each kind's first group, by the rows' bytes (np.unique over rows sorts a structured view: 4x slower here).
    first: dict[bytes, int] = {}
    for i, row in enumerate(map(bytes, np.ascontiguousarray(np.concatenate(keys, axis=1)))):
        first.setdefault(row, i)
    return tuple(groups[i] for i in sorted(first.values()))


def _injection(topology: Topology, group: Sequence[int]) -> np.ndarray:
    """Injection bandwidth of each rank (a torus's devices differ only at the open ends of mesh dims)."""
    if topology.form is Form.TORUS and all(l.wraparound or l.switched or l.size <= 2 for l in topology.levels):
        return np.full(len(group), injection_bandwidth(topology, group[0]))
    return _all_injection(topology)[np.asarray(group, dtype=np.int64)]


def _all_injection(topology: Topology) -> np.ndarray:
    """Every device's injection bandwidth, read off the graph once and stored beside the topology's route cache
    (a search meets thousands of groups of one topology)."""
    key = ("__injection__",)
    cached = topology._routes.get(key)
    if cached is None:
        cached = np.asarray([injection_bandwidth(topology, d) for d in range(topology.num_devices)], dtype=float)
        topology._routes[key] = cached
    return cached


def max_injection_bandwidth(topology: Topology) -> float:
    """The largest injection bandwidth of any device: a group's rank moves its bytes no faster than this."""
    return float(_all_injection(topology).max())


def _cached_cuts(topology: Topology) -> list[tuple[int, int, float]]:
    """(level, stride, bandwidth across the middle) per torus dim: a device is below the cut when its
    coordinate ``id // stride % size`` is under ``size // 2``. Stored beside the topology's route cache."""
    key = ("__torus_cuts__",)
    cuts = topology._routes.get(key)
    if cuts is None:
        strides = [math.prod(l.size for l in topology.levels[:i]) for i in range(len(topology.levels))]
        cuts = [(level, strides[level], bandwidth) for level, _, bandwidth in _torus_halves(topology)]
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
