"""The runner's norms: LayerNorm and RMSNorm with hand-written backward passes that keep what
``testbed.model.costs`` counts (the input and the per-token statistics: two for LayerNorm, one for RMSNorm),
and :func:`layer_norm`, the block's choice between them."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["layer_norm"]

_LN_EPS = 1e-5


@jax.custom_vjp
def _layer_norm_core(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    """LayerNorm over the last dim."""
    return _layer_norm_fwd(x, scale, bias)[0]


def _layer_norm_fwd(x: jax.Array, scale: jax.Array, bias: jax.Array):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    rstd = jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + _LN_EPS)
    # Keep the input and two statistics per token; the backward recomputes x-hat (no extra N x d buffer).
    return centered * rstd * scale + bias, (x, mean, rstd, scale)


def _layer_norm_bwd(res, g: jax.Array):
    # The barrier stops XLA from CSE-ing this x-hat with the forward's, which would keep that
    # N x d buffer alive from forward to backward (the memory model counts only x, mean, rstd).
    x, mean, rstd, scale = jax.lax.optimization_barrier(res)
    xhat = (x - mean) * rstd
    reduce_dims = tuple(range(x.ndim - 1))
    dscale = jnp.sum(g * xhat, axis=reduce_dims)
    dbias = jnp.sum(g, axis=reduce_dims)
    gs = g * scale
    dx = rstd * (gs - jnp.mean(gs, axis=-1, keepdims=True) - xhat * jnp.mean(gs * xhat, axis=-1, keepdims=True))
    return dx, dscale, dbias


_layer_norm_core.defvjp(_layer_norm_fwd, _layer_norm_bwd)


@jax.custom_vjp
def _rms_norm_core(x: jax.Array, scale: jax.Array) -> jax.Array:
    """RMSNorm over the last dim: ``x / rms(x) * scale`` (no centring, no bias)."""
    return _rms_norm_fwd(x, scale)[0]


def _rms_norm_fwd(x: jax.Array, scale: jax.Array):
    rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + _LN_EPS)
    # Keep the input and one statistic per token (what testbed.model.costs counts for RMSNorm).
    return x * rstd * scale, (x, rstd, scale)


def _rms_norm_bwd(res, g: jax.Array):
    x, rstd, scale = jax.lax.optimization_barrier(res)
    xhat = x * rstd
    dscale = jnp.sum(g * xhat, axis=tuple(range(x.ndim - 1)))
    gs = g * scale
    dx = rstd * (gs - xhat * jnp.mean(gs * xhat, axis=-1, keepdims=True))
    return dx, dscale


_rms_norm_core.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def layer_norm(p: dict[str, Any], x: jax.Array, rms: bool = False) -> jax.Array:
    """The block's norm: RMSNorm, or LayerNorm (with a zero bias when the model has none)."""
    if rms:
        return _rms_norm_core(x, p["scale"])
    bias = p["bias"] if "bias" in p else jnp.zeros_like(p["scale"])
    return _layer_norm_core(x, p["scale"], bias)
