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
- ``gloo_halving_doubling``: gloo's reduce-scatter, the one XLA:CPU runs
  across processes (:func:`testbed.collectives.gloo.gloo_reduce_scatter`):
  recursive halving nearest partner first, then every block sent to its
  rank; a non-power-of-two n is priced as ``halving_doubling`` (gloo's
  binary blocks are not modelled). Applies only where gloo runs.
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
- ``line``: both ways along an open line of ranks 0..n-1 (no wrap step;
  applies to a group along one torus dim without a wrap link of its own,
  as TPU ICI axes without wraparound, in coordinate order): all-gather passes every block one hop a
  round towards both ends (n-1 rounds, one block per link and direction a
  round), reduce-scatter is its reverse, all-reduce the two in turn.

The line programs are :mod:`~testbed.collectives.lines`', the grid programs
:mod:`~testbed.collectives.grids`'.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from testbed.collectives.gloo import gloo_reduce_scatter
from testbed.collectives.grids import dim_ordered, multidim, multidim_orders, multidim_weights, open_line_program, \
    part_orders
from testbed.collectives.lines import Rounds, merge as _merge, transfer as _t
from testbed.collectives.ops import Op, StepProgram, Transfer, num_blocks, parse_op
from testbed.errors import InputError, unknown_key_message

__all__ = ["ALGORITHMS", "SUPPORTED_OPS", "GRID_ALGORITHMS", "step_program", "parse_algorithm", "TREE_PIECES",
           "multidim_orders", "multidim_weights", "part_orders"]

#: NCCL's algorithms (testbed.collectives.nccl): timed by NCCL's model, not generated as step programs.
NCCL_ALGORITHMS: tuple[str, ...] = ("nccl_ring", "nccl_tree", "nvls", "nvls_tree", "sharp")

#: pieces per tree half (double binary tree) and per chain (ring broadcast) for pipelining.
TREE_PIECES = 8

SUPPORTED_OPS: dict[str, tuple[Op, ...]] = {
    "ring": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.BROADCAST),
    "bidir_ring": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.BROADCAST),
    "halving_doubling": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.BROADCAST),
    "gloo_halving_doubling": (Op.REDUCE_SCATTER,),
    "double_binary_tree": (Op.ALL_REDUCE,),
    "direct": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL, Op.BROADCAST, Op.SEND),
    "one_shot": (Op.ALL_REDUCE,),
    "pairwise": (Op.ALL_TO_ALL,),
    "torus": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER),
    "hierarchical": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER),
    "multidim": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER),
    "multislice": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER),
    "line": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER),
}
#: Algorithms laid out on a rank grid (``dims``) rather than a line of ranks.
GRID_ALGORITHMS: tuple[str, ...] = ("torus", "hierarchical", "multidim", "multislice", "line")
ALGORITHMS: tuple[str, ...] = tuple(SUPPORTED_OPS)


def parse_algorithm(name: str) -> str:
    """The algorithm called ``name`` (``auto`` included), or an InputError with the closest name."""
    key = str(name).strip().lower().replace("-", "_")
    if key == "auto" or key in ALGORITHMS or key in NCCL_ALGORITHMS:
        return key
    raise InputError(unknown_key_message(str(name), (*ALGORITHMS, *NCCL_ALGORITHMS, "auto"), what="algorithm"),
                     field="algorithm")


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
        return dim_ordered(op, n, (n,), bidir)
    if algorithm in ("torus", "hierarchical"):
        return dim_ordered(op, n, dims or (n,), algorithm == "torus")
    if algorithm in ("multidim", "multislice"):
        return multidim(op, n, dims or (n,), algorithm)
    if algorithm == "line":
        return open_line_program(op, n)
    if algorithm == "halving_doubling":
        if op is Op.BROADCAST:
            return 1, _binomial_broadcast(n, root)
        return _halving_doubling(op, n)
    if algorithm == "gloo_halving_doubling":
        return gloo_reduce_scatter(n) if n & (n - 1) == 0 else _halving_doubling(op, n)
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

