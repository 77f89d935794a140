"""``runtime.moe_dispatch: megablox``: the routed experts' GEMMs at MaxText's megablox kernel's published rate
(testbed.sim.price.grouped_kernels), issue 34.

Small MoE GPTs: the value parses and a bad one is refused by name; the routed experts' GEMMs (and only they) carry
the kernel through the backward and the recompute; on TPU v5p each costs ``1 / rate`` times its dense time, so
the step slows by the same seconds in both tiers with the FLOPs unchanged; a device without a figure and a dense
model are left as they were; every rate has its source.
"""

from __future__ import annotations

import math

import pytest

from testbed.errors import InputError
from testbed.explore.analytic import estimate
from testbed.model import costs
from testbed.model.gemm import chunk_gemms, gemm_flops
from testbed.plan.io import plan_from_dict
from testbed.sim.price.compute import compute_seconds
from testbed.sim.graph.engine import simulate
from testbed.sim.price.grouped_kernels import RATES, SOURCES, grouped_rate
from testbed.topology.io import load_topology

MODEL = {"layers": 4, "d_model": 256, "heads": 8, "d_ff": 512, "seq_len": 128, "vocab": 512, "experts": 4,
         "top_k": 2, "attention": "flash"}
#: Large enough, at 16 sequences a device, that the step is compute-bound on the slice (the small model's is its
#: FSDP gathers').
BIG, BATCH = {"seq_len": 1024, "d_model": 1024, "d_ff": 4096}, 512
V5P = load_topology("tpu-v5p-2x4x4")
H100 = load_topology("dgx-h100")


def _plan(dispatch: str, model: dict | None = None, mesh: dict | None = None, batch: int = 32):
    spec = {"name": "m", "model": {**MODEL, **(model or {})}, "batch": {"global_batch": batch, "microbatches": 1},
            "mesh": mesh or {"fsdp": 32}, "precision": "bf16-mixed", "remat": "full",
            "runtime": {"profile": "xla", "moe_dispatch": dispatch}}
    return plan_from_dict(spec, default_name="m")


def _steps(plan, topology) -> tuple[float, float]:
    return simulate(plan, topology).report.step_time_s, estimate(plan, topology).step_time_s


def test_megablox_parses_and_bad_values_name_the_field() -> None:
    assert _plan("megablox").runtime.moe_dispatch == "megablox"
    with pytest.raises(InputError) as err:
        _plan("grouped")
    assert err.value.field == "runtime.moe_dispatch" and "megablox" in str(err.value)


def test_only_the_routed_experts_carry_the_kernel_through_every_pass() -> None:
    plan, gather = _plan("megablox"), _plan("gather")
    mine, theirs = chunk_gemms(plan, 0), chunk_gemms(gather, 0)
    for kind in ("forward", "backward_input", "backward_weight", "recompute"):
        tagged = [g for g in getattr(mine, kind) if g.grouped]
        assert tagged and all(g.grouped == "megablox" and g.batch == MODEL["experts"] for g in tagged)
        assert not any(g.grouped for g in getattr(theirs, kind))
        assert gemm_flops(getattr(mine, kind)) == gemm_flops(getattr(theirs, kind))  # the same FLOPs
    assert costs.step_flops_per_device(plan) == costs.step_flops_per_device(gather)


def test_a_tagged_gemm_costs_one_over_the_rate_on_v5p() -> None:
    gemms = chunk_gemms(_plan("megablox"), 0).forward
    flops, grouped = gemm_flops(gemms), gemm_flops(tuple(g for g in gemms if g.grouped))
    plain = compute_seconds(V5P, "bf16", flops, 0.0, 1, gemms=chunk_gemms(_plan("gather"), 0).forward)
    slow = compute_seconds(V5P, "bf16", flops, 0.0, 1, gemms=gemms)
    rate = grouped_rate("TPU-v5p", "megablox")
    launch = V5P.calibration.compute.launch_overhead_s
    assert math.isclose((slow - launch) / (plain - launch), (flops - grouped + grouped / rate) / flops, rel_tol=1e-12)


def test_the_step_slows_alike_in_both_tiers_on_v5p_and_nowhere_else() -> None:
    des, analytic = _steps(_plan("megablox", BIG, batch=BATCH), V5P)
    des0, analytic0 = _steps(_plan("gather", BIG, batch=BATCH), V5P)
    gemms = chunk_gemms(_plan("megablox", BIG, batch=BATCH), 0)
    grouped = sum(g.flops for kind in ("forward", "backward_input", "backward_weight", "recompute")
                  for g in getattr(gemms, kind) if g.grouped)
    compute = V5P.calibration.compute
    extra = grouped * (1 / grouped_rate("TPU-v5p", "megablox") - 1) / (V5P.device.sustained_flops("bf16")
                                                                       * compute.cap("bf16"))
    assert compute.efficiency_half_flops == 0  # so each task runs at the cap
    assert math.isclose(des - des0, extra, rel_tol=1e-6) and math.isclose(analytic - analytic0, extra, rel_tol=1e-6)
    node = {"fsdp": 8}
    assert _steps(_plan("megablox", mesh=node), H100) == _steps(_plan("gather", mesh=node), H100)  # no figure
    dense = {"experts": 0}
    assert _steps(_plan("megablox", dense), V5P) == _steps(_plan("gather", dense), V5P)


def test_expert_parallel_chains_run_the_kernel_too() -> None:
    mesh = {"fsdp": 16, "expert": 2}
    des, analytic = _steps(_plan("megablox", BIG, mesh, BATCH), V5P)
    des0, analytic0 = _steps(_plan("gather", BIG, mesh, BATCH), V5P)
    assert des > des0 and analytic > analytic0


def test_every_rate_has_its_source_and_is_the_published_ratio() -> None:
    assert set(RATES) == set(SOURCES)
    assert RATES[("megablox", "TPU-v5p")] == round(50.4 / 63.99, 4)
    assert all(0 < r <= 1 for r in RATES.values())
    assert grouped_rate("TPU-v5p", None) == 1.0 and grouped_rate("TPU-v6e", "megablox") == 1.0
