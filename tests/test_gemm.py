"""The GEMM shape model: shapes per action match the FLOP counts, efficiency is monotone in size, the fit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from testbed.model import costs
from testbed.model.gemm import Gemm, chunk_gemms, gemm_flops
from testbed.plan.io import plan_from_dict
from testbed.sim.price.compute import gemm_efficiency, gemm_seconds
from testbed.sim.graph.engine import compute_seconds, simulate
from testbed.topology.io import load_topology

ROOT = Path(__file__).resolve().parents[1]
GPUS = ["dgx-a100-superpod", "a100-pcie-8", "dgx-h100", "dgx-h100-x4", "dgx-h100-superpod"]


def _plan(**over) -> "object":
    spec = {"name": "g", "model": {"layers": 4, "d_model": 64, "heads": 4, "d_ff": 256, "seq_len": 16, "vocab": 96},
            "batch": {"global_batch": 8, "microbatches": 2}, "mesh": {"data": 1, "tensor": 2, "stage": 2},
            "schedule": {"name": "interleaved", "virtual_stages": 2}, "precision": "bf16-mixed", "remat": "full"}
    for k, v in over.items():
        spec[k] = {**spec[k], **v} if isinstance(v, dict) and isinstance(spec.get(k), dict) else v
    return plan_from_dict(spec, default_name="g")


@pytest.mark.parametrize("over", [
    {}, {"remat": "selective"}, {"remat": "none"},
    {"model": {"kv_heads": 1, "mlp": "swiglu", "norm": "rmsnorm", "position": "rope"}},
    {"model": {"vocab": 97}, "mesh": {"tensor": 4, "stage": 1, "data": 1}, "schedule": "1f1b"},
    {"model": {"attention": "flash"}}, {"model": {"attention": "flash"}, "remat": "selective"},
    {"model": {"attention": "flash"}, "remat": "none"},
])
def test_gemm_flops_equal_the_cost_model(over):
    plan = _plan(**over)
    for s in range(plan.mesh.stage):
        for c in range(plan.schedule.virtual_stages):
            cost, g = costs.chunk_cost(plan, s, c), chunk_gemms(plan, s, c)
            assert gemm_flops(g.forward) == pytest.approx(cost.forward_flops)
            assert gemm_flops(g.backward_input) == pytest.approx(cost.backward_input_flops)
            assert gemm_flops(g.backward_weight) == pytest.approx(cost.backward_weight_flops)
            assert gemm_flops(g.recompute) == pytest.approx(cost.recompute_flops)
            assert gemm_flops(g.action("B", False)) == pytest.approx(cost.backward_flops + cost.recompute_flops)


def test_program_tasks_carry_their_gemms():
    plan = _plan(mesh={"data": 2})
    sim = simulate(plan, load_topology("dgx-h100"))
    actions = [t for t in sim.program.tasks if t.pipeline and t.kind.value == "compute"
               and not t.name.startswith("accumulate ")]  # the gradient accumulator's add: a memory pass
    assert actions and all(t.gemms for t in actions)
    for t in actions:
        assert gemm_flops(t.gemms) == pytest.approx(t.flops)


dims = st.integers(min_value=1, max_value=1 << 16)


@pytest.mark.parametrize("name", GPUS)
@given(m=dims, n=dims, k=dims, b=st.integers(1, 64), which=st.sampled_from("mnkb"), grow=st.integers(2, 64))
@settings(deadline=None)
def test_gemm_rate_is_monotone_in_every_dimension(name, m, n, k, b, which, grow):
    topo = load_topology(name)
    g = Gemm(m, n, k, batch=b)
    bigger = Gemm(**{**dict(m=m, n=n, k=k, batch=b), {"b": "batch"}.get(which, which):
                     grow * getattr(g, {"b": "batch"}.get(which, which))})
    assert gemm_efficiency(topo.calibration.compute, bigger) >= gemm_efficiency(topo.calibration.compute, g)
    rate = g.flops / gemm_seconds(topo, "bf16", g)
    assert bigger.flops / gemm_seconds(topo, "bf16", bigger) >= rate * (1 - 1e-12)
    assert rate <= topo.calibration.compute.efficiency * topo.device.flops("bf16")


@pytest.mark.parametrize("name", GPUS)
def test_small_and_skinny_gemms_are_far_from_peak_large_ones_near_it(name):
    topo = load_topology(name)
    compute = topo.calibration.compute
    assert compute.shapes
    large = gemm_efficiency(compute, Gemm(8192, 8192, 8192))
    assert large == pytest.approx(compute.efficiency)
    assert gemm_efficiency(compute, Gemm(2048, 64, 2048)) < 0.4 * large  # skinny: n = 64
    assert gemm_efficiency(compute, Gemm(2048, 2048, 64)) < 0.5 * large  # short reduction (a head dim)
    assert gemm_efficiency(compute, Gemm(256, 256, 256)) < 0.5 * large


def test_gemm_pricing_replaces_the_flops_ramp_only_with_the_shape_fields():
    h100, host = load_topology("dgx-h100"), load_topology("host-cpu-8")
    g = (Gemm(512, 512, 64, batch=8, count=3.0),)
    f = g[0].flops
    assert not host.calibration.compute.shapes
    assert compute_seconds(host, "fp32", f, 0.0, 4, gemms=g) == compute_seconds(host, "fp32", f, 0.0, 4)
    shaped = compute_seconds(h100, "bf16", f, 0.0, 4, gemms=g)
    assert shaped == pytest.approx(h100.calibration.compute.launch_overhead_s + gemm_seconds(h100, "bf16", g[0]))


def test_fit_reproduces_the_topology_constants():
    sys.path.insert(0, str(ROOT / "benchmarks" / "published"))
    import gemm as published_gemm

    out = published_gemm.fit()
    compute = load_topology("dgx-h100").calibration.compute
    assert out["rows"] == 375 and out["median_abs_error"] < 0.05
    assert out["gemm_half_mn"] == pytest.approx(compute.gemm_half_mn, rel=0.01)
    assert out["gemm_half_k"] == pytest.approx(compute.gemm_half_k, rel=0.01)
    assert out["gemm_latency_s"] == pytest.approx(compute.gemm_latency_s, rel=0.01)


def test_one_layer_chunks_still_reduce_their_gradients():
    # Interleaved chunks of one layer (Megatron's 530B and 1T rows) reduce their gradients over data too.
    plan = _plan(model={"layers": 4}, mesh={"data": 4, "tensor": 1, "stage": 2}, batch={"global_batch": 16})
    assert plan.model.layers // (plan.mesh.stage * plan.schedule.virtual_stages) == 1
    program = simulate(plan, load_topology("a100-pcie-8")).program
    for stage_rep in program.representatives:
        reduces = [t for t in program.tasks if t.device == stage_rep and t.stream == "grad"]
        assert len(reduces) == plan.schedule.virtual_stages


def test_flash_attention_products_run_at_the_kernels_efficiency():
    a100, h100 = load_topology("dgx-a100-superpod"), load_topology("dgx-h100")
    plain, flash = Gemm(2048, 2048, 128, batch=16), Gemm(2048, 2048, 128, batch=16, flash=True)
    for topo in (a100, h100):
        assert gemm_seconds(topo, "bf16", flash) < gemm_seconds(topo, "bf16", plain)  # no s x s scores in HBM
    eff = a100.calibration.compute.flash_efficiency
    assert eff == 0.5
    assert gemm_seconds(a100, "bf16", flash) == pytest.approx(
        a100.calibration.compute.gemm_latency_s + flash.flops / (a100.device.sustained_flops("bf16") * eff))
