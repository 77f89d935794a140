"""Collective algorithms: generators of step programs.

Each algorithm turns (op, n ranks, a few shape parameters) into a frozen
:class:`~testbed.collectives.ops.StepProgram`. Programs depend only on ranks, never
on bytes, so they are memoized and shared by the simulator and the runner.

- ``ring``: one direction around ranks 0..n-1 (reduce-scatter then all-gather).
- ``bidir_ring``: half the data each way round the ring, in the same rounds.
- ``halving_doubling``: recursive halving reduce-scatter, recursive doubling
  all-gather (Rabenseifner); for non-power-of-two n the ``n - p`` extra ranks
  fold into ranks ``0..n-p-1`` before and are served after; broadcast is a
  binomial tree.
- ``double_binary_tree``: two complementary binary trees (heap order over
  ranks and over reversed ranks), each reducing and broadcasting half of the
  buffer in pipelined pieces.
- ``direct``: everyone sends straight to its destination through a switch
  (two-shot all-reduce: reduce-scatter round, all-gather round).
- ``one_shot``: all-reduce in one round, every rank sends the whole buffer to
  every other rank.
- ``pairwise``: all-to-all in n-1 shift rounds (rank r sends to r+k in round k).
- ``torus``: dimension-ordered, a bidirectional ring along each dim in turn
  (reduce-scatter dims first to last, all-gather last to first); ``dims``
  gives the sizes, ranks mixed-radix with dims[0] fastest.
- ``hierarchical``: the same dimension order over levels with one-direction
  rings: reduce-scatter inside the inner level, all-reduce across the outer
  level on the owned part, all-gather inside.
- ``multidim``: every torus dim at once, as TPU ICI collectives do. With D
  dims of size > 1 the buffer is cut into 2D parts; part (i, direction) runs
  one-direction rings along the dims in the order rotated by i (reduce-scatter
  dims i, i+1, .., all-gather back), so at any time each dim carries one
  part each way and all 2D link directions of every rank are busy.
- ``multislice``: for the slices of a multi-slice TPU pod (the grid's last
  dim): ``multidim`` over the other dims (inside each slice, on ICI), with the
  last dim appended to every part's order, so each chip reduce-scatters in
  its slice, all-reduces the part it owns across the slices (rings over the
  data-center network) and all-gathers back in its slice.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence

from testbed.collectives.ops import Op, StepProgram, Transfer, num_blocks, parse_op
from testbed.errors import InputError, unknown_key_message

__all__ = ["ALGORITHMS", "SUPPORTED_OPS", "GRID_ALGORITHMS", "step_program", "parse_algorithm", "TREE_PIECES",
           "multidim_orders", "multidim_weights", "part_orders"]

Rounds = list[list[Transfer]]

#: NCCL's algorithms (testbed.collectives.nccl): timed by NCCL's model, not generated as step programs.
NCCL_ALGORITHMS: tuple[str, ...] = ("nccl_ring", "nccl_tree", "nvls", "nvls_tree", "sharp")

#: pieces per tree half (double binary tree) and per chain (ring broadcast) for pipelining.
TREE_PIECES = 8

SUPPORTED_OPS: dict[str, tuple[Op, ...]] = {
    "ring": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.BROADCAST),
    "bidir_ring": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.BROADCAST),
    "halving_doubling": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.BROADCAST),
    "double_binary_tree": (Op.ALL_REDUCE,),
    "direct": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL, Op.BROADCAST, Op.SEND),
    "one_shot": (Op.ALL_REDUCE,),
    "pairwise": (Op.ALL_TO_ALL,),
    "torus": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER),
    "hierarchical": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER),
    "multidim": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER),
    "multislice": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER),
}
#: Algorithms laid out on a rank grid (``dims``) rather than a line of ranks.
GRID_ALGORITHMS: tuple[str, ...] = ("torus", "hierarchical", "multidim", "multislice")
ALGORITHMS: tuple[str, ...] = tuple(SUPPORTED_OPS)


def parse_algorithm(name: str) -> str:
    """The algorithm called ``name`` (``auto`` included), or an InputError with the closest name."""
    key = str(name).strip().lower().replace("-", "_")
    if key == "auto" or key in ALGORITHMS or key in NCCL_ALGORITHMS:
        return key
    raise InputError(unknown_key_message(str(name), (*ALGORITHMS, *NCCL_ALGORITHMS, "auto"), what="algorithm"),
                     field="algorithm")


def _merge(*phases: Rounds) -> Rounds:
    """Run phases side by side: round k of the result is round k of every phase."""
    return [list(itertools.chain.from_iterable(rs)) for rs in itertools.zip_longest(*phases, fillvalue=[])]


def _t(src: int, dst: int, chunk: int, reduce: bool, dst_chunk: int | None = None) -> Transfer:
    return Transfer(src=src, dst=dst, src_chunk=chunk, dst_chunk=chunk if dst_chunk is None else dst_chunk,
                    reduce=reduce)


# -- rings along lines ---------------------------------------------------------------

def _ring_line(ranks: Sequence[int], parts: Sequence[Sequence[int]], reduce: bool, direction: int) -> Rounds:
    """Ring reduce-scatter (``reduce``) or all-gather over ``ranks``; ``parts[i]`` is what ranks[i] ends owning
    (reduce-scatter) or starts owning (all-gather)."""
    m = len(ranks)
    rounds: Rounds = []
    for k in range(m - 1):
        round_ = []
        for i in range(m):
            off = (k + 1 if reduce else k) * direction
            c = (i - off) % m
            j = (i + direction) % m
            round_.extend(_t(ranks[i], ranks[j], s, reduce) for s in parts[c])
        rounds.append(round_)
    return rounds


def _line(ranks: Sequence[int], parts: Sequence[Sequence[int]], reduce: bool, bidir: bool) -> Rounds:
    if not bidir:
        return _ring_line(ranks, parts, reduce, +1)
    halves = [(len(p) + 1) // 2 for p in parts]
    forward = [p[:h] for p, h in zip(parts, halves)]
    backward = [p[h:] for p, h in zip(parts, halves)]
    return _merge(_ring_line(ranks, forward, reduce, +1), _ring_line(ranks, backward, reduce, -1))


def _dim_ordered(op: Op, n: int, dims: Sequence[int], bidir: bool) -> tuple[int, Rounds]:
    """Reduce-scatter along dims first to last, all-gather last to first; returns (pieces, rounds)."""
    coord, lines = _grid(n, dims)
    h = 2 if bidir else 1
    pieces = n * h if op is Op.ALL_REDUCE else h
    chunks = num_blocks(op, n) * pieces
    owner = [c // h for c in range(chunks)]  # all_reduce: piece p belongs to rank p // h; else block index
    active = [d for d in range(len(dims)) if dims[d] > 1]
    rounds = _along_dims(op, n, dims, coord, {d: lines(d) for d in active}, active, list(range(chunks)), owner,
                         lambda line, parts, reduce: _line(line, parts, reduce, bidir))
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
            rounds += _merge(*phase)
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
            rounds += _merge(*phase)
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


def _multidim(op: Op, n: int, dims: Sequence[int], algorithm: str = "multidim") -> tuple[int, Rounds]:
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
                                  _ring_line(line, split, reduce, direction)))
    return pieces, _merge(*phases)


# -- halving-doubling ------------------------------------------------------------------

def _halving_doubling(op: Op, n: int) -> tuple[int, Rounds]:
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    if op is Op.ALL_REDUCE:
        pieces, chunks = p, p
        owner = list(range(p))
    else:
        pieces, chunks = 1, n
        owner = [c if c < p else c - p for c in range(n)]
    rounds: Rounds = []
    if op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER):
        if extra:
            rounds.append([_t(p + i, i, c, True) for i in range(extra) for c in range(chunks)])
        held = [set(range(chunks)) for _ in range(p)]
        d = p // 2
        while d >= 1:
            round_ = []
            for r in range(p):
                q = r ^ d
                give = sorted(c for c in held[r] if owner[c] & d == q & d)
                round_.extend(_t(r, q, c, True) for c in give)
                held[r] -= set(give)
            rounds.append(round_)
            d //= 2
        if op is Op.REDUCE_SCATTER and extra:
            rounds.append([_t(i, p + i, p + i, False) for i in range(extra)])
    if op in (Op.ALL_REDUCE, Op.ALL_GATHER):
        if op is Op.ALL_REDUCE:
            held = [{r} for r in range(p)]
        else:
            if extra:
                rounds.append([_t(p + i, i, p + i, False) for i in range(extra)])
            held = [{c for c in range(chunks) if owner[c] == r} for r in range(p)]
        d = 1
        while d < p:
            rounds.append([_t(r, r ^ d, c, False) for r in range(p) for c in sorted(held[r])])
            held = [held[r] | held[r ^ d] for r in range(p)]
            d *= 2
        if extra:
            rounds.append([_t(i, p + i, c, False) for i in range(extra) for c in range(chunks)])
    return pieces, rounds


def _binomial_broadcast(n: int, root: int) -> Rounds:
    rounds: Rounds = []
    d = 1
    while d < n:
        rounds.append([_t((root + rel) % n, (root + rel + d) % n, 0, False) for rel in range(d) if rel + d < n])
        d *= 2
    return rounds


# -- trees -----------------------------------------------------------------------------

def _tree(order: Sequence[int], slots: Sequence[int]) -> Rounds:
    """Pipelined reduce up then broadcast down a heap-ordered binary tree over ``order``."""
    n = len(order)
    height = [0] * n
    for i in reversed(range(n)):
        kids = [c for c in (2 * i + 1, 2 * i + 2) if c < n]
        height[i] = 1 + max(height[c] for c in kids) if kids else 0
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[(i - 1) // 2] + 1
    top = height[0]
    timed: dict[int, list[Transfer]] = {}
    for i in range(1, n):
        parent = (i - 1) // 2
        for j, s in enumerate(slots):
            timed.setdefault(height[i] + j, []).append(_t(order[i], order[parent], s, True))
            timed.setdefault(top + depth[parent] + j, []).append(_t(order[parent], order[i], s, False))
    return [timed.get(k, []) for k in range(max(timed, default=-1) + 1)]


# -- generators ------------------------------------------------------------------------

def _ring_broadcast(n: int, root: int, bidir: bool) -> tuple[int, Rounds]:
    chains = 2 if bidir else 1
    per = min(TREE_PIECES, max(1, n))
    phases = []
    for chain in range(chains):
        step = 1 if chain == 0 else -1
        timed: Rounds = [[] for _ in range(n - 1 + per - 1)]
        for hop in range(n - 1):
            src, dst = (root + step * hop) % n, (root + step * (hop + 1)) % n
            for j in range(per):
                timed[hop + j].append(_t(src, dst, chain * per + j, False))
        phases.append(timed)
    return chains * per, _merge(*phases)


def _direct(op: Op, n: int, root: int, peer: int) -> tuple[int, Rounds]:
    ranks = range(n)
    if op is Op.ALL_REDUCE:
        scatter = [_t(r, j, j, True) for r in ranks for j in ranks if j != r]
        gather = [_t(j, r, j, False) for j in ranks for r in ranks if j != r]
        return n, [scatter, gather] if n > 1 else []
    if op is Op.ALL_GATHER:
        return 1, [[_t(r, j, r, False) for r in ranks for j in ranks if j != r]] if n > 1 else []
    if op is Op.REDUCE_SCATTER:
        return 1, [[_t(r, j, j, True) for r in ranks for j in ranks if j != r]] if n > 1 else []
    if op is Op.ALL_TO_ALL:
        return 1, [[_t(r, j, j, False, dst_chunk=n + r) for r in ranks for j in ranks]]
    if op is Op.BROADCAST:
        return 1, [[_t(root, j, 0, False) for j in ranks if j != root]] if n > 1 else []
    return 1, [[_t(root, peer, 0, False)]] if root != peer else []


def _build(op: Op, algorithm: str, n: int, dims: tuple[int, ...] | None, root: int, peer: int) -> tuple[int, Rounds]:
    if algorithm in ("ring", "bidir_ring"):
        bidir = algorithm == "bidir_ring"
        if op is Op.BROADCAST:
            return _ring_broadcast(n, root, bidir)
        return _dim_ordered(op, n, (n,), bidir)
    if algorithm in ("torus", "hierarchical"):
        return _dim_ordered(op, n, dims or (n,), algorithm == "torus")
    if algorithm in ("multidim", "multislice"):
        return _multidim(op, n, dims or (n,), algorithm)
    if algorithm == "halving_doubling":
        if op is Op.BROADCAST:
            return 1, _binomial_broadcast(n, root)
        return _halving_doubling(op, n)
    if algorithm == "double_binary_tree":
        if n == 1:
            return 1, []
        per = TREE_PIECES
        first = _tree(list(range(n)), list(range(per)))
        second = _tree([n - 1 - i for i in range(n)], list(range(per, 2 * per)))
        return 2 * per, _merge(first, second)
    if algorithm == "one_shot":
        return 1, [[_t(r, j, 0, True) for r in range(n) for j in range(n) if j != r]] if n > 1 else []
    if algorithm == "pairwise":
        shifts = [[0, 1], *[[k] for k in range(2, n)]] if n > 1 else [[0]]
        return 1, [[_t(r, (r + k) % n, (r + k) % n, False, dst_chunk=n + r) for k in ks for r in range(n)]
                   for ks in shifts]
    return _direct(op, n, root, peer)


@functools.lru_cache(maxsize=512)
def _cached(op: Op, algorithm: str, n: int, dims: tuple[int, ...] | None, root: int, peer: int) -> StepProgram:
    pieces, rounds = _build(op, algorithm, n, dims, root, peer)
    return StepProgram(op=op, algorithm=algorithm, n=n, blocks=num_blocks(op, n), pieces=pieces,
                       rounds=tuple(tuple(r) for r in rounds if r), root=root, peer=peer)


def step_program(op: Op | str, algorithm: str, n: int, *, dims: Sequence[int] | None = None,
                 root: int = 0, peer: int | None = None) -> StepProgram:
    """The step program of ``algorithm`` for ``op`` on ``n`` ranks (memoized; programs are immutable).

    Args:
        dims: rank grid for ``torus``/``hierarchical``/``multidim`` (innermost first, product n); default ``(n,)``.
        root: broadcast root / sender of ``send``. peer: receiver of ``send`` (default root + 1).
    """
    op = parse_op(op)
    algorithm = parse_algorithm(algorithm)
    if algorithm == "auto":
        raise InputError("`auto` needs a topology to choose on; name an algorithm", field="algorithm")
    if algorithm in NCCL_ALGORITHMS:
        raise InputError(f"`{algorithm}` is NCCL's, timed by NCCL's model (testbed.collectives.nccl), not a step "
                         f"program; step-program algorithms: {', '.join(ALGORITHMS)}", field="algorithm")
    if not isinstance(n, int) or n < 1:
        raise InputError(f"needs at least one rank, got {n!r}", field="n")
    if op not in SUPPORTED_OPS[algorithm]:
        able = [a for a in ALGORITHMS if op in SUPPORTED_OPS[a]]
        raise InputError(f"algorithm `{algorithm}` does not implement {op}; algorithms that do: {', '.join(able)}",
                         field="algorithm")
    if peer is None:
        peer = (root + 1) % n
    if op is Op.SEND and n > 1 and root == peer:
        raise InputError("send needs a peer different from the root", field="peer")
    key_dims = tuple(int(d) for d in dims) if dims is not None and algorithm in GRID_ALGORITHMS else None
    return _cached(op, algorithm, n, key_dims, int(root), int(peer))

