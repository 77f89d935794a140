"""What TPU splash attention's backward holds in device memory (HBM), per layer.

``runtime.attention_kernel: splash`` names JAX's Pallas splash attention kernel
(``jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel``), the kernel MaxText's
``attention: flash`` runs on TPU. Its ``custom_vjp`` (``_splash_attention_fwd``) keeps as residuals q,
k, v, the output and the per-row log-sum-exp (fp32, ``[heads, tokens]``), nothing score-sized.
Its backward (``_splash_attention_bwd``) writes to HBM:

- ``di = sum(o * do)``: fp32, ``[heads, tokens]``;
- dK and dV (``_splash_attention_bwd_dkv``'s outputs, ``ShapeDtypeStruct.like(k)`` and ``like(v)``):
  the compute dtype, ``[tokens, kv_dim]`` each;
- dq (``_splash_attention_bwd_dq``'s output, ``ShapeDtypeStruct.like(q)``): the compute dtype,
  ``[tokens, q_dim]``.

The score and probability tiles and the fp32 dq/dK/dV accumulators are Pallas scratch
(``(bq, bkv)``-sized, in VMEM), never in HBM: unlike the runner's flash scan (testbed.runner.attention,
whose XLA loop keeps fp32 tiles and an fp32 dq carry in device memory), nothing here grows with the
block size. Under ``remat`` the layer's backward recomputes the forward's log-sum-exp too (fp32,
``[heads, tokens]``), which is counted here. This is the unfused backward, MaxText's default
(``sa_use_fused_bwd_kernel: False`` in MaxText's configs); the fused kernel writes ``seq / block_kv``
partial dq copies instead (``dq_unreduced``), a block size testbed's plan does not carry, so it is not
modelled.
"""

from __future__ import annotations

from testbed.model.activations import FLASH_BYTES
from testbed.model.ring import rank_spec
from testbed.plan.spec import Plan

__all__ = ["SPLASH", "PALLAS_TPU_KERNELS", "splash_kernel", "splash_workspace"]

#: The ``runtime.attention_kernel`` value naming TPU splash attention (testbed.plan.runtime).
SPLASH = "splash"
#: The ``runtime.attention_kernel`` values whose backward writes what splash's does: splash, and JAX's first Pallas
#: TPU kernel (``jax.experimental.pallas.ops.tpu.flash_attention``: its ``_flash_attention_bwd`` writes ``di`` in
#: fp32, dK and dV from ``_flash_attention_bwd_dkv`` and dq from ``_flash_attention_bwd_dq`` in q's dtype, its
#: tiles in VMEM scratch).
PALLAS_TPU_KERNELS = (SPLASH, "tpu-flash")


def splash_kernel(plan: Plan) -> bool:
    """Whether the plan's flash attention runs in a Pallas TPU kernel (:data:`PALLAS_TPU_KERNELS`; its backward
    workspace is :func:`splash_workspace`, not the runner's flash scan). Not under context parallelism: the ring's
    steps carry fp32 dq, dK and dV accumulators across the kernel's calls whatever the kernel."""
    return plan.runtime.attention_kernel in PALLAS_TPU_KERNELS and plan.mesh.context == 1


def splash_workspace(plan: Plan) -> int:
    """Bytes in HBM of one layer's splash attention backward on one tensor rank: dq, dK and dV in the
    compute dtype, and two fp32 per-row vectors per query head (``di`` and the recomputed log-sum-exp)."""
    spec, c, t = rank_spec(plan), plan.precision.compute_bytes, plan.mesh.tensor
    n = plan.microbatch_size * spec.seq_len
    kv = n * spec.kv_dim // t if spec.kv_split(t) else n * spec.kv_dim
    rows = 2 * FLASH_BYTES * n * spec.heads // t
    return c * n * spec.q_dim // t + 2 * c * kv + rows
