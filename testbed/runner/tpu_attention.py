"""Flash attention on a TPU: JAX's Pallas splash-attention kernels, and when the runner uses them.

``attention: flash`` runs :func:`testbed.runner.attention.flash_attention` (a ``lax.scan`` over K/V
blocks that XLA compiles on any backend) except where :func:`attention_kernel` (testbed.model.flash_kernel) picks
:data:`AttentionKernel.SPLASH`: on a TPU, for a plan whose step is one device's program (a Pallas call is
opaque to GSPMD, which would run it replicated on a sharded mesh), with a sequence the kernel's 128-key
lanes tile. The splash kernels (``jax.experimental.pallas.ops.tpu.splash_attention``, the kernels
MaxText's ``attention: flash`` calls on TPU) compute FlashAttention-2's algorithm in VMEM with the same
residuals (q, k, v, output, row log-sum-exp) and the same matmul FLOPs per computed block; blocks wholly
above the causal diagonal are skipped. Grouped-query attention is native to the kernel (query heads a
multiple of K/V heads). On CPUs and GPUs the scan kernel runs unchanged.
"""

from __future__ import annotations

import math
from functools import lru_cache

import jax
import jax.numpy as jnp

from testbed.model.flash_kernel import LANES, SPLASH_FUSED_BACKWARD, AttentionKernel, attention_kernel, splash_block

__all__ = ["AttentionKernel", "attention_kernel", "splash_block", "splash_attention", "LANES"]


@lru_cache(maxsize=32)
def _kernel(heads: int, seq: int, window: int | None, block: int):
    """The splash kernel object of ``heads`` query heads over ``seq`` keys (causal, or a sliding ``window``).

    Built at compile time (``jax.ensure_compile_time_eval``): its mask arrays are concrete, never tracers of the
    trace that first asked for it, which this cache would leak into later traces (under ``jax.checkpoint`` they
    became extra inputs of the step that an ahead-of-time ``Compiled`` call does not pass)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    shape = (seq, seq)
    one = splash.CausalMask(shape) if window is None else splash.LocalMask(shape, (window - 1, 0), 0)
    dq = {} if SPLASH_FUSED_BACKWARD else {"block_q_dq": block, "block_kv_dq": block}
    blocks = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                               block_kv_dkv=block, block_kv_dkv_compute=block,
                               use_fused_bwd_kernel=SPLASH_FUSED_BACKWARD, **dq)
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mha_single_device(splash.MultiHeadMask([one] * heads), block_sizes=blocks)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None = None) -> jax.Array:
    """Causal attention (a sliding ``window`` of that many keys: ``q - window < k <= q``) by the splash kernels:
    q ``[batch, seq, heads, head_dim]``, k and v ``[batch, seq, kv_heads, head_dim]`` -> ``[batch, seq, heads,
    head_dim]`` in q's dtype. The kernel takes heads before positions and no softmax scale: q is scaled by
    ``1 / sqrt(head_dim)`` first (as MaxText does), and each batch row is one kernel call (``vmap``)."""
    b, seq, heads, head_dim = q.shape
    block = splash_block(seq)
    if block is None:
        raise ValueError(f"splash attention needs seq a multiple of {LANES}, not {seq}")
    kernel = _kernel(heads, seq, window, block)
    q = q * jnp.asarray(1.0 / math.sqrt(head_dim), q.dtype)
    heads_first = (0, 2, 1, 3)
    out = jax.vmap(kernel)(*(x.transpose(heads_first) for x in (q, k, v)))
    return out.transpose(heads_first)
