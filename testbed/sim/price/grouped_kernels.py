"""Published rates of MoE grouped-matmul kernels: what a routed expert's GEMM costs under a named kernel.

A plan's ``runtime.moe_dispatch`` (testbed.plan.runtime) names how its stack runs an MoE layer; under
``megablox`` (MaxText's dropless ``sparse_matmul`` path: tokens sorted by expert, the routed experts' GEMMs in
the megablox grouped-matmul Pallas kernel, ``gmm`` and its transposed ``tgmm`` for the weight gradients)
testbed.model.gemm tags the routed experts' GEMMs with the kernel (:attr:`testbed.model.gemm.Gemm.grouped`) and
testbed.sim.price.compute prices a tagged GEMM at the device's dense matmul rate times the kernel's :func:`grouped_rate`:

    seconds = flops / (peak * efficiency * rate(kernel, device))

A published kernel's rate is the MoE layer's model-FLOP utilisation over a dense model's on the same device and
stack, both with full remat (so the recompute counts alike), from the stack's published figures. XLA:TPU's routed
experts' weight gradients fused with the optimizer update (testbed.model.gemm.FUSED_UPDATE_KERNEL) have no published
figure: their rate on the v5e chip is fitted over its per-op profiles (benchmarks/tpu_moe_ops.py).
A kernel on a device without a figure runs at the dense rate (1).
"""

from __future__ import annotations

__all__ = ["RATES", "SOURCES", "grouped_rate"]

#: MaxText on TPU v5p: Mixtral 8x7B's MoE layers alone (attention removed), megablox, 50.4% MFU on v5p-64
#: (maxtext issue #1256); MaxText's dense full-remat models on v5p, 63.99% MFU (the README's runtime table at
#: tpu-recipes-v0.1.0: 512B on v5p-1024; its other full-remat rows 64.80% (1024B, v5p-4096) and 55.35%
#: (1024B, v5p-2048): the median is 63.99%).
_MEGABLOX_V5P = 50.4 / 63.99

#: XLA:TPU on TPU v5e: a routed expert's weight gradient (batched over the experts, contracting over their slots) in
#: one kernel with its AdamW update (testbed.model.gemm.FUSED_UPDATE_KERNEL; the update's pass follows it whole,
#: testbed.sim.step.update_facts.fused_update), fitted by benchmarks/tpu_moe_ops.py over the expert weight-gradient
#: kernels of the chip's seven profiled MoE plans (benchmarks/tpu_chip/moe/profiles.json, heldout/profiles.json; 14
#: kernel shapes): least squares of the relative error, in-sample median 17.8% (max 53.0%), leave-one-plan-out median
#: 19.7% (max 82.8%: moe-e4-top1-d1024's kernels run near the dense rate; the refits 0.57-0.77); at the dense rate
#: 30.7% (max 45.9%).
_EXPERT_UPDATE_V5E = 0.72

#: ``{(kernel, device name): rate}``: the kernel's GEMM rate over the device's dense matmul rate.
RATES: dict[tuple[str, str], float] = {("megablox", "TPU-v5p"): round(_MEGABLOX_V5P, 4),
                                       ("xla-expert-update", "TPU-v5e"): _EXPERT_UPDATE_V5E}

#: Where each rate comes from.
SOURCES = {("megablox", "TPU-v5p"): (
    "github.com/AI-Hypercomputer/maxtext issue #1256 (2025-02-09): 'Mixtral-8x7B without attention ... "
    "num_experts=8 and num_experts_per_token=2, MFU on a v5p-64 is 50.4%' (megablox, MaxText's defaults: full "
    "remat); maxtext README.md 'Runtime Performance Results, TPU v5p' and MaxText/configs/v5p/README.md at tag "
    "tpu-recipes-v0.1.0: the full-remat dense configs (512b.sh, 1024b.sh: remat_policy=full) at 63.99% (512B, "
    "1x v5p-1024), 64.80% (1024B, v5p-4096), 55.35% (1024B, v5p-2048); median 63.99%"),
    ("xla-expert-update", "TPU-v5e"): (
    "benchmarks/tpu_moe_ops.py: fitted over the expert weight-gradient kernels fused with the update in the v5e chip's "
    "per-op profiles of seven one-chip MoE plans (benchmarks/tpu_chip/moe/profiles.json, heldout/profiles.json)")}


def grouped_rate(device_name: str, kernel: str | None) -> float:
    """The rate of ``kernel``'s GEMMs over the dense matmul rate on ``device_name`` (1: no kernel, or no figure)."""
    if not kernel:
        return 1.0
    return RATES.get((kernel, device_name), 1.0)
