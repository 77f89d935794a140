"""``runtime.fp8_scaling``: fp8 current scaling's amax read before each cast (Transformer Engine's
Float8CurrentScaling), priced as memory passes on the fp8 GEMMs' casts; delayed scaling, the default, as before."""

from __future__ import annotations


import pytest

from testbed.errors import InputError
from testbed.explore.analytic import estimate
from testbed.model.gemm import Gemm, chunk_gemms
from testbed.plan.io import plan_from_dict
from testbed.plan.placement import place
from testbed.plan.runtime import FP8_SCALINGS, PROFILES, RuntimeSpec
from testbed.sim.price.compute import FP8_BLOCK_SCALED_SHARE, fp8_cast_bytes, gemm_seconds, pass_seconds
from testbed.sim.graph.engine import simulate
from testbed.sim.graph.program import build_program
from testbed.topology.io import load_topology


_SPEC = {"name": "a", "model": {"layers": 4, "d_model": 1024, "heads": 8, "d_ff": 4096, "seq_len": 2048,
                                "vocab": 32000, "attention": "flash"},
         "batch": {"global_batch": 8, "microbatches": 2}, "mesh": {"data": 4, "tensor": 2},
         "precision": "fp8-mixed", "remat": "none"}


def _plan(scaling: str | None = None, precision: str = "fp8-mixed"):
    spec = {**_SPEC, "precision": precision}
    if scaling is not None:
        spec["runtime"] = {"profile": "nemo", "fp8_scaling": scaling}
    return plan_from_dict(spec, default_name="a")


def _all(plan):
    g = chunk_gemms(plan, 0)
    return g.forward + g.backward_input + g.backward_weight + g.recompute


def test_the_field_parses_and_bad_values_name_it():
    assert RuntimeSpec().fp8_scaling == "delayed"
    assert _plan("current").runtime.fp8_scaling == "current"
    assert all(v.get("fp8_scaling", "delayed") in FP8_SCALINGS for v in PROFILES.values())
    for bad in ("tensorwise", 1):
        with pytest.raises(InputError) as err:
            _plan(bad)
        assert "runtime.fp8_scaling" in str(err.value)


def test_current_scaling_tags_every_cast_gemm_and_no_attention_product():
    gemms = _all(_plan("current"))
    assert all(g.amax_pass != g.flash for g in gemms)
    assert not any(g.amax_pass for g in _all(_plan("delayed")))
    # only fp8 plans cast: a bf16 plan's GEMMs stay untagged under the same runtime
    assert not any(g.amax_pass for g in _all(_plan("current", precision="bf16-mixed")))


def test_the_amax_read_adds_two_bytes_per_value_of_the_two_cast_tensors():
    g = Gemm(8192, 4096, 4096, count=3.0)
    tagged = Gemm(8192, 4096, 4096, count=3.0, amax_pass=True)
    # a layer's three products: 9 bytes per value counted for the casts, 4 more for the two amax reads
    assert fp8_cast_bytes(tagged) - fp8_cast_bytes(g) == pytest.approx(4.0 * 8192 * 4096)
    topology = load_topology("dgx-h100")
    extra = gemm_seconds(topology, "fp8", tagged) - gemm_seconds(topology, "fp8", g)
    assert extra == pytest.approx(pass_seconds(topology, 4.0 * 8192 * 4096))
    # bf16 GEMMs are not cast: the tag changes nothing
    assert gemm_seconds(topology, "bf16", tagged) == gemm_seconds(topology, "bf16", g)


def test_delayed_is_the_default_and_current_is_slower_in_both_tiers():
    topology = load_topology("dgx-h100")
    unset, delayed, current = _plan(), _plan("delayed"), _plan("current")
    placement = place(unset, topology)
    stated = plan_from_dict({**_SPEC, "runtime": {"fp8_scaling": "delayed"}}, default_name="a")
    assert build_program(stated, placement).tasks == build_program(unset, placement).tasks
    assert simulate(stated, topology).report.step_time_s == simulate(unset, topology).report.step_time_s
    assert simulate(current, topology).report.step_time_s > simulate(delayed, topology).report.step_time_s
    assert estimate(current, topology).step_time_s > estimate(delayed, topology).step_time_s


def test_blockwise_tags_every_cast_gemm_and_runs_them_at_the_block_scaled_share_of_the_cap():
    gemms = _all(_plan("blockwise"))
    assert all(g.block_scaled != g.flash for g in gemms) and not any(g.amax_pass for g in gemms)
    assert not any(g.block_scaled for g in _all(_plan("blockwise", precision="bf16-mixed")))
    topology = load_topology("dgx-h100")
    g, tagged = Gemm(8192, 8192, 8192, count=2.0), Gemm(8192, 8192, 8192, count=2.0, block_scaled=True)
    # the cap binds at this shape: the GEMM's math alone (no casts) is slower by exactly 1 / share
    assert gemm_seconds(topology, "fp8", tagged, casts=False) - topology.calibration.compute.gemm_latency_s * 2 == \
        pytest.approx((gemm_seconds(topology, "fp8", g, casts=False)
                       - topology.calibration.compute.gemm_latency_s * 2) / FP8_BLOCK_SCALED_SHARE)
    # the casts are delayed scaling's (each block's amax found inside the cast), and bf16 is untouched
    assert fp8_cast_bytes(tagged) == fp8_cast_bytes(g)
    assert gemm_seconds(topology, "bf16", tagged) == gemm_seconds(topology, "bf16", g)


def test_blockwise_is_slower_than_delayed_in_both_tiers_with_expert_parallel_moe_layers():
    """An MoE layer's chain takes its experts' GEMMs out of the action's by shape and tag (testbed.sim.step.moe): the
    tags must survive scaling (lost, blockwise fails with 'not among the GEMMs')."""
    topology = load_topology("dgx-h100")
    spec = {**_SPEC, "model": {**_SPEC["model"], "experts": 4, "top_k": 2}, "mesh": {"expert": 4, "tensor": 2},
            "batch": {"global_batch": 8, "microbatches": 2}}
    plans = {s: plan_from_dict({**spec, "runtime": {"profile": "megatron", "fp8_scaling": s}}, default_name="a")
             for s in ("delayed", "blockwise")}
    assert simulate(plans["blockwise"], topology).report.step_time_s > \
        simulate(plans["delayed"], topology).report.step_time_s
    assert estimate(plans["blockwise"], topology).step_time_s > estimate(plans["delayed"], topology).step_time_s


def test_the_block_scaled_share_is_the_fit_over_deepgemm_with_its_leave_one_out_error():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks" / "published"))
    import gemm as gemm_fit

    out = gemm_fit.fit_blockwise()
    assert out["rows"] >= 10 and not out["stale"] and out["share"] == FP8_BLOCK_SCALED_SHARE < 1
    # the share explains the per-tensor cap's bias on the block-scaled table, and holds out of sample
    assert out["in_sample"]["median_abs_error"] < out["per_tensor_cap"]["median_abs_error"]
    assert out["leave_one_out"]["median_abs_error"] - out["in_sample"]["median_abs_error"] <= 0.02
