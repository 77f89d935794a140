"""Rotary position embedding (RoPE) of the runner's attention: the half-split convention of GPT-NeoX and Hugging
Face's Llama, and the same rotation in the form XLA:TPU lays out well at head dim 64 (the splash path's,
testbed.runner.model._attend)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["rope", "rope_turned", "rope_tables"]


def rope_tables(x: jax.Array, theta: float, positions: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """RoPE's ``cos`` and ``sin`` of ``[seq, head_dim / 2]`` for ``x [batch, seq, heads, head_dim]``: dims ``i`` and
    ``i + head_dim/2`` rotate together by ``pos * theta^(-2i/head_dim)``; ``positions`` default ``0 .. seq-1``."""
    seq, head_dim = x.shape[1], x.shape[3]
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (np.arange(0, half, dtype=np.float64) * 2.0 / head_dim))
    pos = np.arange(seq) if positions is None else np.asarray(positions)
    angles = pos.astype(np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


def rope(x: jax.Array, theta: float, positions: np.ndarray | None = None) -> jax.Array:
    """Rotary position embedding of ``[batch, seq, heads, head_dim]`` (the half-split convention of GPT-NeoX
    and Hugging Face's Llama: dims ``i`` and ``i + head_dim/2`` rotate together by ``pos * theta^(-2i/head_dim)``);
    ``positions``: each row's position (context parallelism's zigzag order), default ``0 .. seq-1``."""
    half = x.shape[3] // 2
    cos, sin = (jnp.asarray(t[None, :, None, :], x.dtype) for t in rope_tables(x, theta, positions))
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rope_turned(x: jax.Array, theta: float, positions: np.ndarray | None = None, scale: float = 1.0) -> jax.Array:
    """:func:`rope` times ``scale``, for XLA:TPU: ``x * cos + turn(x) * sin`` over the whole head dim, ``turn`` (the
    halves swapped, the first negated) a signed permutation applied as a dot (one +-1 a column, fp32 accumulation at
    the highest precision: exact). The half-split form's slices and concatenation are half-width arrays that XLA:TPU
    lays out and copies apart at head dim 64 (three passes a tensor; a whole-width one here: the 430M
    full-remat step 4.3% faster on a v5e chip, benchmarks/tpu_chip/rope_forms.json). ``scale`` rides on the tables
    (the splash path's softmax scale, no pass of its own). Equal to :func:`rope` bit for bit at ``scale`` 1."""
    cos, sin = rope_tables(x, theta, positions)
    half = cos.shape[1]
    turn = np.zeros((2 * half, 2 * half), np.float32)
    turn[np.arange(half) + half, np.arange(half)] = -1.0
    turn[np.arange(half), np.arange(half) + half] = 1.0
    turned = jax.lax.dot_general(x, jnp.asarray(turn, x.dtype), (((3,), (0,)), ((), ())),
                                 precision=jax.lax.Precision.HIGHEST, preferred_element_type=x.dtype)
    cos_whole, sin_whole = (jnp.asarray(scale * np.concatenate([t, t], axis=1)[None, :, None, :], x.dtype)
                            for t in (cos, sin))
    return x * cos_whole + turned * sin_whole
