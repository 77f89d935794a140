"""Pricing compute on one device: a task's roofline and elementwise passes, its matmuls by their shapes.

:func:`compute_seconds` is what testbed.sim.graph.engine (and the analytic search
tier) charges a compute task: ``launch_overhead_s`` plus its matmuls (by shape,
below, when the calibration has the GEMM model; else by FLOPs at
``efficiency * f / (f + efficiency_half_flops)`` of peak per kernel), at least
its HBM bytes at the calibrated bandwidth, plus the calibration's elementwise
passes over the activations it writes (:func:`pass_seconds` each).

The GEMM model of an accelerator.

A GPU runs a GEMM as tiles of the output spread over its SMs: an output
with few tiles (small ``m`` or ``n``) leaves SMs idle, and a short
reduction (small ``k``) cannot amortise loading the tiles' operands, so
small and skinny GEMMs are far from peak while large ones reach most of it
(NVIDIA, "Matrix Multiplication Background User's Guide", 2023: tile and
wave quantization). The model, per GEMM of ``batch`` products of ``m x k``
by ``k x n`` (testbed.model.gemm):

    eff(m, n, k) = min(efficiency, s(batch * m) * s(n) * s_k(k)),
    s(x) = x / (x + gemm_half_mn),  s_k(k) = k / (k + gemm_half_k)
    seconds = gemm_latency_s + max(flops / (peak * eff), operand bytes / bandwidth)

``efficiency`` (the calibration's compute group) caps it at what the
largest GEMMs reach (the device's measured maximum achievable matmul
FLOP/s); the operand bytes (``m k + k n + m n`` per product, in the compute
dtype) make GEMMs with a short dimension (attention's ``d_head``) memory
bound where the roofline says so; ``gemm_latency_s`` is the fixed time of a
kernel. Flash attention's products (testbed.model.gemm ``flash``) run in one
fused kernel at the calibration's ``flash_efficiency`` of peak (FlashAttention-2
on A100: 50-73%, Dao 2023), their scores never in HBM; under a named
``runtime.attention_kernel`` at that kernel's published speed on the device, forward
and backward apart, over the products it computes (testbed.sim.price.attention_kernels).
Each factor grows with its dimension, so a GEMM's FLOP rate never falls as any
dimension grows (tested): the curve is monotone in size.

An fp8 GEMM (fp8-mixed on a device with fp8 units) runs at the fp8 peak with
its own cap, ``fp8_efficiency * k / (k + fp8_gemm_half_k)`` in place of
``efficiency`` (fitted to measured per-tensor-scaled H800 fp8 GEMMs by
benchmarks/published/gemm.py), reads fp8 operands, and pays the fp8 recipe's
casts as a memory-bound pass (:func:`fp8_cast_bytes`); flash attention stays
bf16.

The constants are fitted per device to published GEMM measurements (the
topology files name them; :func:`fit_shape_model` is the fit, on a table of
``(batch, m, n, k, FLOP/s)``). A topology whose calibration has no GEMM
fields (host CPUs, TPUs here) keeps the FLOPs-only roofline
(testbed.sim.graph.engine.compute_seconds).
"""

from __future__ import annotations

import math
from dataclasses import replace
from collections.abc import Iterable, Sequence

from testbed.model.gemm import Gemm
from testbed.plan.spec import Plan
from testbed.sim.price.attention_kernels import CAUSAL_WORK, kernel_efficiency
from testbed.sim.price.grouped_kernels import grouped_rate
from testbed.sim.xla.vmem import on_chip_bytes
from testbed.topology import Topology
from testbed.topology.parts import matmul_dtype
from testbed.topology.calibration import ComputeCalibration

__all__ = ["compute_seconds", "plan_matmul_dtype", "rate_dtype", "FP32_BF16_PASS", "pass_seconds", "epilogue_seconds",
           "EPILOGUE_HIDDEN", "fused_kernel_seconds", "systolic_share", "epilogue_bytes",
           "with_epilogue", "gemm_efficiency", "gemm_seconds", "gemms_seconds",
           "fit_shape_model", "GEMM_OPERAND_BYTES", "FP8_BLOCK_SCALED_SHARE", "fp8_cast_bytes"]

#: The share of the fp8 cap a block-scaled fp8 GEMM reaches (``runtime.fp8_scaling`` ``blockwise``: 1 x 128
#: activation and 128 x 128 weight scales, DeepSeek-V3's recipe, Transformer Engine's ``Float8BlockScaling``). On
#: Hopper the tensor cores accumulate fp8 products in limited precision, so a block-scaled GEMM promotes each
#: 128-deep partial sum to fp32 on the CUDA cores and applies the blocks' scales there (DeepSeek-V3 report
#: Sec. 3.3.2; DeepGEMM README), work a per-tensor-scaled GEMM does once in its epilogue. Fitted by
#: benchmarks/published/gemm.py (``fp8.blockwise``) over the 10 training-shape rows (m >= 1024) of DeepGEMM's H800
#: table as the least-squares log ratio to the per-tensor cap: in-sample median 2.7% (max 17.3%), leave-one-out
#: 3.3% (max 18.5%); the per-tensor cap alone is 9.6% fast on them (max 30.6%). Hopper's figure: the fp8 caps
#: testbed holds are Hopper's (topologies/dgx-h100*.yaml).
FP8_BLOCK_SCALED_SHARE = 0.892
#: The matmul dtype of an fp32 plan whose products run as one bf16 pass (``device.fp32_matmuls: bf16`` at the
#: default precision, a TPU): at the bf16 rate, its operands read and written as the fp32 values they are. The
#: chip's profiles (benchmarks/tpu_chip/profiles.json): the 125M fp32 step's attention products, bound by their
#: operands' bytes, take 1.8-2.0x their bf16 twins'.
FP32_BF16_PASS = "fp32-bf16-pass"
#: The share of a fused kernel's trailing work (testbed.model.gemm.trailing_bytes: past its operand and output streams, an
#: optimizer update's further state) whose pass runs beside the matmul (:func:`fused_kernel_seconds`; 1: the longer
#: of the two, 0: their sum). One value for both tiers, fitted by benchmarks/tpu_fused_update_fit.py over both
#: categories of the v5e chip's per-op profiles, the kernels holding an optimizer update: the plans' (benchmarks/
#: tpu_chip/profiles.json, 12 kernel shapes of 6 plans, AdamW: median error 9.6%, leave-one-plan-out 12.3%; 28.2%
#: at 1) and the users' programs' (benchmarks/tpu_chip/programs.json, 10 of 3 programs, SGD with momentum, Adam,
#: AdamW: median 7.4%, leave-one-program-out 7.5%; 15.0% at 1). The routed experts' grouped kernels take their
#: update's whole pass after the matmul (testbed.sim.step.update_facts.fused_update).
EPILOGUE_HIDDEN = 0.16
#: Bytes per (input, output) value of a GEMM, by compute dtype (fp8 GEMMs read fp8 operands and write bf16).
GEMM_OPERAND_BYTES = {"fp32": (4, 4), "bf16": (2, 2), "fp16": (2, 2), "fp8": (1, 2), FP32_BF16_PASS: (4, 4)}


def rate_dtype(dtype: str) -> str:
    """The dtype whose peak and cap a matmul of ``dtype`` (:func:`plan_matmul_dtype`'s) runs at."""
    return "bf16" if dtype == FP32_BF16_PASS else dtype


def plan_matmul_dtype(plan: Plan, topology: Topology) -> str:
    """The dtype whose rate the plan's matmuls run at on ``topology`` (both simulator tiers price with it): the
    plan's compute dtype under its ``runtime.matmul_precision``, by testbed.topology.parts.DeviceSpec.matmul_dtype
    (an fp32 plan at the default precision on a TPU: :data:`FP32_BF16_PASS`, the bf16 rate on fp32 operands). A bf16
    plan keeps the listed bf16 peak on every device: ``device.bf16_matmuls`` prices traced programs only
    (calibrate fits the bf16 peak to its bf16 steps, converts included)."""
    device, dtype = topology.device, plan.precision.compute_dtype
    if "bf16" not in device.peak_flops:
        return dtype
    runs = matmul_dtype(dtype, plan.runtime.matmul_precision, fp32_matmuls=device.fp32_matmuls)
    return FP32_BF16_PASS if dtype == "fp32" and runs == "bf16" else runs


def compute_seconds(topology: Topology, dtype: str, flops: float, hbm_bytes: float, kernels: int = 1,
                    replicated_bytes: float = 0.0, split_bytes: float = 0.0, tensor_bytes: float = 0.0,
                    gemms: Sequence[Gemm] = (), spans: Sequence[tuple[float, float]] = (),
                    epilogue: tuple[float, float] = (0.0, 0.0)) -> float:
    """Time of a compute task of ``kernels`` equal kernels on one device (calibrated roofline + elementwise passes).

    With the calibration's GEMM shape model (``compute.shapes``) and the task's ``gemms`` (whose FLOPs are
    its ``flops``), the matmuls are priced shape by shape (testbed.sim.price.compute) instead of by FLOPs; without
    it, the flash products of a kernel with figures on the device (testbed.sim.price.attention_kernels) are
    priced by them and the rest by FLOPs.
    ``spans``: the task's spans between blocking tensor collectives (testbed.model.spans: each its share of the
    matmuls and its HBM bytes); without an elementwise calibration each is a roofline of its own, the slower of
    its matmuls and its bytes, summed (its bytes in place of ``hbm_bytes``): a device that runs its fusions one
    at a time hides a span's memory traffic under its own matmuls only. Ignored with an elementwise calibration.
    ``epilogue``: (FLOPs, bytes): of ``hbm_bytes``, those that run as the epilogue of matmuls of that many FLOPs
    priced elsewhere (:func:`epilogue_seconds` less).
    """
    compute, passes, dev = topology.calibration.compute, topology.calibration.elementwise, topology.device
    t = 0.0
    if gemms and compute.shapes:
        t = gemms_seconds(topology, dtype, gemms)
    elif flops > 0:
        named = [g for g in gemms if g.flash and g.attention and kernel_efficiency(dev.name, g.attention)]
        rest = flops - sum(g.flops for g in named)  # a named kernel's products at its measured speed
        per_kernel, rate = rest / max(1, kernels), rate_dtype(dtype)
        eff = compute.cap(rate) * per_kernel / (per_kernel + compute.efficiency_half_flops)
        t = (rest + _grouped_extra_flops(dev.name, gemms)) / (dev.sustained_flops(rate) * eff) if rest > 0 else 0.0
        t += gemms_seconds(topology, dtype, named)
        hbm_bytes += sum(g.fused_bytes * g.count for g in gemms)  # the roofline of FLOPs and bytes: theirs join
    if spans and passes is None:
        t = sum(max(share * t, pass_seconds(topology, nbytes)) for share, nbytes in spans)
    elif hbm_bytes > 0:
        t = max(t, pass_seconds(topology, hbm_bytes))
    if passes is not None:
        f = topology.calibration.cached_fraction(tensor_bytes, host_devices(topology))
        activations = (f * passes.cached_passes * (replicated_bytes + split_bytes)
                       + (1 - f) * (passes.replicated_passes * replicated_bytes + passes.split_passes * split_bytes))
        t += pass_seconds(topology, activations)
    if not (flops > 0 or hbm_bytes > 0):
        return 0.0
    return compute.launch_overhead_s + t - epilogue_seconds(topology, dtype, *epilogue)


def _grouped_extra_flops(device_name: str, gemms: Sequence[Gemm]) -> float:
    """FLOPs at the dense rate that the time a grouped-matmul kernel's GEMMs lose to it is worth
    (testbed.sim.price.grouped_kernels: ``flops / rate - flops`` each; 0 without such GEMMs or without a figure)."""
    return sum(g.flops * (1.0 / grouped_rate(device_name, g.grouped) - 1.0) for g in gemms if g.grouped)


def host_devices(topology: Topology) -> int:
    """Devices of one host: the innermost level's (a process's emulated devices; all of them without levels)."""
    return topology.levels[0].size if topology.levels else topology.num_devices


def fused_kernel_seconds(math_s: float, own_s: float, epilogue_s: float) -> float:
    """Seconds of one matmul kernel with memory-bound work fused into it (XLA:TPU's output fusions, the one rule both
    tiers price such a kernel by): ``math_s`` of math, ``own_s`` of the matmul's own HBM traffic (its operands and
    result, an accumulator it adds into), ``epilogue_s`` of the fused work's own pass. :data:`EPILOGUE_HIDDEN` of
    that pass runs beside the matmul, which takes the longer of its math and its traffic; the rest after it."""
    return max(math_s, own_s + EPILOGUE_HIDDEN * epilogue_s) + (1.0 - EPILOGUE_HIDDEN) * epilogue_s


def epilogue_seconds(topology: Topology, dtype: str, flops: float, nbytes: float) -> float:
    """Seconds of a memory pass of ``nbytes`` that runs as the epilogue of matmuls of ``flops`` priced elsewhere
    (their own traffic under their math, the matmuls at the calibrated cap) which their kernel does not add: the
    pass less what :func:`fused_kernel_seconds` adds to the math. 0 without matmuls."""
    if flops <= 0 or nbytes <= 0:
        return 0.0
    dtype = rate_dtype(dtype)
    math_s = flops / (topology.device.sustained_flops(dtype) * topology.calibration.compute.cap(dtype))
    epilogue_s = pass_seconds(topology, nbytes)
    return epilogue_s - (fused_kernel_seconds(math_s, 0.0, epilogue_s) - math_s)


def pass_seconds(topology: Topology, nbytes: float) -> float:
    """Seconds one memory pass over ``nbytes`` takes at the calibrated bandwidth (the roofline's and the passes')."""
    return nbytes / (topology.device.memory_bandwidth * topology.calibration.memory.efficiency)


def _saturation(x: float, half: float) -> float:
    return x / (x + half) if half > 0 else 1.0


def gemm_efficiency(compute: ComputeCalibration, gemm: Gemm, dtype: str = "bf16") -> float:
    """Fraction of peak FLOP/s a GEMM of this shape reaches (before the memory bound): in (0, the dtype's cap]."""
    shape = (_saturation(gemm.batch * gemm.m, compute.gemm_half_mn) * _saturation(gemm.n, compute.gemm_half_mn)
             * _saturation(gemm.k, compute.gemm_half_k))
    if dtype == "fp8" and compute.fp8_efficiency:
        # fp8's cap itself grows with the reduction: each output tile's fixed work (its scales, the bf16
        # epilogue, the pipeline's fill) is amortised over k (fitted to measured H800 fp8 GEMMs)
        cap = compute.fp8_efficiency * _saturation(gemm.k, compute.fp8_gemm_half_k)
        return min(cap * (FP8_BLOCK_SCALED_SHARE if gemm.block_scaled else 1.0), shape)
    return min(compute.efficiency, shape)


def fp8_cast_bytes(gemm: Gemm) -> float:
    """HBM bytes of the fp8 recipe's casts for one fp8 ``gemm`` (all its products): ``3 batch m k``.

    Transformer Engine's recipe (NVIDIA Transformer Engine docs, "Using FP8 with Transformer Engine"):
    a linear layer's input is cast to fp8 (with its transpose, for the weight gradient) before the
    forward GEMM, the output gradient likewise before the backward ones, each cast also finding the
    tensor's amax; the weights once per step. Priced per GEMM as one memory-bound pass over its left
    operand, read in bf16 (2 bytes) and written in fp8 (1): the forward's input (cast and transpose:
    4 bytes counted 3), the input gradient's output gradient (likewise), the weight gradient's left
    operand (already cast: 0 counted 3) - 9 bytes for the layer's 8. The weights' casts, once per step
    and not per microbatch, are left out. Under current scaling (``gemm.amax_pass``, the plan's
    ``runtime.fp8_scaling``) the amax is a reduction kernel of its own that reads the forward's input and the
    output gradient once more before their casts (2 bytes each): the layer's 4 bytes spread as 4/3 per product.
    """
    return (3.0 + (4.0 / 3.0 if gemm.amax_pass else 0.0)) * gemm.batch * gemm.m * gemm.k * gemm.count


def gemm_seconds(topology: Topology, dtype: str, gemm: Gemm, casts: bool = True) -> float:
    """Seconds of ``gemm`` (all its ``count`` x ``batch`` products) on one device of ``topology``.

    In fp8 the recipe's casts (:func:`fp8_cast_bytes`) are added unless ``casts`` is false (the GEMM kernel alone).
    The time is ``count`` times one product's, which is memoized per topology (a search prices the same
    shapes under thousands of plans).
    """
    return _gemm_seconds(_memo(topology), topology, dtype, gemm, casts)


def _gemm_seconds(memo: dict, topology: Topology, dtype: str, gemm: Gemm, casts: bool) -> float:
    if gemm.count <= 0:
        return 0.0
    key = (dtype, gemm.m, gemm.n, gemm.k, gemm.batch, gemm.flash, casts, gemm.attention, gemm.amax_pass,
           gemm.grouped, gemm.block_scaled, gemm.high_precision, gemm.stored_lhs, gemm.score_cells, gemm.accumulates,
           gemm.fused_bytes, gemm.trailing_bytes, gemm.result_on_chip)
    one = memo.get(key)
    if one is None:
        one = memo[key] = _one_product_seconds(topology, dtype, replace(gemm, count=1.0), casts)
    return gemm.count * one


#: Per topology object (kept alive beside its memo, so its id is not reused): one product's seconds by shape.
_MEMOS: dict[int, tuple[Topology, dict]] = {}


def _memo(topology: Topology) -> dict:
    entry = _MEMOS.get(id(topology))
    if entry is None or entry[0] is not topology:
        if len(_MEMOS) >= 16:  # a sweep over many topologies keeps the newest few
            _MEMOS.pop(next(iter(_MEMOS)))
        entry = _MEMOS[id(topology)] = (topology, {})
    return entry[1]


def _one_product_seconds(topology: Topology, dtype: str, gemm: Gemm, casts: bool) -> float:
    """Seconds of one product of ``gemm`` (``count`` 1): the calibrated roofline (its memory side with what is fused
    into its kernel, :func:`epilogue_bytes`), the fp8 recipe's casts."""
    cal = topology.calibration
    read, write = GEMM_OPERAND_BYTES.get(dtype, (2, 2))
    dtype = rate_dtype(dtype)
    if dtype == "fp8" and (not topology.device.has_fp8() or gemm.flash or gemm.high_precision):
        # no fp8 units: fp8-mixed matmuls run (and read their operands) in bf16; flash attention runs in
        # bf16 under Transformer Engine's fp8 recipe too (its DotProductAttention is bf16 unless fp8
        # attention is asked for); so does a product the fp8 recipe leaves out (the LM head, gemm.high_precision)
        dtype, (read, write) = "bf16", GEMM_OPERAND_BYTES["bf16"]
    one, (own, beyond) = gemm.flops, _epilogue_split(gemm, write)
    fused = pass_seconds(topology, beyond)  # the fused work past the kernel's output stream (fused_kernel_seconds)
    named = kernel_efficiency(topology.device.name, gemm.attention) if gemm.flash and gemm.attention else None
    if named is not None:  # the stack's kernel at its published speed, over the products it computes
        eff, work = named
        math = one * work / (topology.device.sustained_flops(dtype) * eff)
        return cal.compute.gemm_latency_s + fused_kernel_seconds(math, pass_seconds(topology, own), fused)
    if gemm.flash:  # fused: the scores stay on chip, so no operand roofline; the kernel's own efficiency
        eff = cal.compute.flash_efficiency or gemm_efficiency(cal.compute, gemm, dtype)
        math = one * runner_kernel_work(topology, gemm) / (topology.device.sustained_flops(dtype) * eff
                                                           * systolic_share(topology.device.systolic_width, gemm))
        return cal.compute.gemm_latency_s + fused_kernel_seconds(math, pass_seconds(topology, own), fused)
    rate = grouped_rate(topology.device.name, gemm.grouped)  # a grouped-matmul kernel's (1: the dense matmul)
    math = one / (topology.device.sustained_flops(dtype) * gemm_efficiency(cal.compute, gemm, dtype) * rate)
    operands = gemm.batch * ((gemm.lhs_elements + gemm.k * gemm.n) * read + gemm.m * gemm.n * write)
    operands += own - on_chip_bytes(topology.device, gemm, read, write)
    cast = pass_seconds(topology, fp8_cast_bytes(gemm)) if dtype == "fp8" and casts else 0.0
    return cal.compute.gemm_latency_s + fused_kernel_seconds(math, pass_seconds(topology, operands), fused) + cast


def epilogue_bytes(gemm: Gemm, write: int) -> float:
    """HBM bytes one product's kernel moves for the memory-bound work XLA:TPU fuses into it (its output fusion, and
    the elementwise producers and consumers of a traced program's matmul), beyond its operands and its result
    (``write`` bytes an element): the accumulator a weight gradient that ``accumulates`` reads to add into (its
    write is the product's own result), the fused ops' ``fused_bytes`` (testbed.sim.xla.matmul_fusion), less the
    result where only those ops read it (``result_on_chip``). Both tiers price such a kernel by one rule,
    :func:`fused_kernel_seconds` (the chip's per-op profiles, benchmarks/tpu_chip/profiles.json and programs.json: one
    fusion holding the convolution)."""
    result = gemm.batch * gemm.m * gemm.n * write
    return (result if gemm.accumulates else 0.0) + gemm.fused_bytes - (result if gemm.result_on_chip else 0.0)


def _epilogue_split(gemm: Gemm, write: int) -> tuple[float, float]:
    """:func:`epilogue_bytes` of one product as (the kernel's own traffic, the fused work's past its operand and
    output streams: ``gemm.trailing_bytes``), the two sides :func:`fused_kernel_seconds` prices."""
    return epilogue_bytes(gemm, write) - gemm.trailing_bytes, gemm.trailing_bytes


def with_epilogue(gemms: Sequence[Gemm], nbytes: float, result_on_chip: bool = False,
                  trailing: float = 0.0) -> tuple[Gemm, ...]:
    """``gemms`` with ``nbytes`` of memory-bound work fused into their kernels, spread evenly over their products
    (each product's ``fused_bytes``; ``trailing`` of them past the kernel's streams, ``trailing_bytes``), their
    results on chip where only that work reads them (:func:`epilogue_bytes`)."""
    products = sum(g.count for g in gemms)
    if (nbytes <= 0 and not result_on_chip) or products <= 0:
        return tuple(gemms)
    nbytes, trailing = max(0.0, nbytes), min(max(0.0, trailing), max(0.0, nbytes))
    return tuple(replace(g, fused_bytes=g.fused_bytes + nbytes / products,
                         trailing_bytes=g.trailing_bytes + trailing / products, result_on_chip=result_on_chip)
                 for g in gemms)


def runner_kernel_work(topology: Topology, gemm: Gemm) -> float:
    """The fraction of a flash product's counted FLOPs the runner's kernel computes: the splash kernels (a product
    marked ``runner``, testbed.model.gemm) skip the tiles above a causal block's diagonal where the runner's programs
    compile for a TPU (``buffer_rules: xla-tpu``), :data:`CAUSAL_WORK`; the scan kernel computes whole blocks."""
    mark = gemm.attention
    splash = mark is not None and mark.kernel == "runner" and mark.causal
    return CAUSAL_WORK if splash and topology.device.buffer_rules == "xla-tpu" else 1.0


def systolic_share(width: int, gemm: Gemm) -> float:
    """The share of a ``width``-wide systolic matrix unit a product's narrowest dimension fills (1 without one):
    a flash kernel's products are a head dim wide (QK^T contracts over it, PV outputs it), and a 64-wide product
    leaves half of a 128 x 128 MXU idle; the chip's profiles show splash at head dim 64 at 0.39-0.46 of its rate
    at 128 (benchmarks/tpu_chip/profiles.json)."""
    return min(1.0, min(gemm.m, gemm.n, gemm.k) / width) if width else 1.0


def gemms_seconds(topology: Topology, dtype: str, gemms: Iterable[Gemm]) -> float:
    """Seconds of all ``gemms``, one after another."""
    memo = _memo(topology)
    return sum(_gemm_seconds(memo, topology, dtype, g, True) for g in gemms)


def fit_shape_model(rows: Sequence[tuple[int, int, int, int, float]], peak: float, bandwidth: float,
                    efficiency: float | None, dtype_bytes: float = 2.0) -> dict[str, float]:
    """Least-squares fit (log time) of ``gemm_half_mn``, ``gemm_half_k`` and ``gemm_latency_s`` to measurements.

    ``rows``: ``(batch, m, n, k, measured FLOP/s)``; ``peak`` the datasheet FLOP/s, ``efficiency`` the cap
    (the device's maximum achievable matmul FLOP/s over peak), or None to fit the cap too (returned as
    ``efficiency``, at most 1.5). Halves are at least one element, the latency at least 1 ns. Returns the fields and the fit's median and max relative error. Needs numpy and scipy
    (a fit-time tool, not the simulator's; scipy comes with JAX).
    """
    import numpy as np
    from scipy.optimize import least_squares

    b, m, n, k, rate = (np.asarray(c, dtype=float) for c in zip(*rows))
    flops = 2 * b * m * n * k
    measured = flops / rate
    operands = b * (m * k + k * n + m * n) * dtype_bytes / bandwidth

    def model(p):
        half_mn, half_k, latency = np.exp(p[:3])
        cap = efficiency if efficiency is not None else float(np.exp(p[3]))
        eff = np.minimum(cap, b * m / (b * m + half_mn) * n / (n + half_mn) * k / (k + half_k))
        return latency + np.maximum(flops / (peak * eff), operands)

    # halves of at least one element (a GEMM dimension's factor is at most 1/2 at size 1), latency at least 1 ns
    start = [100.0, 100.0, 3e-6] + ([] if efficiency is not None else [0.5])
    low = [0.0, 0.0, math.log(1e-9)] + ([] if efficiency is not None else [math.log(0.01)])
    high = [math.log(1e6), math.log(1e6), math.log(1.0)] + ([] if efficiency is not None else [math.log(1.5)])
    res = least_squares(lambda p: np.log(model(p) / measured), np.log(start), bounds=(low, high))
    half_mn, half_k, latency = (float(x) for x in np.exp(res.x[:3]))
    err = np.abs(model(res.x) / measured - 1)
    cap = efficiency if efficiency is not None else float(np.exp(res.x[3]))
    return {"gemm_half_mn": half_mn, "gemm_half_k": half_k, "gemm_latency_s": latency, "efficiency": cap,
            "median_abs_error": float(np.median(err)), "max_abs_error": float(err.max())}
