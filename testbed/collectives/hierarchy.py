"""Closed form of the ``hierarchical`` algorithm on every device under one switch of a hierarchy, at any size.

``hierarchical`` reduce-scatters with a one-direction ring inside the
innermost level, then along each outer level on the part it owns, and
all-gathers back (:mod:`testbed.collectives.algorithms`). When the group is
every device under one level-K switch of a ``levels`` topology (``--over
node,cluster`` or ``all``), every rank is alike: in a phase along level ``k``
each rank sends to its ring neighbour, whose route climbs to the level-k
switch (:func:`testbed.topology.routing.route`). Along that climb a device's
own link (a level attached per device, or the innermost) carries one
transfer; a link from a level-(j-1) switch up to a level-j switch (a level
attached per switch) carries the transfers of every device below it, ``block
= prod(sizes below j)``. So a round of a phase along level k with ``c``
chunks per transfer lasts ``overhead + 2 * sum(latency) + c * chunk * max over
the climb (count / bandwidth)``, as a routed round does; reduce-scatter moves
``held / m`` per round for ``m - 1`` rounds, all-gather ``held``. Equal to
the routed program (tested on two- and three-level hierarchies, both kinds of
attachment).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from testbed.collectives.ops import Op, parse_op
from testbed.topology import Form, Topology

__all__ = ["under_one_switch", "hierarchical_time", "hierarchical_link_loads"]


def under_one_switch(topology: Topology, group: Sequence[int]) -> int | None:
    """K when ``group`` is every device under one level-K switch in device order, with two or more levels of size
    > 1 among levels 0..K (the ``hierarchical`` algorithm's grid), else None."""
    if topology.form is not Form.LEVELS or len(group) < 2:
        return None
    sizes = [level.size for level in topology.levels]
    block, top = 1, None
    for k, size in enumerate(sizes):
        block *= size
        if block >= len(group):
            top = k
            break
    if top is None or block != len(group) or sum(1 for s in sizes[:top + 1] if s > 1) < 2:
        return None
    devices = np.asarray(group, dtype=np.int64)
    if devices[0] % block or np.any(np.diff(devices) != 1):
        return None
    return top


def _climb(topology: Topology, k: int) -> list[tuple[float, float, int, int]]:
    """(latency, bandwidth, devices whose sends share the link, level) of each link from a device up to its
    level-k switch, as routing climbs (per-device attachment: one device; per-switch: all below)."""
    level = topology.levels[k]
    if k == 0 or level.attach == "device":
        return [(float(level.latency), float(level.bandwidth), 1, k)]
    below = math.prod(l.size for l in topology.levels[:k])
    return [*_climb(topology, k - 1), (float(level.latency), float(level.bandwidth), below, k)]


def _phases(topology: Topology, op: Op, top: int, n: int) -> list[tuple[int, int, int]]:
    """(level, rounds, chunks per transfer) of each phase; one ring direction, ``n`` pieces for all_reduce."""
    order = [k for k in range(top + 1) if topology.levels[k].size > 1]
    held = 1 if op is Op.ALL_GATHER else n
    out = []
    if op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER):
        for k in order:
            held //= topology.levels[k].size
            out.append((k, topology.levels[k].size - 1, held))
    if op in (Op.ALL_REDUCE, Op.ALL_GATHER):
        for k in reversed(order):
            out.append((k, topology.levels[k].size - 1, held))
            held *= topology.levels[k].size
    return out


def hierarchical_time(topology: Topology, op: Op | str, group: Sequence[int], nbytes: float
                      ) -> tuple[float, int] | None:
    """(seconds, rounds) of ``hierarchical`` over ``group``, or None unless it is every device under one switch."""
    op = parse_op(op)
    top = under_one_switch(topology, group)
    if top is None or op not in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER):
        return None
    n = len(group)
    chunk = float(nbytes) / n  # all_reduce: n pieces of one block; gather/scatter: n blocks of one piece
    overhead = topology.calibration.collectives.overhead_s
    total, rounds = 0.0, 0
    for k, count, held in _phases(topology, op, top, n):
        climb = _climb(topology, k)
        alpha = 2 * sum(lat for lat, _, _, _ in climb)
        worst = max(users / bandwidth for _, bandwidth, users, _ in climb)
        total += count * (overhead + alpha + held * chunk * worst)
        rounds += count
    return total, rounds


def hierarchical_link_loads(topology: Topology, op: Op | str, group: Sequence[int], nbytes: float
                            ) -> dict[tuple[object, object], float] | None:
    """Bytes over each directed link during ``hierarchical`` over ``group`` (None unless under one switch)."""
    op = parse_op(op)
    top = under_one_switch(topology, group)
    if top is None or op not in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER):
        return None
    n = len(group)
    chunk = float(nbytes) / n
    per_level: dict[int, float] = {}  # bytes each device sends (and receives) up to each level's switch
    for k, count, held in _phases(topology, op, top, n):
        per_level[k] = per_level.get(k, 0.0) + count * held * chunk
    out: dict[tuple[object, object], float] = {}
    names = [level.name for level in topology.levels]
    blocks = [math.prod(l.size for l in topology.levels[:j + 1]) for j in range(len(names))]
    for k, nbytes_k in per_level.items():
        for device in group:
            node: object = device
            for _, _, users, j in _climb(topology, k):
                if users == 1:
                    node = device  # a per-device link starts at the device
                upper = f"{names[j]}{device // blocks[j]}"
                out[node, upper] = out.get((node, upper), 0.0) + nbytes_k
                out[upper, node] = out.get((upper, node), 0.0) + nbytes_k
                node = upper
    return out
