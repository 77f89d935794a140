"""Closed forms of the ring algorithms of a torus on whole sub-tori, at any size.

A group is a *sub-torus* (:func:`sub_torus`) when it is every device whose
coordinates vary along some dims of a torus and are fixed along the others,
and each varying dim is a whole wraparound line (or has two devices, joined
by one link). Every rank of such a group then sees the same neighbours one
link away along each dim, so the routed step programs of ``torus``
(dimension-ordered, bidirectional rings), ``multidim`` (all dims at once) and
``bidir_ring``/``ring`` on one line are the same in every rank's view, and
their time follows from one rank's links, round by round, without building
the program:

- a program is a few *streams* (a ring direction, or a part of ``multidim``),
  each a sequence of ring phases along one dim; a reduce-scatter phase of a
  line of ``m`` ranks runs ``m - 1`` rounds moving ``C/m`` chunks per rank
  and leaves ``C/m`` owned; an all-gather phase moves ``C`` and leaves ``C m``;
- streams run side by side (they touch disjoint chunks): in a round the
  directed link of dim ``d`` carries the chunks of every stream on ``d`` in
  its direction (both directions share the single link of a two-rank dim);
- a round lasts ``overhead + max over busy dims (latency_d + load_d *
  chunk_bytes / bandwidth_d)``, as :mod:`testbed.collectives.timing` times a
  routed round.

A multi-slice torus's last level (``slice``) is *switched*: the chips of a
line along it meet at the data-center switch, each over its own link, so a
ring step along it crosses two links (up and down, twice the latency) and a
rank's one uplink carries what it sends both ways round, as on a two-rank
dim. ``multislice`` (``multidim`` inside each slice, then rings across the
slices on the part each chip owns) is one more stream layout.

The result equals the routed program exactly (tests compare them on 2x2x2,
4x4, 3x4 and 4x4x4 tori, and on multi-slice tori). Groups of several sub-tori that differ in a fixed
coordinate use disjoint links (dimension-ordered routes stay in their own
sub-torus), so they are timed alike (:func:`disjoint_sub_tori`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from testbed.collectives.routed import ring_streams
from testbed.collectives.ops import Op, parse_op
from testbed.topology import Form, Topology
from testbed.topology.routing import slice_switch

__all__ = ["SubTorus", "sub_torus", "disjoint_sub_tori", "across_slices", "TORUS_FORMS", "torus_profile", "torus_time",
           "torus_link_loads", "translatable", "canonical", "shift_loads", "touching"]

#: Algorithms with a closed form on a sub-torus (``ring``/``bidir_ring`` only on one line).
TORUS_FORMS: tuple[str, ...] = ("torus", "multidim", "multislice", "ring", "bidir_ring")


@dataclass(frozen=True, slots=True)
class SubTorus:
    """A whole sub-torus: the varying levels (innermost first), their sizes, strides, the latency of one ring
    step and the link bandwidth along each; ``switched``: whether the level is the slices' data-center switch
    (a step is two links, up and down; one uplink per chip carries both ring directions)."""

    levels: tuple[int, ...]
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    latency: tuple[float, ...]
    bandwidth: tuple[float, ...]
    base: int
    switched: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if not self.switched:
            object.__setattr__(self, "switched", tuple(False for _ in self.levels))
        if not (len(self.levels) == len(self.sizes) == len(self.strides) == len(self.latency) == len(self.bandwidth)
                == len(self.switched)):
            raise ValueError("one size, stride, latency, bandwidth and switched flag per varying level")
        if any(s < 2 for s in self.sizes) or any(b <= 0 for b in self.bandwidth):
            raise ValueError("varying levels need two or more devices and positive bandwidth")


def _coords(topology: Topology, devices: np.ndarray) -> np.ndarray:
    """(len(devices), levels) mixed-radix coordinates, innermost level first."""
    sizes = np.asarray([l.size for l in topology.levels], dtype=np.int64)
    strides = np.concatenate([[1], np.cumprod(sizes)[:-1]]).astype(np.int64)
    return devices[:, None] // strides[None, :] % sizes[None, :]


def sub_torus(topology: Topology, group: Sequence[int]) -> SubTorus | None:
    """The group's :class:`SubTorus` when it is one (ranks in increasing device order), else None (memoized)."""
    if topology.form is not Form.TORUS or len(group) < 2:
        return None
    group = tuple(group)
    return topology.memo(("__sub_torus__", group), lambda: _find_sub_torus(topology, group))


def _find_sub_torus(topology: Topology, group: tuple[int, ...]) -> SubTorus | None:
    devices = np.asarray(group, dtype=np.int64)
    if np.any(np.diff(devices) <= 0):
        return None  # ranks must be in device order (distinct, increasing)
    coords = _coords(topology, devices)
    levels, sizes, strides, latency, bandwidth, switched = [], [], [], [], [], []
    stride = 1
    for i, level in enumerate(topology.levels):
        distinct = len(np.unique(coords[:, i]))
        if distinct > 1:
            if distinct != level.size or not (level.wraparound or level.switched or level.size == 2):
                return None
            levels.append(i)
            sizes.append(level.size)
            strides.append(stride)
            latency.append(float(level.latency) * (2 if level.switched else 1))
            bandwidth.append(float(level.bandwidth))
            switched.append(level.switched)
        stride *= level.size
    if math.prod(sizes) != len(group):
        return None
    return SubTorus(levels=tuple(levels), sizes=tuple(sizes), strides=tuple(strides), latency=tuple(latency),
                    bandwidth=tuple(bandwidth), base=int(devices[0]), switched=tuple(switched))


def across_slices(topology: Topology, group: Sequence[int]) -> bool:
    """True when ``group`` spans several slices of a multi-slice torus and varies inside them too: the groups
    ``multislice`` serves (reduce-scatter inside each slice, all-reduce across, all-gather inside)."""
    k = topology.slice_level
    if k is None or len(group) < 2:
        return False
    coords = _coords(topology, np.asarray(group, dtype=np.int64))
    varying = [i for i in range(len(topology.levels)) if len(np.unique(coords[:, i])) > 1]
    return k in varying and len(varying) >= 2


def disjoint_sub_tori(topology: Topology, groups: Sequence[Sequence[int]]) -> bool:
    """True when every group is a sub-torus along the same dims and no two share their fixed coordinates.

    Dimension-ordered routes between members of one such group change only
    its varying coordinates, so different groups never share a link.
    """
    shapes = [sub_torus(topology, g) for g in groups]
    if any(s is None for s in shapes) or len({s.levels for s in shapes}) != 1:
        return False
    fixed = [i for i in range(len(topology.levels)) if i not in shapes[0].levels]
    bases = _coords(topology, np.asarray([s.base for s in shapes], dtype=np.int64))[:, fixed]
    return len({tuple(row) for row in bases.tolist()}) == len(groups)


# -- streams -----------------------------------------------------------------------------

def _streams(algorithm: str, op: Op, shape: SubTorus) -> tuple[int, list[tuple[int, int, list[tuple[int, bool]]]]]:
    """(pieces, streams): each stream is (direction, units of the buffer, [(dim index, reduce-scatter?) per phase]).

    ``pieces`` is the step program's piece count, so a chunk is ``bytes / (data blocks * pieces)``.
    """
    streams = ring_streams(algorithm, shape.sizes)
    n = math.prod(shape.sizes)
    units = sum(w for _, _, w in streams)
    pieces = units * n if op is Op.ALL_REDUCE else units
    out = []
    for direction, order, weight in streams:
        phases: list[tuple[int, bool]] = []
        if op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER):
            phases += [(d, True) for d in order]
        if op in (Op.ALL_REDUCE, Op.ALL_GATHER):
            phases += [(d, False) for d in reversed(order)]
        out.append((direction, weight, phases))
    return pieces, out


def torus_profile(topology: Topology, op: Op | str, algorithm: str, shape: SubTorus
                  ) -> tuple[int, tuple[tuple[tuple[tuple[float, float], ...], int], ...]]:
    """(pieces, ((envelope, count), ...)): per distinct round, the (latency, seconds per chunk byte) of its busy
    links and how many rounds look like it -- the same profile :mod:`~testbed.collectives.timing` routes."""
    op = parse_op(op)
    pieces, streams = _streams(algorithm, op, shape)
    # Chunks of its stream a rank holds at the start: all n (all_reduce: one per final owner; reduce_scatter:
    # one per block), or its own one (all_gather).
    start = 1 if op is Op.ALL_GATHER else math.prod(shape.sizes)
    # Per stream: a list of (rounds, dim, chunks per transfer).
    plans = []
    for direction, weight, phases in streams:
        held, steps = start * weight, []
        for d, scatter in phases:
            m = shape.sizes[d]
            if scatter:
                held //= m
                steps.append((m - 1, d, direction, held))
            else:
                steps.append((m - 1, d, direction, held))
                held *= m
        plans.append(steps)
    profile: dict[tuple, int] = {}
    cursors = [[0, 0] for _ in plans]  # (phase index, rounds done in it)
    while True:
        load: dict[tuple[int, int], int] = {}
        busy = False
        for steps, cursor in zip(plans, cursors):
            while cursor[0] < len(steps) and cursor[1] >= steps[cursor[0]][0]:
                cursor[0] += 1
                cursor[1] = 0
            if cursor[0] == len(steps):
                continue
            _, d, direction, chunks = steps[cursor[0]]
            way = _way(shape, d, direction)
            load[d, way] = load.get((d, way), 0) + chunks
            cursor[1] += 1
            busy = True
        if not busy:
            break
        envelope = tuple(sorted({(shape.latency[d], c / shape.bandwidth[d]) for (d, _), c in load.items()},
                                reverse=True))
        profile[envelope] = profile.get(envelope, 0) + 1
    return pieces, tuple(profile.items())


def _way(shape: SubTorus, d: int, direction: int) -> int:
    """The directed link a ring step along dim ``d`` in ``direction`` loads: two ranks share one link, and a
    switched dim's uplink carries both directions."""
    return 1 if shape.sizes[d] == 2 or shape.switched[d] else direction


def _cached_profile(topology: Topology, op: Op, algorithm: str, shape: SubTorus):
    key = ("__torus_profile__", op, algorithm, shape.sizes, shape.latency, shape.bandwidth, shape.switched)
    return topology.memo(key, lambda: torus_profile(topology, op, algorithm, shape))


def torus_time(topology: Topology, op: Op | str, algorithm: str, group: Sequence[int], nbytes: float
               ) -> tuple[float, int] | None:
    """(seconds, rounds) of ``algorithm`` over the sub-torus ``group``, or None when it is not one (or the
    algorithm has no form here: ``ring``/``bidir_ring`` only on a single line of three or more)."""
    op = parse_op(op)
    if algorithm not in TORUS_FORMS or op not in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER):
        return None
    shape = sub_torus(topology, group)
    if shape is None or (algorithm in ("ring", "bidir_ring") and (len(shape.sizes) != 1 or shape.sizes[0] < 3)) \
            or (algorithm == "multislice" and not (len(shape.sizes) >= 2 and shape.switched[-1])):
        return None
    pieces, profile = _cached_profile(topology, op, algorithm, shape)
    n = len(group)
    chunk = float(nbytes) / ((1 if op is Op.ALL_REDUCE else n) * pieces)
    overhead = topology.calibration.collectives.overhead_s
    total = sum(count * (overhead + max(lat + coef * chunk for lat, coef in env)) for env, count in profile)
    return total, sum(count for _, count in profile)


def torus_link_loads(topology: Topology, op: Op | str, algorithm: str, group: Sequence[int], nbytes: float
                     ) -> dict[tuple[int | str, int | str], float] | None:
    """Bytes over each directed link of the sub-torus ``group`` during the collective (None without a form).

    Every rank is alike, so each directed link of a dim carries the same bytes:
    the chunks of every round of that dim and direction, times the chunk size.
    """
    op = parse_op(op)
    shape = sub_torus(topology, group)
    if shape is None or torus_time(topology, op, algorithm, group, nbytes) is None:
        return None
    pieces, streams = _streams(algorithm, op, shape)
    n = len(group)
    chunk = float(nbytes) / ((1 if op is Op.ALL_REDUCE else n) * pieces)
    per: dict[tuple[int, int], float] = {}
    for direction, weight, phases in streams:
        held = weight * (n if op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER) else 1)
        for d, scatter in phases:
            m = shape.sizes[d]
            if scatter:
                held //= m
            way = _way(shape, d, direction)
            per[d, way] = per.get((d, way), 0.0) + (m - 1) * held * chunk
            if not scatter:
                held *= m
    devices = np.asarray(group, dtype=np.int64)
    coords = _coords(topology, devices)
    out: dict[tuple[int | str, int | str], float] = {}
    for (d, way), nbytes_link in per.items():
        level, m, stride = shape.levels[d], shape.sizes[d], shape.strides[d]
        if shape.switched[d]:  # every rank's uplink and downlink carry what it sends and receives along d
            switch = slice_switch(topology)
            for u in devices.tolist():
                out[u, switch] = out.get((u, switch), 0.0) + nbytes_link
                out[switch, u] = out.get((switch, u), 0.0) + nbytes_link
            continue
        c = coords[:, level]
        nxt = devices + (((c + way) % m) - c) * stride
        for u, v in zip(devices.tolist(), nxt.tolist()):
            out[u, v] = out.get((u, v), 0.0) + nbytes_link
    return out


# -- translation symmetry (the simulator's representative groups) ---------------------------

def translatable(topology: Topology) -> bool:
    """True when shifting every coordinate by a constant maps the torus, and its routes, onto themselves.

    Needs every dim to wrap around (or have at most two devices, or be the slices' switch, which every shift
    leaves in place); dimension-ordered routes depend only on coordinate differences, so they shift along.
    """
    return topology.form is Form.TORUS and all(l.wraparound or l.switched or l.size <= 2 for l in topology.levels)


def canonical(topology: Topology, group: Sequence[int]) -> tuple[tuple[int, ...], np.ndarray]:
    """(the group shifted so its least coordinate along every dim is 0, the shift back as coordinates).

    The shift never wraps a member, so it subtracts one constant from every
    device id and keeps the members' order: the shifted group's program is the
    original's, translated.
    """
    devices = np.asarray(group, dtype=np.int64)
    coords = _coords(topology, devices)
    low = coords.min(axis=0)
    sizes = np.asarray([l.size for l in topology.levels], dtype=np.int64)
    strides = np.concatenate([[1], np.cumprod(sizes)[:-1]]).astype(np.int64)
    offset = int((low * strides).sum())
    return tuple((devices - offset).tolist()), low


def shift_loads(topology: Topology, loads: dict, by: np.ndarray) -> dict:
    """``loads`` (directed links -> bytes) with every device end shifted by ``by`` coordinates (the slices'
    switch, the only other node of a torus, stays where it is)."""
    if not loads or not np.any(by):
        return dict(loads)
    sizes = np.asarray([l.size for l in topology.levels], dtype=np.int64)
    strides = np.concatenate([[1], np.cumprod(sizes)[:-1]]).astype(np.int64)
    switch = slice_switch(topology)
    if switch is None:
        ends = np.asarray(list(loads), dtype=np.int64)  # (links, 2)
    else:  # the switch end as -1, kept
        ends = np.asarray([[-1 if x == switch else x for x in link] for link in loads], dtype=np.int64)

    def move(ids: np.ndarray) -> list:
        moved = (((ids[:, None] // strides % sizes) + by) % sizes * strides).sum(axis=1)
        return [switch if i < 0 else m for i, m in zip(ids.tolist(), moved.tolist())] if switch else moved.tolist()

    return dict(zip(zip(move(ends[:, 0]), move(ends[:, 1])), loads.values()))


def touching(topology: Topology, instances: Sequence[Sequence[int]], nodes: Sequence[int]) -> list:
    """The instances (groups or sender/receiver pairs) whose routes can pass through any of ``nodes``.

    A dimension-ordered route moves only along the dims where its ends differ,
    so every node on an instance's routes has the instance's coordinates along
    the dims its members share; an instance that differs from every node there
    is left out. Exact: no instance that could load a link through ``nodes`` is dropped. The slices' switch
    is left out of ``nodes``: each of its links has a chip at the other end, which stands for it.
    """
    nodes = [x for x in nodes if not isinstance(x, str)]
    if not len(instances) or not len(nodes):
        return []
    first, fixed = _slabs(topology, instances)
    at = _coords(topology, np.asarray(sorted(set(nodes)), dtype=np.int64))  # (W, L)
    same = (at[None, :, :] == first[:, None, :]) | ~fixed[:, None, :]  # (I, W, L)
    keep = np.any(np.all(same, axis=2), axis=1)
    return [instances[i] for i in np.flatnonzero(keep)]


def _slabs(topology: Topology, instances: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(coordinates of each instance's first member, which dims its members share), memoized per instances object."""
    key = ("__slabs__", id(instances))
    hit = topology._routes.get(key)
    if hit is not None and hit[0] is instances:
        return hit[1], hit[2]
    members = np.asarray(instances, dtype=np.int64)  # (I, m)
    coords = _coords(topology, members.reshape(-1)).reshape(*members.shape, -1)  # (I, m, L)
    fixed = np.all(coords == coords[:, :1, :], axis=1)  # (I, L): dims the instance does not vary along
    topology._routes[key] = (instances, coords[:, 0, :], fixed)  # holds the instances, so the id stays theirs
    return coords[:, 0, :], fixed
