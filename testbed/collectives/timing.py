"""Timing collectives on a topology: routed step programs, closed forms, ``auto``.

Model. Each round of a step program runs its transfers at once. A transfer is
routed with ``topology.route`` (dimension-ordered on tori, through the lowest
common switch on hierarchies); transfers of one round share every directed
link's bandwidth, so a transfer from a to b takes ``latency(route) + max over
its links of (bytes crossing that link this round / link bandwidth)``. A round
lasts as long as its slowest transfer plus
``topology.calibration.collectives.overhead_s``; rounds with only local copies
are free. Several groups (``--over node`` with many nodes) run their rounds
together and so contend for shared links.

Speed. A program's timing is affine per transfer in the chunk size, so it is
reduced once per (topology, op, algorithm, groups) to a *profile* (per round,
the upper envelope of ``(latency, seconds per chunk byte)``) and evaluated
for any bytes in microseconds. On symmetric groups (every rank behind its own
links on one switch, or a full wraparound ring) a closed-form alpha-beta
formula (:mod:`testbed.collectives.closed_form`) gives the same time without
building the program. Results are memoized per topology object; memoizing
never changes a result.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from testbed.collectives.algorithms import (ALGORITHMS, GRID_ALGORITHMS, RING_FAMILY, SUPPORTED_OPS, flow_rounds,
                                           parse_algorithm, ring_streams, step_program)
from testbed.collectives.bounds import lower_bound
from testbed.collectives.closed_form import closed_form_time
from testbed.collectives.nccl import NCCL_ALGORITHMS, nccl_algorithms, nccl_best, nccl_link_loads
from testbed.collectives.ops import BUS_FACTOR, Op, StepProgram, parse_op
from testbed.collectives.torus import disjoint_sub_tori, torus_link_loads
from testbed.errors import InputError
from testbed.topology import Form, Topology

__all__ = ["CollectiveTiming", "collective_time", "groups_time", "link_loads", "send_time", "routed_cost",
           "applicable_algorithms", "program_time", "group_grid", "placed_program"]

Link = tuple[object, object]


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveTiming:
    """One collective's predicted time; ``algbw = bytes/time``, ``busbw = algbw * nccl-tests factor``.

    ``groups``: how many groups ran at once (the slowest is reported);
    ``closed_form``: whether the alpha-beta fast path produced the time.
    ``protocol``: NCCL's protocol (LL, LL128, Simple) for the NCCL algorithms
    (:mod:`testbed.collectives.nccl`), empty for routed step programs.
    For one rank (nothing to move) time, algbw and busbw are 0.
    """

    op: str
    algorithm: str
    ranks: int
    bytes: float
    time_s: float
    algbw: float
    busbw: float
    bound_s: float
    rounds: int
    groups: int = 1
    closed_form: bool = False
    protocol: str = ""


# -- memo --------------------------------------------------------------------------------

_MEMO: dict[int, tuple[Topology, dict]] = {}
_MEMO_TOPOLOGIES = 64
_MEMO_ENTRIES = 200_000

#: Work a routed step program may take to be timed, in transfer-hops (all its groups together): every transfer
#: is a Python object, checked, counted per round and routed hop by hop, a few microseconds per hop on one
#: core, so the limit is a few seconds and ~100 MB at most; a 16,384-rank torus all-reduce would be ~1e10.
MAX_ROUTED_TRANSFERS = 750_000

#: Algorithms whose transfers go between ring neighbours (one or two hops on a grid).
_NEIGHBOURLY = ("ring", "bidir_ring", "torus", "hierarchical", "multidim")


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
            streams = len(ring_streams(algorithm, dims))
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


def _memo(topology: Topology) -> dict:
    """The memo dict of this topology object (kept with a reference, so ids are never reused)."""
    entry = _MEMO.get(id(topology))
    if entry is None or entry[0] is not topology:
        if len(_MEMO) >= _MEMO_TOPOLOGIES:
            _MEMO.pop(next(iter(_MEMO)))
        entry = (topology, {})
        _MEMO[id(topology)] = entry
    return entry[1]


# -- groups and algorithms -------------------------------------------------------------------

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


def applicable_algorithms(topology: Topology, op: Op | str, group: Sequence[int]) -> list[str]:
    """Algorithms that implement ``op``, fit ``group`` on ``topology`` and can be timed for it.

    ``torus`` and ``multidim`` need a sub-grid of a torus (``multidim`` two or
    more dims), ``hierarchical`` a grid over two or more levels of a hierarchy;
    ``direct`` and ``one_shot`` go through a switch, so on tori they serve only
    all-to-all and send. An algorithm with neither a closed form for the group
    nor a routed program small enough to time (:data:`MAX_ROUTED_TRANSFERS`)
    is left out, so trying every applicable algorithm (``auto``) stays cheap.
    """
    op = parse_op(op)
    group = tuple(group)
    memo = _memo(topology)
    key = ("applicable", op, group)
    if key in memo:
        return list(memo[key])
    out = [name for name in _fitting(topology, op, group)
           if closed_form_time(topology, op, name, group, 1.0) is not None
           or routed_cost(topology, name, group, 1, op) <= MAX_ROUTED_TRANSFERS]
    out.extend(nccl_algorithms(topology, op, group))
    memo[key] = tuple(out)
    return out


def _fitting(topology: Topology, op: Op, group: tuple[int, ...]) -> list[str]:
    """Step-program algorithms that implement ``op`` and fit the group's shape (whatever their size)."""
    out = []
    grid = None
    for name in ALGORITHMS:
        if op not in SUPPORTED_OPS[name]:
            continue
        if name in ("direct", "one_shot") and topology.form is Form.TORUS and op not in (Op.ALL_TO_ALL, Op.SEND):
            continue  # through a switch only: on a torus every pair would cross many shared links
        if name in GRID_ALGORITHMS:
            grid = group_grid(topology, group) if grid is None else grid
            on_torus = topology.form is Form.TORUS
            if grid is None or (name in ("torus", "multidim")) != on_torus \
                    or (name in ("hierarchical", "multidim") and len(grid[0]) < 2):
                continue
        out.append(name)
    return out


def _check_applicable(topology: Topology, op: Op, group: Sequence[int], algorithm: str, groups: int = 1) -> None:
    able = applicable_algorithms(topology, op, group)
    if algorithm in able:
        return
    n = len(group)
    if algorithm in _fitting(topology, op, tuple(group)):
        size = routed_cost(topology, algorithm, group, groups, op)
        raise InputError(f"`{algorithm}` {op} over {groups} group(s) of {n} ranks is a routed step program of about "
                         f"{size:,} transfer-hops, more than the {MAX_ROUTED_TRANSFERS:,} that can be timed here, and "
                         f"has no closed form for this group; pick a smaller group or an algorithm that applies: "
                         f"{', '.join(able) or 'none'}", field="algorithm")
    reason = ("does not implement " + str(op)) if algorithm in SUPPORTED_OPS and op not in SUPPORTED_OPS[algorithm] \
        else f"does not apply to this group of {n} on {topology.name} ({topology.form} form)"
    raise InputError(f"algorithm `{algorithm}` {reason}; algorithms that apply: {', '.join(able)}",
                     field="algorithm")


def _program(topology: Topology, op: Op, algorithm: str, group: Sequence[int], root: int, peer: int
             ) -> tuple[StepProgram, tuple[int, ...]]:
    """The program and the device of each of its ranks."""
    if algorithm in GRID_ALGORITHMS:
        dims, ordered = group_grid(topology, group)
        return step_program(op, algorithm, len(group), dims=dims), ordered
    return step_program(op, algorithm, len(group), root=root, peer=peer), tuple(group)


def placed_program(topology: Topology, op: Op | str, algorithm: str, group: Sequence[int], root: int = 0,
                   peer: int | None = None) -> tuple[StepProgram, tuple[int, ...]]:
    """The step program this module times for ``algorithm`` on ``group``, and the device of each of its ranks.

    ``testbed collective --execute`` runs exactly this program on devices.
    """
    op, group = parse_op(op), tuple(group)
    _check_applicable(topology, op, group, algorithm)
    return _program(topology, op, algorithm, group, root, (root + 1) % len(group) if peer is None else peer)


# -- profiles --------------------------------------------------------------------------------

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
    memo = _memo(topology)
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


def _program_flows(topology: Topology, op: Op, algorithm: str, group: tuple[int, ...], root: int, peer: int
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
    program, devices = _program(topology, op, algorithm, group, root, peer)
    flows = []
    for round_ in program.rounds:
        counter: Counter = Counter()
        for t in round_:
            if t.src != t.dst:
                counter[devices[t.src], devices[t.dst]] += 1
        flows.append(counter)
    return program.data_blocks * program.pieces, flows, devices


def _profile(topology: Topology, programs: Sequence[list[Counter]]):
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


def _cached_profile(topology: Topology, op: Op, algorithm: str, groups: tuple[tuple[int, ...], ...],
                    root: int, peer: int):
    """(chunks per buffer of ``bytes``, envelopes, link -> chunks, rounds), memoized per groups."""
    memo = _memo(topology)
    key = ("profile", op, algorithm, groups, root, peer)
    if key not in memo:
        placed = [_program_flows(topology, op, algorithm, g, root, peer) for g in groups]
        memo[key] = (placed[0][0], *_profile(topology, [flows for _, flows, _ in placed]))
    return memo[key]


def program_time(topology: Topology, op: Op | str, algorithm: str, groups: Sequence[Sequence[int]],
                 nbytes: float, root: int = 0, peer: int | None = None) -> tuple[float, int]:
    """(seconds, rounds) of the routed step program, all ``groups`` running together."""
    op = parse_op(op)
    groups = tuple(tuple(g) for g in groups)
    n = len(groups[0])
    peer = (root + 1) % n if peer is None else peer
    chunks, envelopes, _, rounds = _cached_profile(topology, op, algorithm, groups, root, peer)
    chunk = float(nbytes) / chunks
    overhead = topology.calibration.collectives.overhead_s
    total = sum(count * (overhead + max(lat + coef * chunk for lat, coef in env)) for env, count in envelopes.items())
    return total, rounds


def _bound_per_byte(topology: Topology, op: Op, groups: tuple[tuple[int, ...], ...], root: int,
                    peer: int | None) -> float:
    """Lower bound seconds per byte (bounds are linear in bytes), memoized."""
    memo = _memo(topology)
    key = ("bound", op, groups, root, peer)
    if key not in memo:
        memo[key] = max(lower_bound(topology, op, g, 1.0, root, peer) for g in groups)
    return memo[key]


# -- public API --------------------------------------------------------------------------------

def groups_time(topology: Topology, op: Op | str, groups: Sequence[Sequence[int]], nbytes: float,
                algorithm: str = "auto", root: int = 0, peer: int | None = None,
                use_closed_form: bool = True) -> CollectiveTiming:
    """Time ``op`` on every group at once (they may share links); reports the slowest.

    ``algorithm='auto'`` picks the fastest applicable algorithm.
    """
    groups = tuple(map(tuple, groups))
    nbytes = float(nbytes)
    memo = _memo(topology)
    key = ("time", op, algorithm, groups, nbytes, root, peer, use_closed_form)
    hit = memo.get(key)
    if hit is not None:
        return hit
    if len(memo) > _MEMO_ENTRIES:
        memo.clear()
    op = parse_op(op)
    algorithm = parse_algorithm(algorithm)
    groups = tuple(tuple(map(operator.index, g)) for g in groups)
    if not groups or any(len(g) != len(groups[0]) for g in groups) or not groups[0]:
        raise InputError("needs one or more groups of the same non-zero size", field="over")
    n = len(groups[0])
    if algorithm == "auto":
        able = applicable_algorithms(topology, op, groups[0])
        nccl = [a for a in able if a in NCCL_ALGORITHMS]
        if not nccl:
            # Routed programs too large to time for all the groups are left out (a closed form times any size).
            closed_ok = use_closed_form and _closed_applies(topology, groups)
            sized = [a for a in able if closed_ok and closed_form_time(topology, op, a, groups[0], nbytes) is not None
                     or routed_cost(topology, a, groups[0], len(groups), op) <= MAX_ROUTED_TRANSFERS]
            if not sized:
                raise InputError(f"{op} over {len(groups)} group(s) of {n} ranks on `{topology.name}`: every "
                                 f"algorithm that applies ({', '.join(able) or 'none'}) is a routed step program of "
                                 f"more than {MAX_ROUTED_TRANSFERS:,} transfer-hops for these groups, too large to time "
                                 f"here, and none has a closed form for them; pick smaller groups", field="over")
            able = sized
        # On an NVIDIA GPU hierarchy NCCL runs the collective: its own algorithms, as its tuning model picks.
        candidates = [groups_time(topology, op, groups, nbytes, a, root, peer, use_closed_form)
                      for a in (nccl or able)]
        result = min(candidates, key=lambda c: (c.time_s, c.rounds))
    elif algorithm in NCCL_ALGORITHMS:
        _check_applicable(topology, op, groups[0], algorithm)
        name, protocol, time_s = nccl_best(topology, op, groups[0], nbytes, algorithm)
        bound = nbytes * _bound_per_byte(topology, op, groups, root, peer)
        algbw = nbytes / time_s if time_s > 0 else 0.0
        result = CollectiveTiming(op=str(op), algorithm=algorithm, ranks=n, bytes=nbytes, time_s=time_s,
                                  algbw=algbw, busbw=algbw * BUS_FACTOR[op](n), bound_s=bound, rounds=1,
                                  groups=len(groups), closed_form=True, protocol=protocol)
    else:
        _check_applicable(topology, op, groups[0], algorithm, len(groups))
        closed = closed_form_time(topology, op, algorithm, groups[0], nbytes) \
            if use_closed_form and _closed_applies(topology, groups) else None
        if closed is not None:
            time_s, rounds = closed
        else:
            size = routed_cost(topology, algorithm, groups[0], len(groups), op)
            if size > MAX_ROUTED_TRANSFERS:
                raise InputError(f"`{algorithm}` {op} over {len(groups)} group(s) of {n} ranks is a routed step "
                                 f"program of about {size:,} transfer-hops, more than the {MAX_ROUTED_TRANSFERS:,} "
                                 f"that can be timed here; pick a smaller group or another algorithm",
                                 field="algorithm")
            time_s, rounds = program_time(topology, op, algorithm, groups, nbytes, root, peer)
        bound = nbytes * _bound_per_byte(topology, op, groups, root, peer)
        algbw = nbytes / time_s if time_s > 0 else 0.0
        result = CollectiveTiming(op=str(op), algorithm=algorithm, ranks=n, bytes=nbytes, time_s=time_s,
                                  algbw=algbw, busbw=algbw * BUS_FACTOR[op](n), bound_s=bound, rounds=rounds,
                                  groups=len(groups), closed_form=closed is not None)
    memo[key] = result
    return result


def _closed_applies(topology: Topology, groups: tuple[tuple[int, ...], ...]) -> bool:
    """Whether a closed form for one group times them all: one group, or sub-tori on disjoint links."""
    if len(groups) == 1:
        return True
    memo = _memo(topology)
    key = ("disjoint", groups)
    if key not in memo:
        memo[key] = disjoint_sub_tori(topology, groups)
    return memo[key]


def collective_time(topology: Topology, op: Op | str, group: Sequence[int], nbytes: float,
                    algorithm: str = "auto", root: int = 0, peer: int | None = None) -> CollectiveTiming:
    """Predicted time of ``op`` over ``group`` (device ids; rank i is group[i]) moving ``nbytes``."""
    return groups_time(topology, op, [group], nbytes, algorithm, root, peer)


def link_loads(topology: Topology, op: Op | str, group: Sequence[int], nbytes: float,
               algorithm: str = "auto", root: int = 0, peer: int | None = None) -> dict[Link, float]:
    """Total bytes crossing each directed link (u, v) during the collective (``auto`` resolved first)."""
    op = parse_op(op)
    group = tuple(int(d) for d in group)
    if algorithm == "auto":
        algorithm = collective_time(topology, op, group, nbytes, "auto", root, peer).algorithm
    else:
        _check_applicable(topology, op, group, parse_algorithm(algorithm))
    if algorithm in NCCL_ALGORITHMS:
        return nccl_link_loads(topology, op, group, nbytes, algorithm)
    closed = torus_link_loads(topology, op, algorithm, group, nbytes)
    if closed is not None:  # a whole sub-torus: every rank's links alike, no program built
        return closed
    n = len(group)
    size = routed_cost(topology, algorithm, group, 1, op)
    if size > MAX_ROUTED_TRANSFERS:
        raise InputError(f"the link loads of `{algorithm}` {op} over {n} ranks on `{topology.name}` come from its "
                         f"routed step program, about {size:,} transfer-hops, more than the "
                         f"{MAX_ROUTED_TRANSFERS:,} that can be routed here (its time has a closed form, its per-link "
                         f"bytes do not yet); use smaller groups", field="over")
    peer = (root + 1) % n if peer is None else peer
    chunks, _, totals, _ = _cached_profile(topology, op, algorithm, (group,), root, peer)
    chunk = float(nbytes) / chunks
    return {link: chunks * chunk for link, chunks in totals.items()}


def send_time(topology: Topology, src: int, dst: int, nbytes: float) -> float:
    """Point-to-point: route latency + bytes / bottleneck bandwidth + collective overhead (0 when src == dst)."""
    if src == dst:
        return 0.0
    return (topology.path_latency(src, dst) + float(nbytes) / topology.path_bandwidth(src, dst)
            + topology.calibration.collectives.overhead_s)
