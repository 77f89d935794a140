"""``runtime.moe_dispatch``: MaxText's one-hot einsum dispatch priced as its matmuls (testbed.model.dispatch).

Small MoE GPTs on an 8-GPU H100 node: the field parses and refuses bad values by name (exit 2 on the command
line), the cost model and the task graph's GEMM lists add the same FLOPs, the step slows in both tiers and
more with a larger capacity, and the default and a dense model are left as they were.
"""

from __future__ import annotations

import math

import pytest

from testbed.errors import InputError
from testbed.explore.analytic import estimate
from testbed.model import costs
from testbed.model.dispatch import einsum_flops, einsum_shapes
from testbed.model.gemm import chunk_gemms, gemm_flops
from testbed.plan.io import plan_from_dict
from testbed.sim.graph.engine import simulate
from testbed.topology.io import load_topology

MODEL = {"layers": 4, "d_model": 256, "heads": 8, "d_ff": 512, "seq_len": 128, "vocab": 512, "experts": 4,
         "top_k": 2, "capacity_factor": 1.25, "moe_every": 2, "attention": "flash"}


def _dict(runtime: dict | None = None, model: dict | None = None, **over) -> dict:
    spec = {"name": "m", "model": {**MODEL, **(model or {})}, "batch": {"global_batch": 16, "microbatches": 2},
            "mesh": {"data": 4, "expert": 2}, "precision": "bf16-mixed", "remat": "full"}
    spec.update(over)
    if runtime is not None:
        spec["runtime"] = runtime
    return spec


def _plan(runtime: dict | None = None, model: dict | None = None, **over):
    return plan_from_dict(_dict(runtime, model, **over), default_name="m")


def _both(plan) -> tuple[float, float]:
    topology = load_topology("dgx-h100")
    return simulate(plan, topology).report.step_time_s, estimate(plan, topology).step_time_s


def test_bad_value_names_the_field():
    with pytest.raises(InputError) as err:
        _plan({"moe_dispatch": "onehot"})
    assert "runtime.moe_dispatch" in str(err.value) and "gather, einsum" in str(err.value)


def test_default_is_gather_and_changes_nothing():
    assert _both(_plan({"moe_dispatch": "gather"})) == _both(_plan())
    assert einsum_shapes(_plan()) == ((), (), ())


def test_a_dense_model_is_unchanged():
    dense = {"experts": 0, "top_k": 1, "capacity_factor": None, "moe_every": 1}
    plan = _plan(model=dense, mesh={"data": 8})
    einsum = _plan({"moe_dispatch": "einsum"}, model=dense, mesh={"data": 8})
    assert _both(einsum) == _both(plan)


@pytest.mark.parametrize("remat", ["full", "selective", "none"])
def test_cost_model_and_gemm_lists_add_the_same_einsum_flops(remat):
    """Per MoE layer and rank: forward 2, backward 3, recompute (full remat only) 1 einsum of ``2 N E C M``."""
    gather, einsum = _plan(remat=remat), _plan({"moe_dispatch": "einsum"}, remat=remat)
    spec = einsum.model
    capacity = math.ceil(1.25 * 128 * 2 / 4)  # testbed.model.moe.expert_capacity: 80 slots per sequence
    tokens = einsum.microbatch_size * spec.seq_len  # one rank's microbatch
    one = 2 * tokens * spec.experts * capacity * spec.d_model
    moe_layers = 2
    want = (2 * one * moe_layers, 3 * one * moe_layers, (one * moe_layers if remat == "full" else 0))
    assert einsum_flops(einsum, moe_layers) == want
    c0, c1 = costs.chunk_cost(gather, 0, 0), costs.chunk_cost(einsum, 0, 0)
    g0, g1 = chunk_gemms(gather, 0, 0), chunk_gemms(einsum, 0, 0)
    assert (c1.forward_flops - c0.forward_flops, c1.backward_input_flops - c0.backward_input_flops,
            c1.recompute_flops - c0.recompute_flops, c1.backward_weight_flops - c0.backward_weight_flops) == (*want, 0)
    for name, added in zip(("forward", "backward_input", "recompute", "backward_weight"), (*want, 0)):
        assert gemm_flops(getattr(g1, name)) - gemm_flops(getattr(g0, name)) == pytest.approx(added), name


def test_einsum_slows_the_step_and_more_with_a_larger_capacity():
    gather = _both(_plan())
    einsum = _both(_plan({"moe_dispatch": "einsum"}))
    wider = _both(_plan({"moe_dispatch": "einsum"}, model={"capacity_factor": 2.0}))
    wider_gather = _both(_plan(model={"capacity_factor": 2.0}))
    for i in range(2):  # DES and analytic alike
        assert einsum[i] > gather[i]
        assert wider[i] - wider_gather[i] > einsum[i] - gather[i]  # the einsums grow with the capacity
