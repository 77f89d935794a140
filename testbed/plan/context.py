"""Context parallelism: which tokens of a sequence each ``context`` rank holds.

Causal attention gives later tokens more work (token ``i`` attends to ``i + 1``
keys), so cutting a sequence into ``c`` contiguous pieces would leave the last
rank with ``2c - 1`` times the first one's attention. The load-balanced split
("zigzag", as Megatron-LM's context parallelism and Llama 3's training use it)
cuts the sequence into ``2c`` equal chunks and gives rank ``r`` chunks ``r``
and ``2c - 1 - r``: every rank then holds the same causal work. Both
interpreters read this one decision: the runner permutes tokens, targets and
positions with :func:`context_order`, and the simulator prices each rank's
share of the attention from :func:`context_chunks`.
"""

from __future__ import annotations

import numpy as np

from testbed.errors import InputError

__all__ = ["context_chunks", "context_positions", "context_order", "ring_source", "ring_step_pairs", "ring_step_units",
           "FULL", "DIAGONAL", "EMPTY"]


def _check(seq_len: int, context: int) -> None:
    if context < 1 or seq_len % (2 * context):
        raise InputError(f"context parallelism cuts each sequence into 2 x context chunks: seq_len {seq_len} must be "
                         f"divisible by 2 x {context}", field="mesh.context")


def context_chunks(seq_len: int, context: int) -> tuple[tuple[int, int], ...]:
    """The two chunk indices (of ``2 * context`` chunks of ``seq_len / (2 context)`` tokens) each rank holds.

    With ``context`` 1 the one rank holds both halves, in order: the whole sequence.
    """
    _check(seq_len, context)
    return tuple((r, 2 * context - 1 - r) for r in range(context))


def context_positions(seq_len: int, context: int, rank: int) -> np.ndarray:
    """Positions in the sequence of the ``seq_len / context`` tokens rank ``rank`` holds, in its local order."""
    _check(seq_len, context)
    if not 0 <= rank < context:
        raise ValueError(f"rank {rank} outside the {context} context ranks")
    size = seq_len // (2 * context)
    first, second = context_chunks(seq_len, context)[rank]
    return np.concatenate([np.arange(first * size, (first + 1) * size), np.arange(second * size, (second + 1) * size)])


def context_order(seq_len: int, context: int) -> np.ndarray:
    """The permutation of a sequence's positions that lays the ranks' tokens out one after another.

    ``x[..., context_order(s, c), ...]`` split into ``c`` equal contiguous pieces gives each rank its tokens (the
    identity when ``c`` is 1); ``np.argsort`` of it restores the sequence order.
    """
    return np.concatenate([context_positions(seq_len, context, r) for r in range(context)])


# -- the ring's work per step (testbed/runner/ring_attention.py executes it; testbed.model.ring prices it) -----------

#: Kinds of a (query chunk, key chunk) pair under the causal mask.
FULL, DIAGONAL, EMPTY = "full", "diagonal", "empty"


def _pair_kind(query: int, key: int) -> str:
    return FULL if key < query else DIAGONAL if key == query else EMPTY


def ring_source(context: int, rank: int, step: int) -> int:
    """The rank whose K/V block rank ``rank`` holds at ring step ``step`` (blocks move from rank ``r`` to ``r + 1``)."""
    if not 0 <= rank < context or not 0 <= step < context:
        raise ValueError(f"rank {rank} and step {step} must be in 0..{context - 1}")
    return (rank - step) % context


def ring_step_pairs(context: int, rank: int, step: int) -> tuple[tuple[int, int, str], ...]:
    """The (query chunk, key chunk, kind) pairs rank ``rank`` computes at ring step ``step``, kind by the causal mask.

    Step 0 is the rank's own block: all four pairs of its two chunks, computed as one ``s_l x s_l`` block under
    the mask (two diagonal, one full, one empty). At a later step the visiting block of rank ``j`` is half
    visible: for ``j < rank`` both query chunks see key chunk ``j`` (two full pairs), for ``j > rank`` the
    second query chunk sees both of ``j``'s chunks (two full pairs); the invisible half is not computed
    (testbed/runner/ring_attention.py picks the half with ``lax.cond``). Chunk indices are of the ``2 * context``
    chunks of :func:`context_chunks`.
    """
    mine = (rank, 2 * context - 1 - rank)
    source = ring_source(context, rank, step)
    theirs = (source, 2 * context - 1 - source)
    if step == 0:
        pairs = [(q, k) for q in mine for k in mine]
    elif source < rank:
        pairs = [(q, theirs[0]) for q in mine]
    else:
        pairs = [(mine[1], k) for k in theirs]
    return tuple((q, k, _pair_kind(q, k)) for q, k in pairs)


def ring_step_units(context: int) -> tuple[int, ...]:
    """Chunk pairs each rank computes at each ring step: ``(4, 2, .., 2)``, the same on every rank (tested)."""
    return tuple(len(ring_step_pairs(context, 0, step)) for step in range(context))
