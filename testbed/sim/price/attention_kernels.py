"""Published speeds of fused attention kernels: what a flash product costs under a named kernel.

A plan's ``runtime.attention_kernel`` (testbed.plan.runtime) names the kernel its stack runs flash
attention in; testbed.model.gemm tags the attention products with it and with the pass they are in
(:class:`~testbed.model.gemm.AttentionPass`), and testbed.sim.price.compute prices a tagged product here:

    seconds = gemm_latency_s + flops * work / (peak * efficiency(kernel, device, pass, head_dim, seq))

- ``work``: the fraction of the counted products the kernel computes. testbed counts a causal block
  whole (the runner computes it under the mask); FlashAttention-2/3, cuDNN and splash skip the tiles
  above the diagonal, so a causal block (the whole sequence, or a ring's step 0) is half
  (:data:`CAUSAL_WORK`); a ring's later steps (half a block, unmasked) are whole.
- ``efficiency``: the kernel's TFLOP/s over the device's dense bf16 peak, from the kernel papers'
  benchmarks, which count FLOPs the same way (FlashAttention's benchmark: ``4 b s^2 h d``, halved when
  causal; the backward 2.5 times the forward: its four gradient products and the recomputed scores).
  By pass: the forward without and with the causal mask, the backward (the papers' backward figures
  are without the mask: a causal backward is priced at them). Interpolated linearly in the head
  dimension and in ``log2`` of the sequence length between the published points, held at the ends.

Only the devices the papers measured have figures (H100 SXM5 here), and JAX's first Pallas TPU kernel on the
v5e chip testbed measured (its causal backward measured too); a kernel on any other device
returns None and the product is priced as the runner's kernel (the calibration's
``flash_efficiency``, or by shape). The tables are data with their sources, nothing is fitted.
"""

from __future__ import annotations

import math

from testbed.model.gemm import AttentionPass

__all__ = ["KERNEL_TFLOPS", "SEQ_POINTS", "SOURCES", "CAUSAL_WORK", "device_family", "kernel_tflops",
           "kernel_efficiency"]

#: Fraction of a causally masked block's counted products a tile-skipping kernel computes (the papers' count).
CAUSAL_WORK = 0.5

#: Sequence lengths of the published points (FlashAttention-3 Figures 5 and 6: 512 to 16k).
SEQ_POINTS = (512, 1024, 2048, 4096, 8192, 16384)

#: ``{(kernel, device family): {pass: {head_dim: TFLOP/s at SEQ_POINTS}}}``; pass ``forward``, ``forward_causal``,
#: ``backward`` or, where measured, ``backward_causal`` (else a causal backward is priced at ``backward``).
#: Dense bf16/fp16 peaks: H100 SXM5 989 TFLOP/s, TPU v5e 197.
KERNEL_TFLOPS: dict[tuple[str, str], dict[str, dict[int, tuple[float, ...]]]] = {
    ("flash2", "H100"): {
        "forward": {64: (282, 306, 318, 321, 322, 324), 128: (309, 350, 362, 368, 370, 370),
                    256: (275, 313, 321, 323, 324, 326)},
        "forward_causal": {128: (191, 260, 298, 319, 333, 335), 256: (208, 251, 278, 293, 297, 298)},
        "backward": {64: (198, 238, 264, 279, 287, 291), 128: (214, 260, 291, 310, 318, 322)},
    },
    ("cudnn", "H100"): {
        "forward": {64: (335, 373, 395, 408, 412, 413), 128: (497, 574, 617, 609, 600, 595),
                    256: (470, 546, 580, 581, 580, 581)},
        "forward_causal": {128: (315, 410, 484, 518, 529, 539), 256: (308, 391, 450, 483, 497, 509)},
        "backward": {64: (266, 348, 395, 417, 432, 433), 128: (305, 408, 465, 499, 518, 516)},
    },
    ("flash3", "H100"): {
        "forward": {64: (333, 392, 460, 476, 496, 497), 128: (467, 565, 625, 638, 646, 648),
                    256: (482, 639, 707, 736, 746, 756)},
        "forward_causal": {128: (292, 423, 521, 579, 602, 616), 256: (286, 427, 537, 612, 628, 642)},
        "backward": {64: (272, 363, 422, 453, 472, 474), 128: (316, 424, 501, 542, 559, 561)},
    },
    ("tpu-flash", "TPU-v5e"): {
        "forward": {
            64: (22.96, 31.91, 41.42, 48.8, 53.63, 56.55),
            128: (48.96, 64.37, 85.85, 103.46, 115.77, 123.37)},
        "forward_causal": {
            64: (11.42, 17.1, 25.23, 34.2, 41.81, 48.31),
            128: (24.07, 33.94, 51.62, 71.94, 89.21, 104.41)},
        "backward": {
            64: (16.81, 24.64, 34.14, 41.82, 47.45, 50.75),
            128: (32.73, 48.62, 67.04, 82.75, 94.42, 102.02)},
        "backward_causal": {
            64: (8.42, 12.99, 19.22, 25.93, 31.88, 36.04),
            128: (16.47, 25.69, 37.53, 50.75, 62.61, 71.17)},
    },
}

_FA3 = ("Shah et al., 'FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision', "
        "arXiv:2407.08608: Figure 5 (forward speed, FP16/BF16, H100 80GB SXM5, without and with the causal mask, "
        "head dim 64/128/256, sequence 512-16k at 16k tokens per batch, 2048 hidden) and Figure 6 (backward speed, "
        "head dim 64/128, without the causal mask); the bar labels, TFLOP/s. The causal forward panel for head dim "
        "64 is not used (held at 128's)")
_V5E = ("measured on one TPU v5e chip (benchmarks/tpu_chip/flash_kernels.json: benchmarks/tpu_flash_kernels.py, "
        "2026-12-06, JAX 0.10.2, libtpu 0.0.42.1) in FlashAttention-3's setting (16k tokens a batch, hidden 2048) "
        "with AXLearn's blocks of 512; forward_tflops and backward_tflops, the causal ones over the halved count")
#: Where each table comes from.
SOURCES = {("flash2", "H100"): _FA3 + "; the FlashAttention-2 bars",
           ("cudnn", "H100"): _FA3 + "; the cuDNN bars",
           ("flash3", "H100"): _FA3 + "; the FlashAttention-3 bars",
           ("tpu-flash", "TPU-v5e"): "JAX's first Pallas TPU flash kernel (jax.experimental.pallas.ops.tpu."
                                    "flash_attention), " + _V5E}

#: Peak dense bf16 TFLOP/s the tables' efficiencies are taken against, per device family (TPU v5e: Google Cloud's
#: datasheet, 197 TFLOP/s).
_PEAK_TFLOPS = {"H100": 989.0, "TPU-v5e": 197.0}


def device_family(name: str) -> str | None:
    """The family a topology's device name belongs to (``H100-SXM5-80GB`` -> ``H100``), None when unknown."""
    upper = name.upper()
    return next((family for family in _PEAK_TFLOPS if upper.startswith(family.upper())), None)


def _interpolate(points: dict[int, tuple[float, ...]], head_dim: int, seq: int) -> float:
    """Linear in the head dimension and in ``log2(seq)`` between published points, held at the ends."""
    x = min(max(math.log2(max(seq, 1)), math.log2(SEQ_POINTS[0])), math.log2(SEQ_POINTS[-1]))
    i = min(int(x - math.log2(SEQ_POINTS[0])), len(SEQ_POINTS) - 2)
    frac = x - math.log2(SEQ_POINTS[i])

    def at(dim: int) -> float:
        row = points[dim]
        return row[i] + (row[i + 1] - row[i]) * frac

    dims = sorted(points)
    if head_dim <= dims[0] or len(dims) == 1:
        return at(dims[0])
    if head_dim >= dims[-1]:
        return at(dims[-1])
    lo = max(d for d in dims if d <= head_dim)
    hi = min(d for d in dims if d >= head_dim)
    if lo == hi:
        return at(lo)
    return at(lo) + (at(hi) - at(lo)) * (head_dim - lo) / (hi - lo)


def kernel_tflops(kernel: str, family: str, mark: AttentionPass) -> float | None:
    """Published TFLOP/s of ``kernel`` on ``family`` for the pass ``mark`` (None: no figure for it)."""
    table = KERNEL_TFLOPS.get((kernel, family))
    if table is None:
        return None
    key = "backward" if mark.backward else "forward_causal" if mark.causal else "forward"
    if mark.backward and mark.causal and "backward_causal" in table:  # a measured causal backward
        key = "backward_causal"
    return _interpolate(table[key], mark.head_dim, mark.seq)


def kernel_efficiency(device_name: str, mark: AttentionPass) -> tuple[float, float] | None:
    """(fraction of the device's peak the kernel reaches, fraction of the counted products it computes) for a
    product in pass ``mark`` on device ``device_name``; None when the kernel has no published figure there."""
    family = device_family(device_name)
    tflops = kernel_tflops(mark.kernel, family, mark) if family else None
    if tflops is None:
        return None
    return tflops / _PEAK_TFLOPS[family], (CAUSAL_WORK if mark.causal else 1.0)
