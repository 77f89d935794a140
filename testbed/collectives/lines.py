"""Step programs along one line of ranks: rings (one way or both) and the open line (no wrap step).

The building blocks of every ring-based algorithm (:mod:`~testbed.collectives.algorithms`) and of the
dimension-ordered grid algorithms (:mod:`~testbed.collectives.grids`): each returns the rounds of a
reduce-scatter (``reduce``) or an all-gather over ``ranks``, where ``parts[i]`` is the chunks ``ranks[i]``
ends owning (reduce-scatter) or starts owning (all-gather).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from testbed.collectives.ops import Transfer

__all__ = ["Rounds", "merge", "transfer", "ring_line", "rings", "open_line"]

Rounds = list[list[Transfer]]


def merge(*phases: Rounds) -> Rounds:
    """Run phases side by side: round k of the result is round k of every phase."""
    return [list(itertools.chain.from_iterable(rs)) for rs in itertools.zip_longest(*phases, fillvalue=[])]


def transfer(src: int, dst: int, chunk: int, reduce: bool, dst_chunk: int | None = None) -> Transfer:
    """One transfer of ``chunk`` from ``src`` to ``dst`` (into ``dst_chunk``, the same chunk by default)."""
    return Transfer(src=src, dst=dst, src_chunk=chunk, dst_chunk=chunk if dst_chunk is None else dst_chunk,
                    reduce=reduce)


def ring_line(ranks: Sequence[int], parts: Sequence[Sequence[int]], reduce: bool, direction: int) -> Rounds:
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
            round_.extend(transfer(ranks[i], ranks[j], s, reduce) for s in parts[c])
        rounds.append(round_)
    return rounds


def rings(ranks: Sequence[int], parts: Sequence[Sequence[int]], reduce: bool, bidir: bool) -> Rounds:
    """:func:`ring_line` one way round, or (``bidir``) each part's first half one way and the rest the other."""
    if not bidir:
        return ring_line(ranks, parts, reduce, +1)
    halves = [(len(p) + 1) // 2 for p in parts]
    forward = [p[:h] for p, h in zip(parts, halves)]
    backward = [p[h:] for p, h in zip(parts, halves)]
    return merge(ring_line(ranks, forward, reduce, +1), ring_line(ranks, backward, reduce, -1))


def open_line(ranks: Sequence[int], parts: Sequence[Sequence[int]], reduce: bool) -> Rounds:
    """Both ways along an open line (no link from the last rank back to the first), one hop a round.

    All-gather: in round k rank i passes block ``i - k`` on to the right and block ``i + k`` on to the left,
    so every block reaches both ends in ``m - 1`` rounds and each link carries one block each way a round,
    where a ring's wrap step would cross the whole line. Reduce-scatter is that program reversed in time
    (every transfer turned round, adding): the partial sums of block b flow in from both ends and meet at
    ``ranks[b]`` in the last round.
    """
    m = len(ranks)
    if reduce:
        return [[transfer(t.dst, t.src, t.src_chunk, True) for t in round_]
                for round_ in reversed(open_line(ranks, parts, False))]
    rounds: Rounds = []
    for k in range(m - 1):
        round_ = [transfer(ranks[i], ranks[i + 1], c, False) for i in range(k, m - 1) for c in parts[i - k]]
        round_ += [transfer(ranks[i], ranks[i - 1], c, False) for i in range(1, m - k) for c in parts[i + k]]
        rounds.append(round_)
    return rounds
