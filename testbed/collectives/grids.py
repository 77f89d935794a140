"""Step programs on a grid of ranks: dimension-ordered rings (``torus``, ``hierarchical``), every dim at once
(``multidim``, ``multislice``), and the open line (``line``).

Ranks are mixed-radix over ``dims`` (dims[0] fastest); each phase runs one of
:mod:`~testbed.collectives.lines`' line programs on every line of a dim at once.
:mod:`~testbed.collectives.algorithms` names these algorithms and builds their programs from here.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence

from testbed.collectives.lines import Rounds, merge, open_line, ring_line, rings
from testbed.collectives.ops import Op, num_blocks
from testbed.errors import InputError

__all__ = ["dim_ordered", "open_line_program", "multidim", "multidim_orders", "multidim_weights", "part_orders"]


def dim_ordered(op: Op, n: int, dims: Sequence[int], bidir: bool) -> tuple[int, Rounds]:
    """Reduce-scatter along dims first to last, all-gather last to first; returns (pieces, rounds)."""
    coord, lines = _grid(n, dims)
    h = 2 if bidir else 1
    pieces = n * h if op is Op.ALL_REDUCE else h
    chunks = num_blocks(op, n) * pieces
    owner = [c // h for c in range(chunks)]  # all_reduce: piece p belongs to rank p // h; else block index
    active = [d for d in range(len(dims)) if dims[d] > 1]
    rounds = _along_dims(op, n, dims, coord, {d: lines(d) for d in active}, active, list(range(chunks)), owner,
                         lambda ranks, parts, reduce: rings(ranks, parts, reduce, bidir))
    return pieces, rounds


def _along_dims(op: Op, n: int, dims: Sequence[int], coord: Callable[[int, int], int], lines: dict[int, list],
                order: Sequence[int], chunks: list[int], owner: Sequence[int],
                line_rounds: Callable[[list[int], list[list[int]], bool], Rounds]) -> Rounds:
    """``chunks`` reduce-scattered along the dims of ``order`` (chunk c ends on the rank ``owner[c]``), then
    all-gathered back in reverse, each phase running ``line_rounds`` on every line of its dim at once.

    reduce_scatter stops after the first half, all_gather starts from each rank's own chunks.
    """
    rounds: Rounds = []
    if op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER):
        owned = [chunks for _ in range(n)]
        for d in order:
            phase = []
            for line in lines[d]:
                parts = [[c for c in owned[line[0]] if coord(owner[c], d) == i] for i in range(dims[d])]
                phase.append(line_rounds(line, parts, True))
                for i, r in enumerate(line):
                    owned[r] = parts[i]
            rounds += merge(*phase)
    else:
        owned = [[c for c in chunks if owner[c] == r] for r in range(n)]
    if op in (Op.ALL_REDUCE, Op.ALL_GATHER):
        for d in reversed(order):
            phase = []
            for line in lines[d]:
                parts = [owned[r] for r in line]
                phase.append(line_rounds(line, parts, False))
                merged = sorted(itertools.chain.from_iterable(parts))
                for r in line:
                    owned[r] = merged
            rounds += merge(*phase)
    return rounds


def _grid(n: int, dims: Sequence[int]):
    """(coord(rank, d), lines(d)) of the mixed-radix rank grid ``dims`` (dims[0] fastest)."""
    if math.prod(dims) != n:
        raise InputError(f"dims {list(dims)} must multiply to the rank count {n}", field="dims")
    strides = [math.prod(dims[:i]) for i in range(len(dims))]

    def coord(rank: int, d: int) -> int:
        return rank // strides[d] % dims[d]

    def lines(d: int) -> list[list[int]]:
        """Lines of ranks along dim d, each in coordinate order."""
        starts = [r for r in range(n) if coord(r, d) == 0]
        return [[r + i * strides[d] for i in range(dims[d])] for r in starts]

    return coord, lines


def multidim_orders(dims: Sequence[int]) -> list[list[int]]:
    """The reduce-scatter dim order of each of the D parts of ``multidim`` (dims of size > 1, rotated by i)."""
    active = [d for d in range(len(dims)) if dims[d] > 1]
    return [active[i:] + active[:i] for i in range(len(active))]


@functools.lru_cache(maxsize=256)
def multidim_weights(dims: tuple[int, ...]) -> tuple[int, ...]:
    """Share of the buffer (in units) of each ``multidim`` part: equal, or proportional to its first dim's size.

    Rounds are global, so on unequal dims the part starting on a short dim
    (which moves ``1/m`` of its share per round) sets the pace; weighting each
    part by its first dim's size evens the first phase (32x32x16: 11.3 -> 9.3 ms
    for 1 GiB). The weighting whose rounds carry fewer bytes over the busiest
    link (in units of the buffer; every dim's links alike) is taken, equal on a tie.
    """
    orders = multidim_orders(dims)
    if not orders:
        return ()
    g = math.gcd(*(dims[o[0]] for o in orders))
    options = [tuple(1 for _ in orders), tuple(dims[o[0]] // g for o in orders)]
    return min(options, key=lambda w: (_lockstep_load(dims, orders, w), w != options[0]))


def part_orders(algorithm: str, dims: Sequence[int]) -> tuple[list[list[int]], tuple[int, ...]]:
    """(reduce-scatter dim order, units of the buffer) of each part (each way round) of ``multidim`` or
    ``multislice``: ``multislice`` is ``multidim`` over every dim but the last, the last appended to every
    order (inside the slices first, then across them on what each rank owns)."""
    if algorithm != "multislice":
        return multidim_orders(dims), multidim_weights(tuple(dims))
    inner, last = tuple(dims[:-1]), len(dims) - 1
    tail = [last] if dims and dims[-1] > 1 else []
    orders = multidim_orders(inner)
    if not orders:
        return ([tail], (1,)) if tail else ([], ())
    return [order + tail for order in orders], multidim_weights(inner)


def _lockstep_load(dims: Sequence[int], orders: list[list[int]], weights: Sequence[int]) -> float:
    """Sum over an all-reduce's rounds of the busiest directed link's share of the buffer (bandwidth term)."""
    streams = []
    total = 2 * sum(weights)
    for order, w in zip(orders, weights):
        for direction in (1, -1):
            held, steps = w / total, []
            for d in order:
                held /= dims[d]
                steps += [(d, direction if dims[d] > 2 else 1, held)] * (dims[d] - 1)
            for d in reversed(order):
                steps += [(d, direction if dims[d] > 2 else 1, held)] * (dims[d] - 1)
                held *= dims[d]
            streams.append(steps)
    cost = 0.0
    for k in range(max(len(s) for s in streams)):
        load: dict[tuple[int, int], float] = {}
        for steps in streams:
            if k < len(steps):
                d, way, share = steps[k]
                load[d, way] = load.get((d, way), 0.0) + share
        cost += max(load.values())
    return cost


def multidim(op: Op, n: int, dims: Sequence[int], algorithm: str = "multidim") -> tuple[int, Rounds]:
    """Every dim at once: 2D parts (part i each way round), part i reduce-scatters along dims rotated by i.

    Part i (each way) has ``w_i`` units of the buffer (:func:`multidim_weights`),
    ``U = 2 sum(w)`` units in all. Chunk layout: all_reduce has ``pieces = U * n``
    (chunk c is in unit ``c // n`` and ends owned by rank ``c % n``);
    all_gather and reduce_scatter have ``pieces = U`` per block (chunk c is unit
    ``c % U`` of block ``c // U``, owned by rank ``c // U``). Parts touch
    disjoint chunks, so their rounds run side by side; part i's phase k uses
    dim ``orders[i][k]`` in its direction.
    """
    coord, lines = _grid(n, dims)
    orders, weights = part_orders(algorithm, dims)
    parts = 2 * len(orders)
    if parts == 0:
        return 1, []
    slots = [2 * i + way for i, w in enumerate(weights) for way in (0, 1) for _ in range(w)]  # unit -> part
    pieces = len(slots) * n if op is Op.ALL_REDUCE else len(slots)
    chunks = num_blocks(op, n) * pieces
    if op is Op.ALL_REDUCE:
        part_of, owner = [slots[c // n] for c in range(chunks)], [c % n for c in range(chunks)]
    else:
        part_of, owner = [slots[c % len(slots)] for c in range(chunks)], [c // len(slots) for c in range(chunks)]
    line_cache = {d: lines(d) for d in range(len(dims)) if dims[d] > 1}
    phases: list[Rounds] = []
    for part in range(parts):
        order, direction = orders[part // 2], (1, -1)[part % 2]
        mine = [c for c in range(chunks) if part_of[c] == part]
        phases.append(_along_dims(op, n, dims, coord, line_cache, order, mine, owner,
                                  lambda line, split, reduce, direction=direction:
                                  ring_line(line, split, reduce, direction)))
    return pieces, merge(*phases)


def open_line_program(op: Op, n: int) -> tuple[int, Rounds]:
    """``line``: reduce-scatter then all-gather both ways along the open line of ranks 0..n-1
    (:func:`~testbed.collectives.lines.open_line`); returns (pieces, rounds)."""
    coord, lines = _grid(n, (n,))
    pieces = n if op is Op.ALL_REDUCE else 1
    chunks = num_blocks(op, n) * pieces
    owner = list(range(chunks))  # all_reduce: piece p ends on rank p; else block b is rank b's
    return pieces, _along_dims(op, n, (n,), coord, {0: lines(0)}, [0], list(range(chunks)), owner,
                               open_line)
