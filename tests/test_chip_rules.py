"""XLA:TPU rules read from the chip's per-op profiles: the optimizer update in the weight gradients' epilogue, the MXU's
width under a fused attention kernel, fp32 operands under one bf16 pass (benchmarks/tpu_chip/profiles.json), each priced
once for both tiers."""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from testbed.errors import InputError
from testbed.explore.analytic import estimate
from testbed.model.gemm import Gemm, chunk_gemms, trailing_bytes
from testbed.plan.io import load_plan
from testbed.sim.price.compute import (EPILOGUE_HIDDEN, epilogue_seconds, fused_kernel_seconds, gemm_seconds,
                                      pass_seconds, plan_matmul_dtype, systolic_share)
from testbed.model.costs import param_count
from testbed.sim.graph.engine import simulate
from testbed.sim.step.grad_bytes import (ACCUMULATE_PASSES, FUSED_ACCUMULATE_PASSES, accumulated_bytes,
                                     accumulated_elements, accumulating_gemms)
from testbed.sim.graph.pricing import price
from testbed.sim.step.update_facts import fused_update
from testbed.topology.io import load_topology

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "benchmarks" / "tpu_chip" / "plans"


def _plan(name: str):
    return load_plan(str(PLANS / f"{name}.yaml"))


def test_the_update_fuses_only_where_nothing_sums_the_gradient() -> None:
    one = _plan("llama1b-bf16-flash")
    matrices = fused_update(one, 0)
    spec = one.model
    assert matrices == pytest.approx(spec.layers * (2 * spec.d_model * spec.q_dim + 2 * spec.d_model * spec.kv_dim
                                                    + 3 * spec.d_model * spec.d_ff) + spec.vocab * spec.d_model,
                                     rel=1e-3)  # the layers' and the head's matrices, not the token table or norms
    assert fused_update(_plan("gpt125m-bf16-accum4"), 0) == 0  # the loop's summed gradient: updated apart
    data2 = replace(one, mesh=replace(one.mesh, data=2), batch=replace(one.batch, global_batch=2))
    assert fused_update(data2, 0) == 0  # summed over data first


def test_a_fused_update_costs_what_its_pass_exceeds_the_matmuls_by() -> None:
    topo = load_topology("tpu-v5e-1")
    assert epilogue_seconds(topo, "bf16", 0.0, 1e9) == 0.0
    hidden = EPILOGUE_HIDDEN * pass_seconds(topo, 1e9)
    assert epilogue_seconds(topo, "bf16", 1e15, 1e9) == pytest.approx(hidden)  # its share beside the math
    rate = topo.device.sustained_flops("bf16") * topo.calibration.compute.cap("bf16")
    assert epilogue_seconds(topo, "bf16", 1e9, 1e12) == pytest.approx(1e9 / rate)  # the matmuls' share only


def test_one_rule_prices_a_fused_kernel_between_the_longer_and_the_sum() -> None:
    """fused_kernel_seconds: the trailing work's share beside the matmul, the rest after it; two result-sized passes
    of the consumers' (an output in the result's place, a residual's read) ride the kernel's streams
    (trailing_bytes)."""
    assert 0 < EPILOGUE_HIDDEN < 1
    assert fused_kernel_seconds(10.0, 2.0, 0.0) == 10.0
    assert max(10.0, 4.0) < fused_kernel_seconds(10.0, 2.0, 4.0) < 10.0 + 4.0
    assert fused_kernel_seconds(1.0, 2.0, 4.0) == pytest.approx(2.0 + 4.0)  # memory-bound: all its traffic
    assert trailing_bytes(26, 2) == 22 and trailing_bytes(4, 2) == 0  # AdamW's state past a bf16 gradient's passes
    topo = load_topology("tpu-v5e-1")
    weight_grad = Gemm(m=2048, n=2048, k=16384, result_on_chip=True)
    result = weight_grad.m * weight_grad.n * 2
    residual = gemm_seconds(topo, "bf16", replace(weight_grad, fused_bytes=2 * result))
    assert residual == pytest.approx(gemm_seconds(topo, "bf16", replace(weight_grad, result_on_chip=False)), rel=0.02)
    state = replace(weight_grad, fused_bytes=12 * result, trailing_bytes=trailing_bytes(12 * result, result))
    assert gemm_seconds(topo, "bf16", state) > residual  # an update's further state adds past the math


def test_both_tiers_price_the_fused_update_and_the_chip_profile_agrees() -> None:
    """The optimizer task holds the update left after fusion (the token table's, the norms') and the part of the
    fused updates that does not hide under their matmuls. Against what the chip's profile shows outside the matmuls
    (class ``optimizer``) plus what its fused kernels take beyond their matmuls priced alone, over the six profiled
    plans whose updates fuse: the median within 15% (per plan 0.45-1.34 of it: the fp32 plan's kernels run slower,
    the 125M's faster); the analytic tier agrees with the task graph; a device that does not fuse pays more."""
    topo = load_topology("tpu-v5e-1")
    profiles = {p["plan"]: p["planes"]["/device:TPU:0"]["classes_ns_per_step"]
                for p in json.loads((ROOT / "benchmarks/tpu_chip/profiles.json").read_text())["plans"]}
    ratios = {}
    for name in (n for n, c in profiles.items() if c["matmul+optimizer"] > 0):
        plan = _plan(name)
        sim = simulate(plan, topo)
        dtype = plan_matmul_dtype(plan, topo)
        durations = price(sim.program, topo, dtype).durations
        (left,) = [d for t, d in zip(sim.program.tasks, durations) if t.name == "optimizer"]
        fused = chunk_gemms(plan, 0).backward_weight  # the layers' and the head's: each with its update
        beyond = profiles[name]["matmul+optimizer"] / 1e9 - sum(gemm_seconds(topo, dtype, g) for g in fused)
        ratios[name] = left / (profiles[name]["optimizer"] / 1e9 + beyond)
        assert estimate(plan, topo).step_time_s == pytest.approx(sim.report.step_time_s, rel=0.03), name
        unfused = replace(topo, device=replace(topo.device, buffer_rules="xla"))
        assert simulate(plan, unfused).report.step_time_s > sim.report.step_time_s, name
    assert len(ratios) == 6 and statistics.median(ratios.values()) == pytest.approx(1.0, rel=0.15), ratios


def test_a_fused_update_hides_the_share_both_categories_fit() -> None:
    """EPILOGUE_HIDDEN is benchmarks/tpu_fused_update_fit.py's fit over the plans' and the users' programs' profiled
    kernels that hold an optimizer update; at it both categories' kernels are priced closer than by the longer of
    matmul and update (the unfitted rule), left out too, and so are the held-out proxies' kernels
    (benchmarks/tpu_chip/proxies/profiles.json); the programs' steps are no worse than at the longer of the two."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import tpu_fused_update_fit

    report = tpu_fused_update_fit.report()
    assert report["matches_shipped"] and report["kernels"]["plans"] >= 10 and report["kernels"]["programs"] >= 6
    assert len(report["programs"]) >= 3, report["programs"]
    summary = report["summary"]
    for category in ("plans", "programs"):
        errors = summary[category]
        assert errors["leave_one_out"]["median_abs"] < errors["longer_of_the_two"]["median_abs"], category
    proxies, steps = summary["held_out_proxies"], summary["program_steps"]
    assert proxies["fit"]["median_abs"] < proxies["longer_of_the_two"]["median_abs"]
    assert steps["fit"]["median_abs"] <= steps["longer_of_the_two"]["median_abs"]


def test_the_accumulation_fuses_into_the_gradient_matmuls_as_the_chip_compiles_it() -> None:
    """XLA:TPU adds each microbatch's weight gradient into the accumulator inside the gradient's matmul (the compiled
    loop bodies of benchmarks/tpu_chip/accumulate.json): one read of the accumulator, not an add of its own; both
    tiers price it so, and a device without the rule pays the add's three passes."""
    record = json.loads((ROOT / "benchmarks/tpu_chip/accumulate.json").read_text())
    topo = load_topology("tpu-v5e-1")
    assert record["rows"] and topo.device.fused_updates()
    for row in record["rows"]:
        assert row["gradient_matmuls"] > 0 and row["add_fused"] == row["gradient_matmuls"], row
        plan = _plan(row["plan"])
        params = param_count(plan.model)
        assert accumulated_bytes(plan, params, True, fused=True) == pytest.approx(
            accumulated_bytes(plan, params, True) * FUSED_ACCUMULATE_PASSES / ACCUMULATE_PASSES)
        sim = simulate(plan, topo)
        unfused = replace(topo, device=replace(topo.device, buffer_rules="xla"))
        backward = [t.hbm_bytes for t in sim.program.tasks if t.name.startswith("B")]
        assert sum(backward) < sum(t.hbm_bytes for t in simulate(plan, unfused).program.tasks
                                   if t.name.startswith("B")), row["plan"]
        assert estimate(plan, topo).step_time_s == pytest.approx(sim.report.step_time_s, rel=0.03), row["plan"]


def test_a_flash_product_narrower_than_the_mxu_fills_its_share() -> None:
    assert systolic_share(128, Gemm(m=2048, n=2048, k=64)) == 0.5
    assert systolic_share(128, Gemm(m=2048, n=128, k=2048)) == 1.0
    assert systolic_share(0, Gemm(m=2048, n=2048, k=64)) == 1.0
    topo = load_topology("tpu-v5e-1")
    plan = _plan("llama400m-bf16-full")  # head dim 64
    wide = replace(topo, device=replace(topo.device, systolic_width=0))
    assert simulate(plan, topo).report.step_time_s > simulate(plan, wide).report.step_time_s


def test_a_bad_systolic_width_is_refused_naming_the_field() -> None:
    topo = load_topology("tpu-v5e-1")
    for bad in (-1, 1.5, True, 10**6):
        with pytest.raises(InputError, match="systolic matrix unit") as caught:
            replace(topo.device, systolic_width=bad)
        assert caught.value.field == "device.systolic_width"


def test_an_fp32_step_on_a_tpu_runs_bf16_passes_on_fp32_operands() -> None:
    from testbed.sim.price.compute import FP32_BF16_PASS, gemm_seconds, rate_dtype

    topo = load_topology("tpu-v5e-1")
    plan = _plan("gpt125m-fp32")
    assert plan_matmul_dtype(plan, topo) == FP32_BF16_PASS and rate_dtype(FP32_BF16_PASS) == "bf16"
    highest = replace(plan, runtime=replace(plan.runtime, matmul_precision="highest"))
    assert plan_matmul_dtype(highest, topo) == "fp32"
    scores = Gemm(m=1024, n=1024, k=64, batch=96)  # memory-bound: its operands' bytes decide
    assert gemm_seconds(topo, FP32_BF16_PASS, scores) > 1.5 * gemm_seconds(topo, "bf16", scores)
    square = Gemm(m=8192, n=8192, k=8192)  # compute-bound: the bf16 rate
    assert gemm_seconds(topo, FP32_BF16_PASS, square) == pytest.approx(gemm_seconds(topo, "bf16", square))
    assert 0.1 < simulate(plan, topo).report.mfu < 1  # against the bf16 peak the products run at (fp32's: 1.6)


def test_an_accumulating_weight_gradient_costs_its_matmuls_roofline_as_the_chip_profiles_it() -> None:
    """The MLP input projection's weight gradient (``bf16[768,3072]``, the add into the accumulator fused into it:
    accumulate.json) on the chip's per-op profiles of the 125M step at 16, 8 and 4 microbatches: within 12% of its
    product priced as one kernel with the accumulator's read (testbed.sim.step.grad_bytes.accumulating_gemms), over the
    product without the add by less than that read's own pass (the read hides under the math, where the backward's
    bytes counted it whole). On a device that does not fuse it, nothing is marked and the three passes stay."""
    profiles = {p["plan"]: p for p in json.loads((ROOT / "benchmarks/tpu_chip/profiles.json").read_text())["plans"]}
    topo = load_topology("tpu-v5e-1")
    for name in ("gpt125m-bf16-accum16", "gpt125m-bf16-accum8", "gpt125m-bf16-accum4"):
        plan, ops = _plan(name), profiles[name]["planes"]["/device:TPU:0"]["top_ops"]
        times = [o["ns_per_step"] / o["count_per_step"] / 1e9 for o in ops
                 if o["class"] == "matmul" and re.search(r"= bf16\[768,3072\]\{", o["op"])]
        assert len(times) == plan.model.layers, name
        shapes = accumulating_gemms(plan, chunk_gemms(plan, 0), topo.device.fused_updates())
        (grad,) = [replace(g, count=1.0) for g in shapes.backward_weight if (g.m, g.n) == (768, 3072)]
        assert grad.accumulates, name
        measured, plain = statistics.median(times), gemm_seconds(topo, "bf16", replace(grad, accumulates=False))
        assert measured == pytest.approx(gemm_seconds(topo, "bf16", grad), rel=0.12), name
        assert measured - plain < pass_seconds(topo, grad.m * grad.n * 2), name
        params = param_count(plan.model)
        rest = accumulated_bytes(plan, params, True, fused=True, in_matmuls=accumulated_elements(shapes))
        assert 0 < rest < accumulated_bytes(plan, params, True, fused=True), name
        assert accumulating_gemms(plan, chunk_gemms(plan, 0), False) == chunk_gemms(plan, 0), name


def test_a_kept_splash_output_is_tiled_to_the_lanes_as_the_chip_allocated_it() -> None:
    """``save-flash`` keeps each layer's splash output in the kernel's heads-first layout, whose head dim of 64
    XLA:TPU tiles to 128 lanes: every recorded output buffer of the plan's compiled step (the chip's buffer
    assignment, benchmarks/tpu_chip/saveflash_buffers.json) is what testbed.model.xla_tpu.kept_flash_bytes keeps
    less the row log-sum-exp, twice the output's values."""
    from testbed.model import kept, xla_tpu
    from testbed.model.activations import FLASH_BYTES

    record = json.loads((ROOT / "benchmarks" / "tpu_chip" / "saveflash_buffers.json").read_text())
    plan = load_plan(str(ROOT / "plans" / "validation-1dev" / f"{record['plan']}.yaml"))
    n, spec = plan.microbatch_size * plan.model.seq_len, plan.model
    lse = FLASH_BYTES * n * spec.heads
    assert len(record["outputs"]) == spec.layers
    assert {o["buffer_bytes"] for o in record["outputs"]} == {xla_tpu.kept_flash_bytes(plan) - lse}
    assert xla_tpu.kept_flash_bytes(plan) - lse == 2 * (kept.flash_kept_bytes(plan) - lse)


def test_an_accumulate_and_a_traced_fusion_are_one_epilogue_rule() -> None:
    """The plan's accumulating weight gradient and a traced program's matmul with the same bytes fused into its kernel
    (testbed.sim.xla.matmul_fusion) cost the same: one kernel, the longer of its math and all its bytes."""
    topo = load_topology("tpu-v5e-1")
    bound = Gemm(m=768, n=3072, k=256)  # memory-bound: the fused bytes add to its operands'
    read = bound.m * bound.n * 2  # the bf16 accumulator
    assert gemm_seconds(topo, "bf16", replace(bound, accumulates=True)) == pytest.approx(
        gemm_seconds(topo, "bf16", replace(bound, fused_bytes=read)))
    assert gemm_seconds(topo, "bf16", replace(bound, fused_bytes=read)) - gemm_seconds(topo, "bf16", bound) \
        == pytest.approx(pass_seconds(topo, read))
    on_chip = replace(bound, fused_bytes=read, result_on_chip=True)  # its consumer's bytes in place of its result
    assert gemm_seconds(topo, "bf16", on_chip) == pytest.approx(gemm_seconds(topo, "bf16", bound))
    square = Gemm(m=8192, n=8192, k=8192)  # compute-bound: its fused bytes hide under the math
    assert gemm_seconds(topo, "bf16", replace(square, fused_bytes=1e6)) == gemm_seconds(topo, "bf16", square)
