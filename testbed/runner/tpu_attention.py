"""Flash attention on a TPU: JAX's Pallas splash-attention kernels, and when the runner uses them.

``attention: flash`` runs :func:`testbed.runner.attention.flash_attention` (a ``lax.scan`` over K/V
blocks that XLA compiles on any backend) except where :func:`attention_kernel` (testbed.model.flash_kernel) picks
:data:`AttentionKernel.SPLASH`: on a TPU, for a plan whose step is one device's program (a Pallas call is
opaque to GSPMD, which would run it replicated on a sharded mesh), with a sequence the kernel's 128-key
lanes tile. The splash kernels (``jax.experimental.pallas.ops.tpu.splash_attention``, the kernels
MaxText's ``attention: flash`` calls on TPU) compute FlashAttention-2's algorithm in VMEM with the same
residuals (q, k, v, output, row log-sum-exp; the last two named ``FLASH_RESIDUALS`` for a checkpoint
policy, as testbed.runner.attention names its scan's) and the same matmul FLOPs per computed block; blocks wholly
above the causal diagonal are skipped. Grouped-query attention is native to the kernel (query heads a
multiple of K/V heads). On CPUs and GPUs the scan kernel runs unchanged.
"""

from __future__ import annotations

import math
from functools import lru_cache

import jax
import jax.numpy as jnp

from testbed.model.flash_kernel import LANES, AttentionKernel, SplashBlocks, attention_kernel, splash_block
from testbed.runner.attention import FLASH_RESIDUALS

__all__ = ["AttentionKernel", "attention_kernel", "splash_block", "splash_attention", "softmax_scale", "SplashBlocks",
           "LANES"]


@lru_cache(maxsize=32)
def _kernel(heads: int, seq: int, window: int | None, blocks: SplashBlocks, interpret: bool = False):
    """The splash kernel object of ``heads`` query heads over ``seq`` keys (causal, or a sliding ``window``).

    Built at compile time (``jax.ensure_compile_time_eval``): its mask arrays are concrete, never tracers of the
    trace that first asked for it, which this cache would leak into later traces (under ``jax.checkpoint`` they
    became extra inputs of the step that an ahead-of-time ``Compiled`` call does not pass)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    shape = (seq, seq)
    one = splash.CausalMask(shape) if window is None else splash.LocalMask(shape, (window - 1, 0), 0)
    sizes = splash.BlockSizes(**{k: splash.QKVLayout.SEQ_MINOR if v == "seq-minor" else v
                                 for k, v in blocks.block_sizes().items()})
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mha_single_device(splash.MultiHeadMask([one] * heads), block_sizes=sizes,
                                                    interpret=interpret, residual_checkpoint_name=FLASH_RESIDUALS)


def softmax_scale(head_dim: int) -> float:
    """The scale the splash kernels' caller puts on q (they take none): ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None = None,
                     blocks: SplashBlocks | None = None, interpret: bool = False, scaled: bool = False) -> jax.Array:
    """Causal attention (a sliding ``window`` of that many keys: ``q - window < k <= q``) by the splash kernels:
    q ``[batch, seq, heads, head_dim]``, k and v ``[batch, seq, kv_heads, head_dim]`` -> ``[batch, seq, heads,
    head_dim]`` in q's dtype. The kernel takes heads before positions and no softmax scale: q is scaled by
    ``1 / sqrt(head_dim)`` first (as MaxText does; ``scaled``: the caller did), and each batch row is one kernel
    call (``vmap``). ``blocks``: the runner's for ``seq`` and ``head_dim`` unless given
    (benchmarks/tpu_splash_blocks.py times others); ``interpret``: Pallas's interpreter (a CPU host)."""
    b, seq, heads, head_dim = q.shape
    blocks = blocks or SplashBlocks.for_seq(seq, head_dim)
    if blocks is None:
        raise ValueError(f"splash attention needs seq a multiple of {LANES}, not {seq}")
    kernel = _kernel(heads, seq, window, blocks, interpret)
    q = q if scaled else q * jnp.asarray(softmax_scale(head_dim), q.dtype)
    heads_first = (0, 2, 1, 3)
    out = jax.vmap(kernel)(*(x.transpose(heads_first) for x in (q, k, v)))
    return out.transpose(heads_first)
