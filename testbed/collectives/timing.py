"""Timing collectives on a topology: routed step programs, closed forms, ``auto``.

Model. Each round of a step program runs its transfers at once. A transfer is
routed with ``topology.route`` (dimension-ordered on tori, through the lowest
common switch on hierarchies); transfers of one round share every directed
link's bandwidth, so a transfer from a to b takes ``latency(route) + max over
its links of (bytes crossing that link this round / link bandwidth)``. A round
lasts as long as its slowest transfer plus
``topology.calibration.collectives.overhead_s`` (where gloo's own ring runs,
the longer of the two: it keeps a segment on the wire while the host works,
:func:`testbed.collectives.gloo.round_s`); rounds with only local copies
are free. Several groups (``--over node`` with many nodes) run their rounds
together and so contend for shared links.

Speed. A program's timing is affine per transfer in the chunk size, so it is
reduced once per (topology, op, algorithm, groups) to a *profile* (per round,
the upper envelope of ``(latency, seconds per chunk byte)``,
:mod:`testbed.collectives.routed`) and evaluated for any bytes in
microseconds; a program too large to route is refused before it is built.
On symmetric groups (every rank behind its own links on one switch, a whole
sub-torus) a closed form (:mod:`testbed.collectives.closed_form`,
:mod:`testbed.collectives.torus`) gives the same time without building the
program. Results are memoized per topology object; memoizing
never changes a result.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, replace

from testbed.hashed import HashedTuple
from testbed.collectives.algorithms import ALGORITHMS, GRID_ALGORITHMS, SUPPORTED_OPS, parse_algorithm
from testbed.collectives.routed import (MAX_ROUTED_TRANSFERS, group_grid, memoized, parallel_copies, place_program,
                                        profile, program_flows, routed_cost, topology_memo)
from testbed.collectives.bounds import distinct_groups, lower_bound
from testbed.collectives.closed_form import closed_form_time
from testbed.collectives.gloo import gloo_algorithm, gloo_pipelined, round_s
from testbed.collectives.nccl import NCCL_ALGORITHMS, nccl_algorithms, nccl_best
from testbed.collectives.nccl_loads import nccl_link_loads
from testbed.collectives.ops import BUS_FACTOR, Op, StepProgram, parse_op
from testbed.collectives.hierarchy import hierarchical_link_loads
from testbed.collectives.torus import across_slices, disjoint_sub_tori, torus_link_loads
from testbed.errors import InputError
from testbed.topology import Form, Topology

__all__ = ["CollectiveTiming", "collective_time", "groups_time", "timed_groups", "link_loads", "send_time",
           "applicable_algorithms", "program_time", "placed_program"]

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

_MEMO_ENTRIES = 200_000


# -- groups and algorithms -------------------------------------------------------------------

def applicable_algorithms(topology: Topology, op: Op | str, group: Sequence[int]) -> list[str]:
    """Algorithms that implement ``op``, fit ``group`` on ``topology`` and can be timed for it.

    ``torus`` and ``multidim`` need a sub-grid of a torus (``multidim`` two or
    more dims), ``line`` a line along one torus dim without a wrap link of its own,
    ``hierarchical`` a grid over two or more levels of a hierarchy;
    ``direct`` and ``one_shot`` go through a switch, so on tori they serve only
    all-to-all and send. An algorithm with neither a closed form for the group
    nor a routed program small enough to time (:data:`MAX_ROUTED_TRANSFERS`)
    is left out, so trying every applicable algorithm (``auto``) stays cheap.
    """
    op = parse_op(op)
    group = tuple(group)
    memo = topology_memo(topology)
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
        if name.startswith("gloo_") and gloo_algorithm(topology, op) != name:
            continue  # gloo's own variant: where gloo runs it (collectives/gloo.py), never a candidate elsewhere
        if name in GRID_ALGORITHMS:
            grid = group_grid(topology, group) if grid is None else grid
            on_torus = topology.form is Form.TORUS
            if grid is None or (name in ("torus", "multidim", "multislice", "line")) != on_torus \
                    or (name in ("hierarchical", "multidim") and len(grid[0]) < 2) \
                    or (name == "multislice" and not across_slices(topology, group)) \
                    or (name == "line" and not _open_line(topology, grid[1])):
                continue
        out.append(name)
    return out


def _open_line(topology: Topology, members: tuple[int, ...]) -> bool:
    """Whether ``members`` (a torus sub-grid) lie along one dim without a wrap link of their own: the dim has
    no wraparound, or they are not the whole dim (``line`` runs there; on a closed ring a ring is faster)."""
    stride, varying = 1, []
    for level in topology.levels:
        if len({d // stride % level.size for d in members}) > 1:
            varying.append(level)
        stride *= level.size
    return len(varying) == 1 and not (varying[0].wraparound and len(members) == varying[0].size)


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


def placed_program(topology: Topology, op: Op | str, algorithm: str, group: Sequence[int], root: int = 0,
                   peer: int | None = None) -> tuple[StepProgram, tuple[int, ...]]:
    """The step program this module times for ``algorithm`` on ``group``, and the device of each of its ranks.

    ``testbed collective --execute`` runs exactly this program on devices.
    """
    op, group = parse_op(op), tuple(group)
    _check_applicable(topology, op, group, algorithm)
    return place_program(topology, op, algorithm, group, root, (root + 1) % len(group) if peer is None else peer)


# -- profiles --------------------------------------------------------------------------------

def _cached_profile(topology: Topology, op: Op, algorithm: str, groups: tuple[tuple[int, ...], ...],
                    root: int, peer: int):
    """(chunks per buffer of ``bytes``, envelopes, link -> chunks, rounds), memoized per groups."""
    memo = topology_memo(topology)
    key = ("profile", op, algorithm, groups, root, peer)
    if key not in memo:
        placed = [program_flows(topology, op, algorithm, g, root, peer) for g in groups]
        memo[key] = (placed[0][0], *profile(topology, [flows for _, flows, _ in placed]))
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
    pipelined = gloo_pipelined(topology, op, algorithm)
    total = sum(count * round_s(max(lat + coef * chunk for lat, coef in env), overhead, pipelined)
                for env, count in envelopes.items())
    return total, rounds


def _bound_per_byte(topology: Topology, op: Op, groups: tuple[tuple[int, ...], ...], root: int,
                    peer: int | None) -> float:
    """Lower bound seconds per byte (bounds are linear in bytes), memoized."""
    memo = topology_memo(topology)
    key = ("bound", op, groups, root, peer)
    if key not in memo:
        memo[key] = max(lower_bound(topology, op, g, 1.0, root, peer) for g in distinct_groups(topology, groups))
    return memo[key]


# -- public API --------------------------------------------------------------------------------

def groups_time(topology: Topology, op: Op | str, groups: Sequence[Sequence[int]], nbytes: float,
                algorithm: str = "auto", root: int = 0, peer: int | None = None,
                use_closed_form: bool = True) -> CollectiveTiming:
    """Time ``op`` on every group at once (they may share links); reports the slowest.

    ``algorithm='auto'`` picks the fastest applicable algorithm.
    """
    if type(groups) is not HashedTuple:
        groups = tuple(map(tuple, groups))
    nbytes = float(nbytes)
    memo = topology_memo(topology)
    key = ("time", op, algorithm, groups, nbytes, root, peer, use_closed_form)
    hit = memo.get(key)
    if hit is not None:
        return hit
    if len(memo) > _MEMO_ENTRIES:
        memo.clear()
    op = parse_op(op)
    algorithm = parse_algorithm(algorithm)
    groups = _normalized(groups)
    if not groups or len(set(map(len, groups))) != 1 or not groups[0]:
        raise InputError("needs one or more groups of the same non-zero size", field="over")
    if len(groups) > 1 and _copies(topology, groups):
        # Translates on disjoint links: together they take one group's time (one representative group).
        one = groups_time(topology, op, groups[:1], nbytes, algorithm, root, peer, use_closed_form)
        result = replace(one, groups=len(groups))
        memo[key] = result
        return result
    if algorithm == "auto":
        picked = _auto_algorithms(topology, op, groups, nbytes, use_closed_form)
        candidates = [groups_time(topology, op, groups, nbytes, a, root, peer, use_closed_form) for a in picked]
        result = min(candidates, key=lambda c: (c.time_s, c.rounds))
    elif algorithm in NCCL_ALGORITHMS:
        result = _nccl_timing(topology, op, algorithm, groups, nbytes, root, peer)
    else:
        result = _routed_timing(topology, op, algorithm, groups, nbytes, root, peer, use_closed_form)
    memo[key] = result
    return result


def _auto_algorithms(topology: Topology, op: Op, groups: tuple[tuple[int, ...], ...], nbytes: float,
                     use_closed_form: bool) -> list[str]:
    """The algorithms ``algorithm='auto'`` times for ``groups``: NCCL's own pick on an NVIDIA GPU hierarchy, gloo's
    one algorithm on CPU hosts across a network (collectives/gloo.py), else every applicable one small enough to
    time."""
    n = len(groups[0])
    able = applicable_algorithms(topology, op, groups[0])
    if len(groups) > 1 and any(a in GRID_ALGORITHMS for a in able):  # a grid program needs every group a grid
        grids = _all_grids(topology, groups)
        able = [a for a in able if grids or a not in GRID_ALGORITHMS]
    nccl = [a for a in able if a in NCCL_ALGORITHMS]
    if not nccl:
        # Routed programs too large to time for all the groups are left out (a closed form times any size).
        closed_ok = use_closed_form and _closed_applies(topology, groups)
        sized = [a for a in able if closed_ok and closed_form_time(topology, op, a, groups[0], nbytes) is not None
                 or routed_cost(topology, a, groups[0], len(groups), op) <= MAX_ROUTED_TRANSFERS]
        if not sized:
            fitting = able or _fitting(topology, op, groups[0])
            sizes = ", ".join(f"{a} ~{routed_cost(topology, a, groups[0], len(groups), op):,}" for a in fitting)
            raise InputError(f"{op} over {len(groups)} group(s) of {n} ranks on `{topology.name}`: every "
                             f"algorithm for it is a routed step program of more than {MAX_ROUTED_TRANSFERS:,} "
                             f"transfer-hops for these groups ({sizes or 'none fits the group'}), too large to "
                             f"time here, and none has a closed form for them; pick smaller groups with --over",
                             field="over")
        able = sized
    gloo = gloo_algorithm(topology, op)
    return [nccl_best(topology, op, groups[0], nbytes)[0]] if nccl else [gloo] if gloo in able else able


def _all_grids(topology: Topology, groups: tuple[tuple[int, ...], ...]) -> bool:
    """Whether every group but the first is a grid (:func:`testbed.collectives.routed.group_grid`), memoized per
    topology on the groups (hashed once: :class:`~testbed.hashed.HashedTuple`): every size of one set of groups asks it again."""
    return memoized(topology, "all_grids", groups,
                    lambda: all(group_grid(topology, g) is not None for g in groups[1:]), limit=10_000)


def _nccl_timing(topology: Topology, op: Op, algorithm: str, groups: tuple[tuple[int, ...], ...], nbytes: float,
                 root: int, peer: int | None) -> CollectiveTiming:
    """``op`` on ``groups`` with an NCCL algorithm: NCCL's tuning model's time for its best protocol."""
    n = len(groups[0])
    _check_applicable(topology, op, groups[0], algorithm)
    name, protocol, time_s = nccl_best(topology, op, groups[0], nbytes, algorithm)
    time_s += _rendezvous(topology, n)
    bound = nbytes * _bound_per_byte(topology, op, groups, root, peer)
    algbw = nbytes / time_s if time_s > 0 else 0.0
    return CollectiveTiming(op=str(op), algorithm=algorithm, ranks=n, bytes=nbytes, time_s=time_s,
                            algbw=algbw, busbw=algbw * BUS_FACTOR[op](n), bound_s=bound, rounds=1,
                            groups=len(groups), closed_form=True, protocol=protocol)


def _routed_timing(topology: Topology, op: Op, algorithm: str, groups: tuple[tuple[int, ...], ...],
                   nbytes: float, root: int, peer: int | None, use_closed_form: bool) -> CollectiveTiming:
    """``op`` on ``groups`` with a named algorithm: its closed form where one applies, else its routed step
    program (refused past ``MAX_ROUTED_TRANSFERS`` transfer-hops)."""
    n = len(groups[0])
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
    time_s += _rendezvous(topology, n)
    bound = nbytes * _bound_per_byte(topology, op, groups, root, peer)
    algbw = nbytes / time_s if time_s > 0 else 0.0
    return CollectiveTiming(op=str(op), algorithm=algorithm, ranks=n, bytes=nbytes, time_s=time_s,
                            algbw=algbw, busbw=algbw * BUS_FACTOR[op](n), bound_s=bound, rounds=rounds,
                            groups=len(groups), closed_form=closed is not None)


def _normalized(groups: Sequence[Sequence[int]]) -> HashedTuple:
    """Whole numbers (numpy ranks as Python ints), as one hashed-once :class:`~testbed.hashed.HashedTuple` (map: no Python frame per
    group of thousands)."""
    if type(groups) is HashedTuple:
        return groups
    return HashedTuple(map(tuple, map(functools.partial(map, operator.index), groups)))


def timed_groups(topology: Topology, groups: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """The groups :func:`groups_time` times in place of ``groups`` (whole numbers): the first alone when they are
    translates on disjoint links (it returns that one's timing then, ``groups`` aside), else all of them, hashed
    once. A caller timing one set of groups at many sizes passes these, and each call hashes them at most once."""
    groups = _normalized(groups)
    alike = len(groups) > 1 and len(set(map(len, groups))) == 1 and groups[0]  # else groups_time refuses them
    return _normalized(groups[:1]) if alike and _copies(topology, groups) else groups


def _rendezvous(topology: Topology, ranks: int) -> float:
    """A collective's cost whatever its rounds: ``collectives.launch_s``, and ``rendezvous_s`` for each of
    ``ranks`` ranks beyond the first."""
    c = topology.calibration.collectives
    return c.launch_s + c.rendezvous_s * (ranks - 1)


def _copies(topology: Topology, groups: tuple[tuple[int, ...], ...]) -> bool:
    memo = topology_memo(topology)
    key = ("copies", groups)
    if key not in memo:
        memo[key] = parallel_copies(topology, groups)
    return memo[key]


def _closed_applies(topology: Topology, groups: tuple[tuple[int, ...], ...]) -> bool:
    """Whether a closed form for one group times them all: one group, or sub-tori on disjoint links."""
    if len(groups) == 1:
        return True
    memo = topology_memo(topology)
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
    if closed is None and algorithm == "hierarchical":
        closed = hierarchical_link_loads(topology, op, group, nbytes)
    if closed is not None:  # a whole sub-torus, or all under one switch: every rank alike, no program built
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
    """Point-to-point: route latency + bytes / bottleneck bandwidth + collective overhead and launch (0 when src == dst)."""
    if src == dst:
        return 0.0
    c = topology.calibration.collectives
    return (topology.path_latency(src, dst) + float(nbytes) / topology.path_bandwidth(src, dst)
            + c.overhead_s + c.launch_s)
