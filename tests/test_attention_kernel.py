"""``runtime.attention_kernel``: the field, the published speeds it prices flash attention at, the causal half a
tile-skipping kernel computes (ring attention's included), and the runner's default leaving everything as it was."""

from __future__ import annotations


import pytest

from testbed.errors import InputError
from testbed.explore.analytic import estimate
from testbed.model.gemm import AttentionPass, Gemm, chunk_gemms
from testbed.plan.io import plan_from_dict
from testbed.plan.placement import place
from testbed.plan.runtime import ATTENTION_KERNELS, PROFILES, RuntimeSpec
from testbed.sim.price.attention_kernels import CAUSAL_WORK, KERNEL_TFLOPS, SOURCES, kernel_efficiency
from testbed.sim.price.compute import gemm_seconds
from testbed.sim.graph.engine import simulate
from testbed.sim.graph.program import build_program
from testbed.topology.io import load_topology


def _plan(kernel: str | None = None, **over):
    spec = {"name": "a", "model": {"layers": 4, "d_model": 1024, "heads": 8, "d_ff": 4096, "seq_len": 4096,
                                   "vocab": 32000, "attention": "flash"},
            "batch": {"global_batch": 8, "microbatches": 2}, "mesh": {"data": 4, "tensor": 2},
            "precision": "bf16-mixed", "remat": "none"}
    spec.update(over)
    if kernel is not None:
        spec["runtime"] = {"attention_kernel": kernel}
    return plan_from_dict(spec, default_name="a")


def _attention(gemms):
    return [g for g in gemms if g.flash]


def test_the_field_parses_and_bad_values_name_it():
    assert RuntimeSpec().attention_kernel == "runner"
    assert _plan("flash3").runtime.attention_kernel == "flash3"
    for bad in ("flash4", 3):
        with pytest.raises(InputError) as err:
            _plan(bad)
        assert "runtime.attention_kernel" in str(err.value)
    assert set(ATTENTION_KERNELS) >= {v["attention_kernel"] for v in PROFILES.values() if "attention_kernel" in v}


def test_every_table_cites_its_source_and_is_a_fraction_of_peak():
    for key, table in KERNEL_TFLOPS.items():
        assert SOURCES.get(key), key
        for rows in table.values():
            for row in rows.values():
                assert all(0 < v < 989 for v in row)


def test_the_runner_kernel_leaves_the_task_graph_and_both_tiers_unchanged():
    topology = load_topology("dgx-h100")
    base, stated = _plan(), _plan("runner")
    placement = place(base, topology)
    assert build_program(stated, placement).tasks == build_program(base, placement).tasks
    assert simulate(stated, topology).report.step_time_s == simulate(base, topology).report.step_time_s
    assert estimate(stated, topology).step_time_s == estimate(base, topology).step_time_s


def test_each_pass_is_priced_at_its_published_speed_over_the_half_it_computes():
    """A causal forward product of FlashAttention-2 on H100 at head dim 128 and 16k keys runs at the FA3 paper's
    335 TFLOP/s over half its counted FLOPs; the backward at 322 TFLOP/s; a ring's unmasked half block whole."""
    h100 = load_topology("dgx-h100")
    latency, peak = h100.calibration.compute.gemm_latency_s, h100.device.flops("bf16")
    g = Gemm(16384, 16384, 128, batch=16, flash=True)
    fwd = AttentionPass(kernel="flash2", backward=False, causal=True, seq=16384, head_dim=128)
    bwd = AttentionPass(kernel="flash2", backward=True, causal=True, seq=16384, head_dim=128)
    half = AttentionPass(kernel="flash2", backward=False, causal=False, seq=16384, head_dim=128)
    assert gemm_seconds(h100, "bf16", Gemm(g.m, g.n, g.k, g.batch, 1.0, True, fwd)) == pytest.approx(
        latency + g.flops * CAUSAL_WORK / 335e12)
    assert gemm_seconds(h100, "bf16", Gemm(g.m, g.n, g.k, g.batch, 1.0, True, bwd)) == pytest.approx(
        latency + g.flops * CAUSAL_WORK / 322e12)
    assert gemm_seconds(h100, "bf16", Gemm(g.m, g.n, g.k, g.batch, 1.0, True, half)) == pytest.approx(
        latency + g.flops / 370e12)
    assert peak == pytest.approx(989e12)
    # between published points: linear in log2(seq) and head dim, held at the ends
    eff_8k = kernel_efficiency("H100-SXM5-80GB", AttentionPass("flash2", False, True, 8192, 128))[0]
    eff_11k = kernel_efficiency("H100-SXM5-80GB", AttentionPass("flash2", False, True, 11585, 128))[0]
    eff_1m = kernel_efficiency("H100-SXM5-80GB", AttentionPass("flash2", False, True, 1 << 20, 128))[0]
    assert 333 / 989 < eff_11k < 335 / 989 and eff_8k == pytest.approx(333 / 989) and eff_1m == pytest.approx(335 / 989)
    eff_96 = kernel_efficiency("H100", AttentionPass("flash2", False, False, 16384, 96))[0]
    assert eff_96 == pytest.approx((324 + 370) / 2 / 989)


def test_faster_kernels_price_faster_and_unmeasured_devices_fall_back():
    h100, a100 = load_topology("dgx-h100"), load_topology("a100-pcie-8")
    steps = {k: simulate(_plan(k), h100).report.step_time_s for k in ("flash2", "cudnn", "flash3")}
    assert steps["flash3"] < steps["cudnn"] < steps["flash2"]
    assert estimate(_plan("flash3"), h100).step_time_s < estimate(_plan("flash2"), h100).step_time_s
    # no published A100 figure, no H100 figure for the Triton kernel: the runner's pricing
    assert simulate(_plan("flash2"), a100).report.step_time_s == simulate(_plan(), a100).report.step_time_s
    assert simulate(_plan("triton"), h100).report.step_time_s == simulate(_plan(), h100).report.step_time_s


def test_the_backward_kernel_carries_the_gradients_and_the_recomputed_scores():
    """F holds the forward kernel's two products; B the backward kernel's five (2.5x the forward's FLOPs); full
    remat's rerun of the forward is the forward kernel again."""
    plan = _plan("flash2", remat="full")
    g = chunk_gemms(plan, 0)
    f = _attention(g.forward)
    b = _attention(g.backward_input + g.recompute)
    assert all(x.attention and not x.attention.backward for x in f)
    back = [x for x in b if x.attention.backward]
    assert sum(x.flops for x in back) == pytest.approx(2.5 * sum(x.flops for x in f))
    assert sum(x.flops for x in b if not x.attention.backward) == pytest.approx(sum(x.flops for x in f))
    assert all(x.attention.causal and x.attention.seq == 4096 and x.attention.head_dim == 128 for x in f + b)


@pytest.mark.parametrize("context", [2, 4])
def test_ring_attention_computes_the_causal_half_of_the_sequence_per_rank(context):
    """Under a tile-skipping kernel the ring's step 0 (causal) is half its block, its later steps whole: a rank's
    forward attention work is exactly ``1/c`` of the sequence's causal half (``2 b s^2 q / t``); the runner's
    kernel computes step 0 whole (two chunk pairs more)."""
    layout = {"mesh": {"data": 8 // (2 * context), "tensor": 2, "context": context},
              "batch": {"global_batch": 8, "microbatches": 1}}
    plan = _plan("flash2", **layout)
    spec, b, t = plan.model, plan.microbatch_size, plan.mesh.tensor
    layers = spec.layers
    fwd = [x for x in chunk_gemms(plan, 0).forward if x.flash]
    work = sum(x.flops * (CAUSAL_WORK if x.attention.causal else 1.0) for x in fwd)
    causal_half = 2 * b * spec.seq_len ** 2 * spec.q_dim / t * layers
    assert work == pytest.approx(causal_half / context)
    runner = sum(x.flops for x in chunk_gemms(_plan(**layout), 0).forward if x.flash)
    assert runner == pytest.approx(causal_half / context * (context + 1) / context)
    # the task graph takes each ring step's products out of its action by their tags (a mismatch raises), under
    # full remat too (the rerun forward is the forward kernel's), and prices them at the kernel's speeds
    h100 = load_topology("dgx-h100")
    for remat in ("none", "full"):
        tagged, plain = _plan("flash2", remat=remat, **layout), _plan(remat=remat, **layout)
        assert simulate(tagged, h100).report.step_time_s != simulate(plain, h100).report.step_time_s
        assert estimate(tagged, h100).step_time_s != estimate(plain, h100).step_time_s


def test_the_v5e_tpu_flash_figures_are_the_chips_record_and_price_a_slice_without_shapes():
    """JAX's first Pallas TPU kernel on v5e: its table is benchmarks/tpu_chip/flash_kernels.json's TFLOP/s (the
    causal backward measured too), and on a slice without a GEMM shape model its products are priced by it while
    the other FLOPs keep the calibrated rate."""
    import json
    from pathlib import Path

    from testbed.sim.price.compute import compute_seconds

    record = json.loads((Path(__file__).resolve().parent.parent / "benchmarks" / "tpu_chip" /
                         "flash_kernels.json").read_text())["kernels"]
    table = KERNEL_TFLOPS[("tpu-flash", "TPU-v5e")]
    for (name, key), index in {("full", "forward"): 0, ("causal", "forward_causal"): 0, ("full", "backward"): 1,
                               ("causal", "backward_causal"): 1}.items():
        for dim in (64, 128):
            rows = record[f"tpu-flash/d{dim}/{name}"]
            assert table[key][dim] == tuple(rows[s][("forward_tflops", "backward_tflops")[index]] for s in rows)
    slice_ = load_topology("tpu-v5e-4x4")
    assert not slice_.calibration.compute.shapes
    mark = AttentionPass(kernel="tpu-flash", backward=True, causal=True, seq=4096, head_dim=128)
    flash = Gemm(4096, 4096, 128, batch=8, flash=True, attention=mark)
    dense = Gemm(4096, 4096, 4096)
    both = compute_seconds(slice_, "bf16", flash.flops + dense.flops, 0.0, gemms=(flash, dense))
    alone = compute_seconds(slice_, "bf16", dense.flops, 0.0, gemms=(dense,))
    assert both - alone == pytest.approx(gemm_seconds(slice_, "bf16", flash), rel=1e-6)
    assert gemm_seconds(slice_, "bf16", flash) == pytest.approx(
        flash.flops * CAUSAL_WORK / (197e12 * 50.75 / 197.0), rel=1e-3)
