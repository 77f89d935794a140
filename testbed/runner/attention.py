"""Causal attention kernels of the runner's blocks: dense ("plain") and blockwise ("flash").

Both take q ``[batch, seq, heads, head_dim]`` and k, v ``[batch, seq, kv_heads, head_dim]``
and return ``[batch, seq, heads, head_dim]``. With fewer K/V heads (grouped-query
attention) query head ``h`` attends with K/V head ``h // (heads / kv_heads)``: the
query heads are viewed as ``[kv_heads, group]`` (no K/V copies).

- :func:`plain_attention` materialises the ``seq x seq`` scores and probabilities
  (the softmax keeps its output for the backward).
- :func:`flash_attention` is FlashAttention-2's algorithm (Dao 2023) written for XLA:
  a scan over K/V blocks of ``block`` keys with an online softmax (running row max,
  row sum and rescaled output, in fp32), saving only q, k, v, the output and the
  per-row log-sum-exp (both named :data:`FLASH_RESIDUALS` for a checkpoint policy that
  keeps them: ``runtime.recompute: save-dots-flash``). Its backward (a ``custom_vjp``) scans the K/V blocks again,
  recomputing each block's scores and probabilities from the log-sum-exp, and
  accumulates dq while writing dk, dv block by block. No buffer of the compiled
  program is ``seq x seq``: the largest attention temporaries are ``seq x block``
  per head. Every query row meets every K/V block (causality by masking, as
  the dense kernel), so the forward's matmul FLOPs equal the dense kernel's,
  and the backward's are 2.5x the forward's (scores recomputed, then dV, dP,
  dQ, dK), what ``testbed.model.costs`` counts.

The block size is the plan's (``ModelSpec.flash_block``), read by the simulator's
memory model too. On GPU the same kernel runs through XLA (fused per block by
XLA, not a hand-written Pallas/cuDNN kernel); the runner does not call
``jax.nn.dot_product_attention``.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from testbed.plan.model import window_rows

__all__ = ["plain_attention", "flash_attention", "key_mask", "FLASH_RESIDUALS"]

#: The checkpoint name of a flash kernel's output and row log-sum-exp (this scan's and the splash kernels',
#: testbed.runner.tpu_attention): ``jax.checkpoint_policies.save_only_these_names`` of it keeps them.
FLASH_RESIDUALS = "flash_residuals"


@jax.custom_vjp
def _softmax(x: jax.Array) -> jax.Array:
    """Softmax over the last dim that keeps only its output for the backward."""
    return jax.nn.softmax(x, axis=-1)


def _softmax_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    y = jax.nn.softmax(x, axis=-1)
    return y, y


def _softmax_bwd(y: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    return (y * (g - jnp.sum(g * y, axis=-1, keepdims=True)),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def key_mask(qpos: jax.Array, kpos: jax.Array, window: int | None) -> jax.Array:
    """``[queries, keys]``: causal (key not after the query) and, with a sliding ``window`` N, within the N keys
    ending at the query (``q - N < k <= q``)."""
    seen = qpos[:, None] >= kpos[None, :]
    return seen if window is None else seen & (qpos[:, None] - kpos[None, :] < window)


def plain_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None = None) -> jax.Array:
    """Dense causal softmax attention over the whole ``seq x seq`` score matrix (a sliding ``window``: masked)."""
    b, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    scale = jnp.asarray(1.0 / math.sqrt(head_dim), q.dtype)
    # An additive constant mask: its backward needs nothing saved (a boolean `where` would keep the mask).
    causal = key_mask(jnp.arange(seq), jnp.arange(seq), window)
    if kv_heads == heads:
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
        bias = jnp.where(causal, 0.0, jnp.finfo(scores.dtype).min).astype(scores.dtype)
        probs = _softmax(scores + bias)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    grouped = q.reshape(b, seq, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("bqngd,bknd->bngqk", grouped, k) * scale
    bias = jnp.where(causal, 0.0, jnp.finfo(scores.dtype).min).astype(scores.dtype)
    probs = _softmax(scores + bias)
    return jnp.einsum("bngqk,bknd->bqngd", probs, v).reshape(b, seq, heads, head_dim)


# -- flash ------------------------------------------------------------------------------------

def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    """q ``[b, s, heads, d]`` viewed as ``[b, s, kv_heads, group, d]``."""
    b, s, heads, d = q.shape
    return q.reshape(b, s, kv_heads, heads // kv_heads, d)


def _block_scores(qg: jax.Array, k_blk: jax.Array, start: jax.Array, scale: float, window: int | None = None,
                  first: jax.Array | int = 0) -> tuple[jax.Array, jax.Array]:
    """fp32 scores ``[b, rows, kv_heads, group, block]`` of the query rows ``qg`` (from row ``first`` on) against
    one K/V block starting at key ``start``, and its causal (and sliding-window) mask."""
    rows, block = qg.shape[1], k_blk.shape[1]
    scores = jnp.einsum("bqngd,bknd->bqngk", qg, k_blk, preferred_element_type=jnp.float32) * scale
    visible = key_mask(first + jnp.arange(rows), start + jnp.arange(block), window)
    return scores, visible[None, :, None, None, :]


def _first_row(start: jax.Array, seq: int, rows: int) -> jax.Array | int:
    """The first of the ``rows`` query rows scored against the K/V block at ``start``: the block's own first row,
    moved back so the rows stay inside the sequence (the rows before the block are masked: causality)."""
    return 0 if rows == seq else jnp.minimum(start, seq - rows)


def _take(x: jax.Array, first: jax.Array | int, rows: int) -> jax.Array:
    return x if rows == x.shape[1] else jax.lax.dynamic_slice_in_dim(x, first, rows, axis=1)


def _put(x: jax.Array, part: jax.Array, first: jax.Array | int) -> jax.Array:
    return part if part.shape[1] == x.shape[1] else jax.lax.dynamic_update_slice_in_dim(x, part, first, axis=1)


def online_softmax_step(carry: tuple, scores: jax.Array, v_blk: jax.Array) -> tuple:
    """One K/V block of the online softmax (FlashAttention-2): the fp32 carry ``(row max, row sum, acc)`` updated
    with the block's ``scores`` (masked keys at -inf) and values. A row that has seen no key yet (its max still
    -inf) keeps zeros: its rescale is taken against 0 instead of the infinite max."""
    row_max, row_sum, acc = carry
    new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1))
    safe = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    probs = jnp.exp(scores - safe[..., None])
    rescale = jnp.exp(row_max - safe)
    row_sum = row_sum * rescale + jnp.sum(probs, axis=-1)
    acc = acc * rescale[..., None] + jnp.einsum("bqngk,bknd->bqngd", probs.astype(v_blk.dtype), v_blk,
                                                preferred_element_type=jnp.float32)
    return new_max, row_sum, acc


def block_grads(qg: jax.Array, gg: jax.Array, k_blk: jax.Array, v_blk: jax.Array, scores: jax.Array,
                visible: jax.Array, lse: jax.Array, delta: jax.Array, scale: float) -> tuple:
    """One K/V block's share of flash attention's backward (FlashAttention-2): the block's probabilities
    recomputed from its ``scores`` and the saved log-sum-exp, then (dQ contribution, dK, dV) of the block in fp32.
    ``delta`` is the rows' ``sum(dO * O)``."""
    probs = jnp.where(visible, jnp.exp(scores - lse[..., None]), 0.0)
    dv = jnp.einsum("bqngk,bqngd->bknd", probs.astype(gg.dtype), gg, preferred_element_type=jnp.float32)
    dprobs = jnp.einsum("bqngd,bknd->bqngk", gg, v_blk, preferred_element_type=jnp.float32)
    dscores = (probs * (dprobs - delta[..., None]) * scale).astype(qg.dtype)
    dq = jnp.einsum("bqngk,bknd->bqngd", dscores, k_blk, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bqngk,bqngd->bknd", dscores, qg, preferred_element_type=jnp.float32)
    return dq, dk, dv


def _flash_forward(q: jax.Array, k: jax.Array, v: jax.Array, block: int,
                   window: int | None = None) -> tuple[jax.Array, jax.Array]:
    """(output ``[b, s, heads, d]`` in q's dtype, fp32 log-sum-exp ``[b, s, kv_heads, group]``). With a sliding
    ``window`` each K/V block is scored against only the ``window_rows`` query rows that can see it."""
    b, s, heads, d = q.shape
    kv_heads = k.shape[2]
    qg = _grouped(q, kv_heads)
    scale = 1.0 / math.sqrt(d)
    stats = (b, s, kv_heads, heads // kv_heads)
    rows = window_rows(s, block, window)

    def step(carry, j):
        start = j * block
        k_blk = jax.lax.dynamic_slice_in_dim(k, start, block, axis=1)
        v_blk = jax.lax.dynamic_slice_in_dim(v, start, block, axis=1)
        first = _first_row(start, s, rows)
        scores, visible = _block_scores(_take(qg, first, rows), k_blk, start, scale, window, first)
        part = online_softmax_step(tuple(_take(c, first, rows) for c in carry),
                                   jnp.where(visible, scores, -jnp.inf), v_blk)
        return tuple(_put(c, p, first) for c, p in zip(carry, part)), None

    init = (jnp.full(stats, -jnp.inf, jnp.float32), jnp.zeros(stats, jnp.float32),
            jnp.zeros((*stats, d), jnp.float32))
    (row_max, row_sum, acc), _ = jax.lax.scan(step, init, jnp.arange(s // block))
    out = (acc / row_sum[..., None]).astype(q.dtype).reshape(b, s, heads, d)
    return out, row_max + jnp.log(row_sum)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash(q: jax.Array, k: jax.Array, v: jax.Array, block: int, window: int | None) -> jax.Array:
    return _flash_forward(q, k, v, block, window)[0]


def _flash_fwd(q: jax.Array, k: jax.Array, v: jax.Array, block: int, window: int | None):
    out, lse = (checkpoint_name(x, FLASH_RESIDUALS) for x in _flash_forward(q, k, v, block, window))
    return out, (q, k, v, out, lse)


def _flash_bwd(block: int, window: int | None, res, g: jax.Array):
    # The barrier keeps XLA from sharing work with the forward (which would keep its blocks alive).
    q, k, v, out, lse = jax.lax.optimization_barrier(res)
    b, s, heads, d = q.shape
    kv_heads = k.shape[2]
    qg, gg = _grouped(q, kv_heads), _grouped(g, kv_heads)
    scale = 1.0 / math.sqrt(d)
    # D_i = sum_d dO_i O_i: the softmax backward's row term (FlashAttention-2, Algorithm 2).
    delta = jnp.sum(gg.astype(jnp.float32) * _grouped(out, kv_heads).astype(jnp.float32), axis=-1)
    rows = window_rows(s, block, window)

    def step(carry, j):
        dq, dk, dv = carry
        start = j * block
        k_blk = jax.lax.dynamic_slice_in_dim(k, start, block, axis=1)
        v_blk = jax.lax.dynamic_slice_in_dim(v, start, block, axis=1)
        first = _first_row(start, s, rows)
        qr, gr, lr, dr = (_take(x, first, rows) for x in (qg, gg, lse, delta))
        scores, visible = _block_scores(qr, k_blk, start, scale, window, first)
        dq_blk, dk_blk, dv_blk = block_grads(qr, gr, k_blk, v_blk, scores, visible, lr, dr, scale)
        dq = _put(dq, _take(dq, first, rows) + dq_blk, first)
        dk = jax.lax.dynamic_update_slice_in_dim(dk, dk_blk.astype(k.dtype), start, axis=1)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, dv_blk.astype(v.dtype), start, axis=1)
        return (dq, dk, dv), None

    init = (jnp.zeros(qg.shape, jnp.float32), jnp.zeros_like(k), jnp.zeros_like(v))
    (dq, dk, dv), _ = jax.lax.scan(step, init, jnp.arange(s // block))
    return dq.astype(q.dtype).reshape(b, s, heads, d), dk, dv


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int, window: int | None = None) -> jax.Array:
    """Blockwise causal attention over K/V blocks of ``block`` keys (a divisor of ``seq``); see the module.
    ``window``: sliding-window attention of that many keys, the blocks' query rows no key of which it sees
    skipped (:func:`testbed.plan.model.window_rows`)."""
    seq = q.shape[1]
    if block < 1 or seq % block:
        raise ValueError(f"flash attention's block {block} must divide seq {seq}")
    return _flash(q, k, v, block, window)
