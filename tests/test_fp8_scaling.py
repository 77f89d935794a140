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
from testbed.sim.compute import fp8_cast_bytes, gemm_seconds, pass_seconds
from testbed.sim.engine import simulate
from testbed.sim.program import build_program
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
