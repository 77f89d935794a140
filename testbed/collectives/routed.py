"""Routed step programs: their size before they are built, their flows, and their per-round profile.

Timing a program on a topology (:mod:`testbed.collectives.timing`) routes
every (source, destination) flow of each round over the topology's links.
This module holds that machinery and its guard:

- :func:`routed_cost` estimates the work from the program's shape, so a
  program too large to time (over :data:`MAX_ROUTED_TRANSFERS`) is refused,
  and left out of ``auto``, before anything is built;
- ring-family programs (ring, bidir_ring, torus, hierarchical, multidim) are
  counted as flows per round directly (:func:`flow_rounds`, ``O(rounds n)``),
  never built as ``O(n^2)`` chunk transfers; others are built and counted;
- :func:`profile` routes the rounds (equal rounds once) and reduces them to
  per-round envelopes of (latency, seconds per chunk byte) and per-link chunks.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from testbed.collectives.algorithms import GRID_ALGORITHMS, part_orders, step_program
from testbed.collectives.ops import Op, StepProgram, parse_op
from testbed.errors import InputError
from testbed.topology import Form, Topology

__all__ = ["MAX_ROUTED_TRANSFERS", "RING_FAMILY", "routed_cost", "routed_transfers", "ring_streams", "flow_rounds",
           "group_grid", "place_program", "program_flows", "profile", "topology_memo", "memoized", "parallel_copies"]

Link = tuple[object, object]

_MEMO: dict[int, tuple[Topology, dict]] = {}
_MEMO_TOPOLOGIES = 64

def topology_memo(topology: Topology) -> dict:
    """The memo dict of this topology object (kept with a reference, so ids are never reused); memoizing never
    changes a result."""
    entry = _MEMO.get(id(topology))
    if entry is None or entry[0] is not topology:
        if len(_MEMO) >= _MEMO_TOPOLOGIES:
            _MEMO.pop(next(iter(_MEMO)))
        entry = (topology, {})
        _MEMO[id(topology)] = entry
    return entry[1]


def memoized(topology: Topology, table: str, key, compute, limit: int = 100_000):
    """``compute()`` memoized under ``key`` in this topology's ``table`` (:func:`topology_memo`; the table emptied
    past ``limit`` entries)."""
    memo = topology_memo(topology).setdefault(table, {})
    hit = memo.get(key)
    if hit is None:
        if len(memo) > limit:
            memo.clear()
        hit = memo[key] = compute()
    return hit



# -- size before building ----------------------------------------------------------------

#: Work a routed step program may take to be timed, in transfer-hops (all its groups together): every transfer
#: is a Python object, checked, counted per round and routed hop by hop, a few microseconds per hop on one
#: core, so the limit is a few seconds and ~100 MB at most; a 16,384-rank torus all-reduce would be ~1e10.
MAX_ROUTED_TRANSFERS = 750_000

#: Algorithms whose transfers go between ring neighbours (one or two hops on a grid).
_NEIGHBOURLY = ("ring", "bidir_ring", "torus", "hierarchical", "multidim", "multislice", "line")


def routed_cost(topology: Topology, algorithm: str, group: Sequence[int], groups: int = 1,
                op: Op | str = Op.ALL_REDUCE) -> int:
    """Estimated work of timing ``algorithm``'s routed program, in transfer-hops.

    A built program costs its :func:`routed_transfers` (each checked and
    counted); then every flow of a round (a (src, dst) pair) is routed and its
    links summed, a cost per hop. Flows: ring-family programs are counted as
    flows already; halving-doubling has one per rank per round (``2 log2 n + 2``
    rounds); trees and direct exchanges about one per transfer. Hops per
    flow: 2 for ring neighbours; on a torus the mean ring distance over the
    dims the group varies along (size/4 with wraparound, size/3 without);
    twice the levels on a hierarchy; 4 on an explicit graph.
    """
    op = parse_op(op)
    transfers = routed_transfers(topology, algorithm, group, groups, op)
    n = len(group)
    if algorithm in RING_FAMILY and op in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER):
        built, flows = 0, transfers  # never built: counted as flows
    elif algorithm == "halving_doubling":
        built, flows = transfers, min(transfers, (2 * max(1, n.bit_length()) + 2) * n * groups)
    else:
        built, flows = transfers, transfers
    if algorithm in _NEIGHBOURLY or n < 2:
        hops = 2.0
    elif topology.form is Form.TORUS:
        devices = np.asarray(group, dtype=np.int64)
        hops, stride = 0.0, 1
        for level in topology.levels:
            if level.size > 1 and len(np.unique(devices // stride % level.size)) > 1:
                hops += level.size / (4 if level.wraparound else 3)
            stride *= level.size
        hops = max(hops, 1.0)
    elif topology.form is Form.LEVELS:
        hops = 2.0 * len(topology.levels)
    else:
        hops = 4.0
    return int(built + flows * hops)


def routed_transfers(topology: Topology, algorithm: str, group: Sequence[int], groups: int = 1,
                     op: Op | str = Op.ALL_REDUCE) -> int:
    """An upper bound (within a small factor) on the chunk transfers of ``algorithm``'s program for ``op``.

    Counted from the program's shape, before it is built, so refusing one costs
    nothing. Ring-family programs (ring, bidir_ring, torus, hierarchical,
    multidim) are timed from their flows, never built: one per rank, stream
    and round (``2 sum(d - 1)`` rounds for all_reduce over grid dims d). Others
    are built chunk by chunk: halving-doubling ``2 n p`` transfers (all_reduce),
    double binary trees ``32 n``, direct, one-shot and pairwise exchanges ``2 n^2``.
    Times ``groups``.
    """
    op = parse_op(op)
    n = len(group)
    if algorithm in RING_FAMILY:
        if op is Op.BROADCAST:
            count = 2 * 8 * n
        else:  # counted per (src, dst, round) flow, not per chunk (flow_rounds): rounds x n x streams
            grid = group_grid(topology, group) if algorithm in GRID_ALGORITHMS else None
            dims = grid[0] if grid else (n,)
            streams = sum(w for _, _, w in ring_streams(algorithm, dims))
            rounds = (2 if op is Op.ALL_REDUCE else 1) * sum(d - 1 for d in dims)
            count = rounds * n * streams
    elif algorithm == "halving_doubling":
        p = 1 << (max(n, 1).bit_length() - 1)
        count = 2 * n * p + 2 * n if op is Op.ALL_REDUCE else (n if op is Op.BROADCAST else n * n + n)
    elif algorithm == "double_binary_tree":
        count = 32 * n
    elif op in (Op.BROADCAST, Op.SEND):
        count = n
    else:
        count = 2 * n * n
    return count * groups


#: Algorithms built from rings along the dims of a rank grid: :func:`flow_rounds` counts their flows directly.
RING_FAMILY: tuple[str, ...] = ("ring", "bidir_ring", "torus", "hierarchical", "multidim", "multislice")


def ring_streams(algorithm: str, dims: Sequence[int]) -> list[tuple[int, list[int], int]]:
    """(direction, reduce-scatter dim order, units of the buffer) of each ring stream of a ring-family algorithm.

    ``ring`` and ``hierarchical`` have one stream (+1), ``bidir_ring`` and
    ``torus`` one each way, ``multidim`` (and ``multislice``) one each way per part's dim order,
    weighted as :func:`~testbed.collectives.algorithms.part_orders` says.
    """
    active = [d for d in range(len(dims)) if dims[d] > 1]
    if algorithm in ("multidim", "multislice"):
        orders, weights = part_orders(algorithm, dims)
        return [(direction, order, w) for order, w in zip(orders, weights) for direction in (1, -1)]
    if algorithm in ("bidir_ring", "torus"):
        return [(1, active, 1), (-1, active, 1)]
    return [(1, active, 1)]


@functools.lru_cache(maxsize=64)
def flow_rounds(op: Op, algorithm: str, n: int, dims: tuple[int, ...]
                ) -> tuple[int, tuple[tuple[tuple[int, int, int], ...], ...]] | None:
    """(pieces, rounds of (src rank, dst rank, chunks)) of a ring-family program, without building it.

    Every rank of a line holds the same number of a stream's chunks, so a
    reduce-scatter phase along a dim of ``m`` sends ``held / m`` chunks per rank
    per round for ``m - 1`` rounds (leaving that many held) and an all-gather
    phase sends ``held`` (leaving ``held * m``). The counts per (src, dst, round)
    are those of :func:`step_program`'s transfers (tested), in ``O(rounds * n)``
    instead of ``O(n^2)`` transfer objects. None for other algorithms and ops.
    """
    if algorithm not in RING_FAMILY or op not in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER):
        return None
    if math.prod(dims) != n:
        raise InputError(f"dims {list(dims)} must multiply to the rank count {n}", field="dims")
    streams = ring_streams(algorithm, dims)
    pieces = max(1, sum(w for _, _, w in streams)) * (n if op is Op.ALL_REDUCE else 1)
    strides = [math.prod(dims[:i]) for i in range(len(dims))]
    ranks = list(range(n))
    timed: list[dict[tuple[int, int], int]] = []
    for direction, order, weight in streams:
        held = weight * (1 if op is Op.ALL_GATHER else n)
        phases = ([(d, True) for d in order] if op is not Op.ALL_GATHER else []) + \
                 ([(d, False) for d in reversed(order)] if op is not Op.REDUCE_SCATTER else [])
        k = 0
        for d, scatter in phases:
            m, stride = dims[d], strides[d]
            if scatter:
                held //= m
            pairs = [(r, r + (((r // stride % m) + direction) % m - r // stride % m) * stride) for r in ranks]
            for _ in range(m - 1):
                if k == len(timed):
                    timed.append({})
                for pair in pairs:
                    timed[k][pair] = timed[k].get(pair, 0) + held
                k += 1
            if not scatter:
                held *= m
    interned: dict[tuple, tuple] = {}  # equal rounds (all of a ring phase) become one object, mapped and routed once
    rounds = (tuple((a, b, c) for (a, b), c in r.items() if a != b) for r in timed if r)
    return pieces, tuple(interned.setdefault(r, r) for r in rounds if r)



# -- groups, flows and profiles -------------------------------------------------------------

def group_grid(topology: Topology, group: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(dims, ranks in grid order) when ``group`` is a full product over topology levels, else None.

    dims are the sizes of the levels (torus dims) the group varies along, innermost first.
    """
    members = sorted(set(group))
    if len(members) != len(group) or not topology.levels:
        return None
    coords = [topology.coords(d) for d in members]
    dims = []
    for i in range(len(topology.levels)):
        values = {c[i] for c in coords}
        if len(values) > 1:
            dims.append(len(values))
    if math.prod(dims) != len(members) or len({c for c in coords}) != len(members):
        return None
    return tuple(dims) or (1,), tuple(members)


def place_program(topology: Topology, op: Op, algorithm: str, group: Sequence[int], root: int, peer: int
             ) -> tuple[StepProgram, tuple[int, ...]]:
    """The program and the device of each of its ranks."""
    if algorithm in GRID_ALGORITHMS:
        dims, ordered = group_grid(topology, group)
        return step_program(op, algorithm, len(group), dims=dims), ordered
    return step_program(op, algorithm, len(group), root=root, peer=peer), tuple(group)


class _Links:
    """Directed links numbered as routes first cross them, and routes as arrays of link numbers (memoized).

    Numbering lazily keeps a 65,536-device torus (393,216 directed links) from
    paying for links no timed program crosses.
    """

    def __init__(self, topology: Topology):
        self.topology = topology
        self.index: dict[Link, int] = {}
        self.bandwidth: list[float] = []
        self.links: list[Link] = []
        self.routes: dict[tuple[int, int], tuple[np.ndarray, float]] = {}
        self._array = np.zeros(0)

    @property
    def bandwidth_array(self) -> np.ndarray:
        if len(self._array) != len(self.bandwidth):
            self._array = np.asarray(self.bandwidth)
        return self._array

    def number(self, link: Link) -> int:
        found = self.index.get(link)
        if found is None:
            found = self.index[link] = len(self.bandwidth)
            self.bandwidth.append(float(self.topology.graph.edges[link]["bandwidth"]))
            self.links.append(link)
        return found

    def route(self, a: int, b: int) -> tuple[np.ndarray, float]:
        """(link numbers, latency seconds) of the route a -> b."""
        hit = self.routes.get((a, b))
        if hit is None:
            hops = self.topology.route(a, b)
            edges = self.topology.graph.edges
            hit = (np.fromiter((self.number(h) for h in hops), np.int64, len(hops)),
                   sum(edges[u, v]["latency"] for u, v in hops))
            self.routes[a, b] = hit
        return hit


def _links(topology: Topology) -> _Links:
    memo = topology_memo(topology)
    if "links" not in memo:
        memo["links"] = _Links(topology)
    return memo["links"]


def _round_profile(links: _Links, flows: dict[tuple[int, int], int]) -> tuple[tuple[tuple[float, float], ...], np.ndarray]:
    """(upper envelope of (latency, seconds per chunk byte) over the flows, chunks per link) of one round."""
    pairs = list(flows)
    routed = [links.route(a, b) for a, b in pairs]
    lengths = np.fromiter((len(r) for r, _ in routed), np.int64, len(routed))
    ids = np.concatenate([r for r, _ in routed])
    load = np.bincount(ids, weights=np.repeat(np.fromiter(flows.values(), float, len(pairs)), lengths),
                       minlength=len(links.bandwidth))
    per_link = load[ids] / links.bandwidth_array[ids]
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    coefs = np.maximum.reduceat(per_link, offsets)
    latencies = np.fromiter((lat for _, lat in routed), float, len(routed))
    candidates = sorted(set(zip(latencies.tolist(), coefs.tolist())), reverse=True)
    envelope, best = [], -1.0
    for latency, coef in candidates:
        if coef > best:
            envelope.append((latency, coef))
            best = coef
    return tuple(envelope), load


def program_flows(topology: Topology, op: Op, algorithm: str, group: tuple[int, ...], root: int, peer: int
                   ) -> tuple[int, list[Counter], tuple[int, ...]]:
    """(chunks per data block, per round the chunks per (src device, dst device), devices of the ranks).

    Ring-family programs are counted without being built (:func:`~testbed.collectives.algorithms.flow_rounds`);
    others are built and their transfers counted.
    """
    if algorithm in RING_FAMILY and op in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER):
        if algorithm in GRID_ALGORITHMS:
            dims, devices = group_grid(topology, group)
        else:
            dims, devices = (len(group),), tuple(group)
        pieces, rounds = flow_rounds(op, algorithm, len(group), tuple(dims))
        mapped: dict[int, Counter] = {}  # equal rounds are one object (flow_rounds interns them): map each once
        flows = [mapped.get(id(r)) or mapped.setdefault(id(r), Counter({(devices[a], devices[b]): c
                                                                        for a, b, c in r})) for r in rounds]
        return (1 if op is Op.ALL_REDUCE else len(group)) * pieces, flows, devices
    program, devices = place_program(topology, op, algorithm, group, root, peer)
    flows = []
    for round_ in program.rounds:
        counter: Counter = Counter()
        for t in round_:
            if t.src != t.dst:
                counter[devices[t.src], devices[t.dst]] += 1
        flows.append(counter)
    return program.data_blocks * program.pieces, flows, devices


def profile(topology: Topology, programs: Sequence[list[Counter]]):
    """(Counter of per-round envelopes, link -> chunks over all rounds, rounds) for programs run together.

    Rounds with the same flows (every round of a ring) are routed once: found by
    object first (flow_rounds interns equal rounds), then by content.
    """
    links = _links(topology)
    rounds_total = max((len(p) for p in programs), default=0)
    envelopes: Counter = Counter()
    totals = np.zeros(0)
    seen: dict[tuple, tuple] = {}
    by_object: dict[int, tuple] = {}  # id(round) -> (the round, its profile); holding it keeps the id its own
    for k in range(rounds_total):
        if len(programs) == 1:
            flows = programs[0][k]
        else:
            flows = Counter()
            for rounds in programs:
                if k < len(rounds):
                    flows.update(rounds[k])
        if not flows:
            continue
        hit = by_object.get(id(flows))
        if hit is None:
            signature = tuple(sorted(flows.items()))
            if signature not in seen:
                seen[signature] = _round_profile(links, flows)
            hit = by_object[id(flows)] = (flows, seen[signature])
        envelope, load = hit[1]
        envelopes[envelope] += 1
        if len(totals) < len(load):  # links numbered since (lazily) extend the totals
            totals = np.concatenate([totals, np.zeros(len(load) - len(totals))])
        totals[:len(load)] += load
    loads = {links.links[i]: float(totals[i]) for i in np.flatnonzero(totals)}
    return envelopes, loads, sum(envelopes.values())




def parallel_copies(topology: Topology, groups: Sequence[Sequence[int]]) -> bool:
    """True when the groups are translates of one another on disjoint links, so together they take one's time.

    Torus: every group varies along the same dims with the same coordinates
    there, and no two share their other (fixed) coordinates -- a
    dimension-ordered route moves only along the dims its ends differ in, so
    it stays in its group's slab. Hierarchy: every group spans the same
    positions under its own switch of the same level -- routes meet at their
    lowest common switch, so they stay in that switch's subtree. Explicit
    graphs: never (routes are searched).
    """
    if len(groups) < 2 or topology.form is Form.GRAPH or not topology.levels:
        return False
    members = np.asarray(groups, dtype=np.int64)
    sizes = np.asarray([l.size for l in topology.levels], dtype=np.int64)
    strides = np.concatenate([[1], np.cumprod(sizes)[:-1]]).astype(np.int64)
    coords = members[:, :, None] // strides % sizes  # (G, m, L)
    varies = np.any(coords != coords[:, :1, :], axis=1)  # (G, L)
    if np.any(varies != varies[0]):
        return False
    if topology.form is Form.LEVELS and varies[0].any():
        top = int(np.flatnonzero(varies[0]).max())
        varies = np.zeros_like(varies)
        varies[:, :top + 1] = True  # a group's subtree: every level up to its highest differing one
    inside = varies[0]
    if np.any(coords[:, :, inside] != coords[:1, :, inside]):
        return False
    outside = coords[:, 0, ~inside]
    return len({tuple(row) for row in outside.tolist()}) == len(groups)
