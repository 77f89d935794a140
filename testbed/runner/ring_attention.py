"""Ring attention: causal attention over a sequence split across the ``context`` mesh axis.

Context parallelism (the plan's ``mesh.context``, ``testbed.plan.context``) splits every sequence
over ``c`` ranks with the load-balanced ("zigzag") causal split: the sequence is cut into ``2c``
equal chunks and rank ``i`` holds chunks ``i`` and ``2c-1-i``, in that order, so every rank does
the same causal work (Megatron-LM's and Llama 3's context parallelism; ring attention, Liu et al.
2023, with Brandon et al.'s striped/zigzag balancing). :func:`ring_attention` runs inside a
``shard_map`` manual over that axis, on each rank's rows: q ``[batch, s_local, heads, head_dim]``,
k and v ``[batch, s_local, kv_heads, head_dim]`` (grouped-query heads as ``testbed.runner.attention``),
RoPE already applied at the rows' global (zigzag) positions.

Forward: ``c`` ring steps. Step 0 attends to the rank's own K/V (the two diagonal chunk pairs,
causally masked). Then K/V move one rank on (``jax.lax.ppermute``, rank ``r`` to ``r + 1``), so at
step ``t`` rank ``r`` holds the K/V of rank ``j = r - t (mod c)``; for ``j < r`` both query chunks
see all of K/V chunk ``j`` and none of chunk ``2c-1-j``, for ``j > r`` only the second query chunk
sees anything and it sees both K/V chunks, unmasked. A ``lax.cond`` on the rank picks the half
that is computed: every rank does the same ``s_local^2 / 2`` scores per step (the balance the
zigzag buys). Blocks merge with the online softmax (running row max, row sum and unnormalised
output, fp32), as FlashAttention; the causal mask comes from the rows' global positions, so it is
exact whatever the branch.

Backward: a ``custom_vjp`` that keeps only q, k, v, the output and the fp32 row log-sum-exp (no
``s_local x s_full`` buffer) and runs the ring again: each step recomputes its block's
probabilities from the log-sum-exp, adds to dQ locally, and adds dK, dV into fp32 accumulators
that travel around the ring with the K/V they belong to; one last ``ppermute`` brings each
accumulator home, cast to K/V's dtype first (XLA:TPU moves the cast ahead of that send by itself).
Communication per layer: ``c - 1`` K/V sends forward (K and V apart), ``c - 1`` K/V + dK/dV sends
(two stacked messages each) and one dK/dV send backward.

``block`` (flash attention, ``ModelSpec.flash_block``): each ring step also loops over key blocks
of ``gcd(block, s_local / 2)`` keys, so no buffer is larger than ``s_local x block`` per head;
None (plain attention): each step's scores are one ``s_local x s_local / 2`` block.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from testbed.runner.attention import block_grads, key_mask, online_softmax_step
from testbed.plan.context import context_order

__all__ = ["ring_attention", "zigzag_positions", "ContextShards", "context_shards"]


def zigzag_positions(s_local: int, size: int, rank: jax.Array | int) -> jax.Array:
    """Global positions ``[s_local]`` of context rank ``rank``'s rows (``rank`` may be traced): the row of
    testbed.plan.context's split (chunks ``rank`` and ``2*size-1-rank``) for that rank."""
    table = jnp.asarray(context_order(s_local * size, size).reshape(size, s_local), dtype=jnp.int32)
    return table[rank]


def _grouped(x: jax.Array, kv_heads: int) -> jax.Array:
    b, s, heads, d = x.shape
    return x.reshape(b, s, kv_heads, heads // kv_heads, d)


def _blocks(length: int, block: int | None) -> int:
    """Keys per block of one call over ``length`` keys (``length`` when not blocked)."""
    return length if block is None else math.gcd(block, length)


def _scores(qg: jax.Array, k: jax.Array, qpos: jax.Array, kpos: jax.Array, scale: float,
            window: int | None = None) -> tuple:
    """fp32 scores ``[b, sq, kv_heads, group, sk]`` and the causal visibility (global positions), within a
    sliding ``window`` of keys when one is set (masked: every block is still computed)."""
    scores = jnp.einsum("bqngd,bknd->bqngk", qg, k, preferred_element_type=jnp.float32) * scale
    return scores, key_mask(qpos, kpos, window)[None, :, None, None, :]


def _fwd_keys(carry: tuple, qg: jax.Array, k: jax.Array, v: jax.Array, qpos: jax.Array, kpos: jax.Array,
              block: int | None, scale: float, window: int | None = None) -> tuple:
    """The online-softmax carry ``(row max, row sum, acc)`` of ``qg``'s rows after the keys ``k``, ``v``."""
    kb = _blocks(k.shape[1], block)

    def step(carry: tuple, j: jax.Array) -> tuple:
        k_blk = jax.lax.dynamic_slice_in_dim(k, j * kb, kb, axis=1)
        v_blk = jax.lax.dynamic_slice_in_dim(v, j * kb, kb, axis=1)
        scores, visible = _scores(qg, k_blk, qpos, jax.lax.dynamic_slice_in_dim(kpos, j * kb, kb), scale, window)
        return online_softmax_step(carry, jnp.where(visible, scores, -jnp.inf), v_blk), None

    n = k.shape[1] // kb
    if n == 1:
        return step(carry, jnp.int32(0))[0]
    return jax.lax.scan(step, carry, jnp.arange(n))[0]


def _bwd_keys(qg: jax.Array, gg: jax.Array, lse: jax.Array, delta: jax.Array, k: jax.Array, v: jax.Array,
              qpos: jax.Array, kpos: jax.Array, block: int | None, scale: float, window: int | None = None) -> tuple:
    """fp32 (dq of ``qg``'s rows, dk, dv of the keys ``k``, ``v``), recomputing probabilities from ``lse``."""
    kb = _blocks(k.shape[1], block)

    def step(dq: jax.Array, j: jax.Array) -> tuple:
        k_blk = jax.lax.dynamic_slice_in_dim(k, j * kb, kb, axis=1)
        v_blk = jax.lax.dynamic_slice_in_dim(v, j * kb, kb, axis=1)
        scores, visible = _scores(qg, k_blk, qpos, jax.lax.dynamic_slice_in_dim(kpos, j * kb, kb), scale, window)
        dq_blk, dk, dv = block_grads(qg, gg, k_blk, v_blk, scores, visible, lse, delta, scale)
        return dq + dq_blk, (dk, dv)

    n = k.shape[1] // kb
    dq0 = jnp.zeros(qg.shape, jnp.float32)
    if n == 1:
        dq, (dk, dv) = step(dq0, jnp.int32(0))
        return dq, dk, dv
    dq, (dk, dv) = jax.lax.scan(step, dq0, jnp.arange(n))
    fold = lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])  # noqa: E731  [n, b, kb, ..]
    return dq, fold(dk), fold(dv)


def _shift(xs: tuple, axis: str, size: int) -> tuple:
    """Every array of ``xs`` one rank on around the ring (rank ``r`` to ``r + 1``)."""
    perm = [(i, (i + 1) % size) for i in range(size)]
    return tuple(jax.lax.ppermute(x, axis, perm) for x in xs)


def _shift_packed(pairs: tuple, axis: str, size: int) -> tuple:
    """:func:`_shift` of pairs of arrays of one shape and dtype, each pair stacked into one message.

    The backward's K/V are the forward's; sent as they are, XLA's common-subexpression elimination (after it
    drops the optimization barrier, when forward and backward share a program) merges their sends with the
    forward's and keeps every shifted K/V block alive until the backward. Stacked, the message differs from
    any forward send, so the backward runs its ring as written (the module doc; testbed.model.ring's sends).
    """
    out = []
    for a, b in pairs:
        both = _shift((jnp.stack([a, b]),), axis, size)[0]
        out += [both[0], both[1]]
    return tuple(out)


def _rows(tree: tuple, start: int, stop: int | None = None) -> tuple:
    return tuple(x[:, start:stop] for x in tree)


def _ring_forward(q: jax.Array, k: jax.Array, v: jax.Array, axis: str, block: int | None,
                  window: int | None = None) -> tuple:
    """(output in q's dtype ``[b, s, heads, d]``, fp32 row log-sum-exp ``[b, s, kv_heads, group]``)."""
    b, s, heads, d = q.shape
    kv_heads, size = k.shape[2], jax.lax.axis_size(axis)
    rank = jax.lax.axis_index(axis)
    cs, scale = s // 2, 1.0 / math.sqrt(d)
    qg, qpos = _grouped(q, kv_heads), zigzag_positions(s, size, rank)
    stats = (b, s, kv_heads, heads // kv_heads)
    carry = (jnp.full(stats, -jnp.inf, jnp.float32), jnp.zeros(stats, jnp.float32),
             jnp.zeros((*stats, d), jnp.float32))
    carry = _fwd_keys(carry, qg, k, v, qpos, qpos, block, scale, window)   # step 0: the diagonal chunk pairs
    for t in range(1, size):
        k, v = _shift((k, v), axis, size)
        src = (rank - t) % size
        kpos = zigzag_positions(s, size, src)

        def earlier(carry: tuple, k=k, v=v, kpos=kpos) -> tuple:  # all rows see the first K/V chunk only
            return _fwd_keys(carry, qg, k[:, :cs], v[:, :cs], qpos, kpos[:cs], block, scale, window)

        def later(carry: tuple, k=k, v=v, kpos=kpos) -> tuple:    # the second query chunk sees all K/V
            tail = _fwd_keys(_rows(carry, cs), qg[:, cs:], k, v, qpos[cs:], kpos, block, scale, window)
            return tuple(jnp.concatenate([head, new], axis=1) for head, new in zip(_rows(carry, 0, cs), tail))

        carry = jax.lax.cond(src < rank, earlier, later, carry)
    row_max, row_sum, acc = carry
    out = (acc / row_sum[..., None]).astype(q.dtype).reshape(b, s, heads, d)
    return out, row_max + jnp.log(row_sum)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ring(q: jax.Array, k: jax.Array, v: jax.Array, axis: str, block: int | None, window: int | None) -> jax.Array:
    return _ring_forward(q, k, v, axis, block, window)[0]


def _ring_fwd(q: jax.Array, k: jax.Array, v: jax.Array, axis: str, block: int | None, window: int | None) -> tuple:
    out, lse = _ring_forward(q, k, v, axis, block, window)
    return out, (q, k, v, out, lse)


def _ring_bwd(axis: str, block: int | None, window: int | None, res: tuple, g: jax.Array) -> tuple:
    q, k, v, out, lse = jax.lax.optimization_barrier(res)
    b, s, heads, d = q.shape
    kv_heads, size = k.shape[2], jax.lax.axis_size(axis)
    rank = jax.lax.axis_index(axis)
    cs, scale = s // 2, 1.0 / math.sqrt(d)
    qg, gg, qpos = _grouped(q, kv_heads), _grouped(g, kv_heads), zigzag_positions(s, size, rank)
    # D_i = sum_d dO_i O_i: the softmax backward's row term (FlashAttention-2, Algorithm 2).
    delta = jnp.sum(gg.astype(jnp.float32) * _grouped(out, kv_heads).astype(jnp.float32), axis=-1)
    dq, dk, dv = _bwd_keys(qg, gg, lse, delta, k, v, qpos, qpos, block, scale, window)
    for t in range(1, size):
        k, v, dk, dv = _shift_packed(((k, v), (dk, dv)), axis, size)   # the accumulators travel with their K/V
        src = (rank - t) % size
        kpos = zigzag_positions(s, size, src)

        def earlier(acc: tuple, k=k, v=v, kpos=kpos) -> tuple:
            dq, dk, dv = acc
            dq_t, dk_t, dv_t = _bwd_keys(qg, gg, lse, delta, k[:, :cs], v[:, :cs], qpos, kpos[:cs], block, scale,
                                         window)
            return dq + dq_t, dk.at[:, :cs].add(dk_t), dv.at[:, :cs].add(dv_t)

        def later(acc: tuple, k=k, v=v, kpos=kpos) -> tuple:
            dq, dk, dv = acc
            dq_t, dk_t, dv_t = _bwd_keys(qg[:, cs:], gg[:, cs:], lse[:, cs:], delta[:, cs:], k, v, qpos[cs:],
                                         kpos, block, scale, window)
            return dq.at[:, cs:].add(dq_t), dk + dk_t, dv + dv_t

        dq, dk, dv = jax.lax.cond(src < rank, earlier, later, (dq, dk, dv))
    dk, dv = dk.astype(k.dtype), dv.astype(v.dtype)  # cast before the home send: the same values, half the bytes
    if size > 1:
        dk, dv = _shift_packed(((dk, dv),), axis, size)   # home: rank r holds the accumulators of rank r + 1's K/V
    return dq.astype(q.dtype).reshape(b, s, heads, d), dk, dv


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis: str = "context",
                   block: int | None = None, window: int | None = None) -> jax.Array:
    """Causal attention of this context rank's rows against the whole sequence (inside a map manual over
    ``axis``); rows in zigzag order, see the module. ``block``: flash attention's key block, or None;
    ``window``: a sliding window of keys (masked by global position; every ring block is still computed)."""
    s = q.shape[1]
    if s % 2:
        raise ValueError(f"ring attention needs an even number of local rows (two zigzag chunks), got {s}")
    if block is not None and block < 1:
        raise ValueError(f"ring attention's block must be positive, got {block}")
    return _ring(q, k, v, axis, block, window)


class ContextShards:
    """Context parallelism on one mesh: the runner's model calls these (``testbed.runner.model``'s ``context=``).

    The trainers lay every sequence out in testbed.plan.context's zigzag order (:attr:`order`, a permutation
    of the sequence dim applied once to tokens and targets) and split it over the ``context`` axis; the
    position table and RoPE read the same permutation (:attr:`order`), so token-wise layers (embedding, norms,
    MLP, head, loss) need nothing else, and XLA sums the replicated parameters' gradients over ``context``
    as over ``data``. :meth:`attend` runs :func:`ring_attention` in a ``shard_map`` manual over
    ``context`` (and the axes of degree 1, as testbed.runner.parallel.SequenceShards' maps); nested in
    testbed.runner.param_shards.ParamShards' map, over the axes that map leaves. Identity-hashed: one instance per
    mesh is a static argument of the jitted programs.
    """

    def __init__(self, plan: Any, mesh: Any):
        from testbed.plan.context import context_order

        self.mesh, self.size, self.window = mesh, plan.mesh.context, plan.model.sliding_window
        #: The zigzag permutation of the sequence positions (numpy, static).
        self.order = context_order(plan.model.seq_len, self.size)

    def _mesh(self) -> Any:
        context = jax.sharding.get_abstract_mesh()
        return context if not context.empty and context.manual_axes else self.mesh

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, block: int | None) -> jax.Array:
        """Causal attention of q, k, v ``[batch, seq, heads, head_dim]`` in zigzag order, the sequence over
        ``context``: the ring, each rank on its rows. ``block``: flash attention's K/V block, or None."""
        mesh = self._mesh()
        trivial = {name for name, size in mesh.shape.items() if size == 1}
        manual = frozenset({"context"} | trivial) - frozenset(mesh.manual_axes)
        spec = P(None, "context")
        ring = partial(ring_attention, axis="context", block=block, window=self.window)
        return jax.shard_map(ring, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, axis_names=manual,
                             check_vma=False)(q, k, v)


def context_shards(plan: Any, mesh: Any) -> ContextShards | None:
    """The plan's :class:`ContextShards` on ``mesh``, or None without context parallelism."""
    return ContextShards(plan, mesh) if plan.mesh.context > 1 else None
