"""Runner: every plan's parallel step equals the single-device reference.

Small GPTs on the 8 emulated CPU devices of conftest; plans drawn by
hypothesis over factorisations of 8 into data x fsdp x tensor x stage,
schedules, microbatches, ZeRO stage, remat and precision, plus fixed plans on
the first 1, 2, 3, 4, 6 devices.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import pytest
from hypothesis import given, settings, strategies as st

import statistics

from testbed.runner import devices as dev
from testbed.runner.results import RunResult, VerifyResult
from testbed.runner.train import run_plan, verify_plan
from testbed.runner.hlo import check_collectives, count_collectives, expected_collectives
from testbed.errors import InputError
from testbed.plan.runtime import RuntimeSpec
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec

MODEL = ModelSpec(layers=4, d_model=16, heads=4, d_ff=32, seq_len=8, vocab=32)
GLOBAL_BATCH = 48  # divisible by every (data x fsdp x microbatches) drawn below


def _plan(data=1, fsdp=1, tensor=1, stage=1, microbatches=1, schedule="1f1b", virtual=1, zero=0,
          remat="none", precision="fp32", model=MODEL, recompute="runner") -> Plan:
    # One global batch for every plan, so plans share the compiled reference step.
    return Plan(model=model, batch=BatchSpec(global_batch=GLOBAL_BATCH, microbatches=microbatches),
                mesh=MeshSpec(data=data, fsdp=fsdp, tensor=tensor, stage=stage),
                schedule=ScheduleSpec(name=schedule, virtual_stages=virtual), zero=zero, remat=remat,
                precision=precision, name="test", runtime=RuntimeSpec(recompute=recompute))


def _assert_ok(result: VerifyResult) -> None:
    tol, errors = result["thresholds"], result["errors"]
    assert max(errors["loss_rel"]) <= tol["loss"], errors
    assert max(errors["grad_rel"]) <= tol["grads"], errors
    assert errors["param_steps"] <= tol["param_steps"], errors
    assert result["ok"], result


@st.composite
def plans(draw) -> Plan:
    """A plan over all 8 devices: data x fsdp x tensor x stage = 8."""
    tensor = draw(st.sampled_from([1, 2, 4]))
    stage = draw(st.sampled_from([s for s in (1, 2, 4) if tensor * s <= 8]))
    rest = 8 // (tensor * stage)
    data = draw(st.sampled_from([d for d in (1, 2, 4, 8) if rest % d == 0]))
    fsdp = rest // data
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"])) if stage > 1 else "1f1b"
    virtual = 2 if schedule == "interleaved" and stage == 2 else 1
    if schedule == "interleaved" and virtual == 1:
        schedule = "1f1b"
    microbatches = draw(st.sampled_from([stage, 2 * stage])) if stage > 1 else draw(st.sampled_from([1, 2]))
    remat = draw(st.sampled_from(["none", "selective", "full"]))
    # MaxText's remat_policy minimal (runtime.recompute save-dots; save-dots-flash: and the flash residuals); under
    # full remat save-flash keeps the flash residuals alone.
    policies = {"selective": ["runner", "save-dots", "save-dots-flash"], "full": ["runner", "save-flash"]}
    recompute = draw(st.sampled_from(policies.get(remat, ["runner"])))
    return _plan(data=data, fsdp=fsdp, tensor=tensor, stage=stage, microbatches=microbatches, schedule=schedule,
                 virtual=virtual, zero=draw(st.integers(0, 3)), remat=remat,
                 precision=draw(st.sampled_from(["fp32", "fp32", "bf16-mixed"])), recompute=recompute)


@settings(max_examples=max(1, settings().max_examples // 15))  # two trainers each: ci 1, thorough 20
@given(plans())
def test_random_plans_on_8_devices_match_reference(plan: Plan) -> None:
    _assert_ok(verify_plan(plan, dev.select_devices(8), steps=2, check_hlo=False))


#: The fixed plans' model: two layers (one a stage at stage 2) hold every property they check, and each compile
#: is about a third cheaper than at the drawn plans' four.
PAIR = replace(MODEL, layers=2)


@pytest.mark.parametrize("degrees", [
    dict(),                                   # 1 device: the runner's path equals the reference exactly
    dict(data=2, microbatches=2, precision="bf16-mixed"),
    dict(data=3),
    dict(fsdp=2, tensor=2, zero=3),
    dict(data=3, stage=2, microbatches=2),    # 6 devices
    dict(fsdp=2, tensor=2, remat="selective", recompute="save-dots", precision="bf16-mixed"),
    dict(stage=2, microbatches=2, remat="selective", recompute="save-dots-flash",
         model=replace(PAIR, attention="flash", attention_block=4)),
    dict(fsdp=2, remat="full", recompute="save-flash", precision="bf16-mixed",
         model=replace(PAIR, attention="flash", attention_block=4)),
], ids=["1", "2", "3", "4", "6", "4-save-dots", "2-stages-save-dots-flash", "2-save-flash"])
def test_device_counts(degrees: dict) -> None:
    plan = _plan(**{"model": PAIR, **degrees})
    n = plan.mesh.size
    check_hlo = n == 4
    result = verify_plan(plan, dev.select_devices(n), steps=2, check_hlo=check_hlo)
    _assert_ok(result)
    if check_hlo:  # the compiled program holds the FSDP/ZeRO-3 gathers and the Megatron all-reduces
        found = result["collectives"]["found"]
        assert result["collectives"]["expected"] == ["fsdp: all-gather", "tensor: all-reduce"]
        assert found["all-reduce"] > 0 and found["all-gather"] > 0


@pytest.mark.quick  # make test-quick's test of this module
def test_hlo_counting_and_expectations() -> None:
    text = ("  %ar = f32[4]{0} all-reduce(f32[4]{0} %x), replica_groups={{0,1}}\n"
            "  %ags = (f32[2], f32[4]) all-gather-start(f32[2] %y)\n"
            "  %agd = f32[4] all-gather-done((f32[2], f32[4]) %ags)\n"
            "  %cp = f32[4] collective-permute(f32[4] %z), source_target_pairs={{0,1}}\n")
    counts = count_collectives([text])
    assert counts == {"all-reduce": 1, "reduce-scatter": 0, "all-gather": 1, "collective-permute": 1,
                      "all-to-all": 0}
    plan = _plan(data=2, fsdp=2, tensor=2)
    assert expected_collectives(plan) == ["data: all-reduce|reduce-scatter", "fsdp: all-gather", "tensor: all-reduce"]
    assert check_collectives(plan, [text])["ok"]
    missing = check_collectives(_plan(stage=2, microbatches=2), [text.replace("collective-permute", "add")])
    assert not missing["ok"] and missing["missing"] == ["stage: collective-permute|cross-mesh-transfer"]


def test_mesh_follows_placement() -> None:
    plan = _plan(data=2, tensor=2, stage=2, microbatches=2)
    devices = dev.select_devices(8)
    placement = dev.plan_placement(plan, devices)
    mesh = dev.build_mesh(placement, devices)
    assert mesh.axis_names == ("stage", "data", "fsdp", "expert", "context", "tensor")
    assert [[d.id for d in row.ravel()] for row in mesh.devices] == [
        [devices[i].id for i in placement.stage_devices(s)] for s in range(2)]
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_device_errors_name_the_field() -> None:
    plan = _plan(data=2)
    jax.devices()  # JAX started, with conftest's 8 devices, whichever test this worker ran first
    with pytest.raises(InputError) as bad:
        dev.parse_devices("gpu:3", plan.mesh.size)
    assert bad.value.field == "--devices"
    assert dev.parse_devices(None, plan.mesh.size) == dev.DeviceRequest(kind="emulated", count=2)
    with pytest.raises(InputError) as started:
        dev.prepare(dev.DeviceRequest(kind="emulated", count=4))  # conftest started JAX with 8
    assert started.value.field == "--devices" and "already started" in started.value.message
    with pytest.raises(InputError) as too_many:
        dev.select_devices(16)
    assert too_many.value.field == "mesh"


def test_run_and_verify_return_measured_reports_of_the_median_step() -> None:
    """The simulator's Report type with source `measured`: the median step, unknown parts None."""
    plan = _plan(data=2)
    devices = dev.select_devices(2)
    run = run_plan(plan, devices, steps=3, compiled_memory=True, peak_flops=1e12)
    assert isinstance(run, RunResult) and run.report.source == "measured"
    assert run.report.step_time_s == statistics.median(run.step_times_s) == run.to_dict()["median_step_time_s"]
    assert run.report.compute_s is None and run.report.bubble_fraction is None
    assert run.report.mfu > 0 and run.report.memory_total > 0 and run.report.devices == 2
    assert len(run.step_starts_s) == 3 and run.step_starts_s[0] == 0.0
    assert [s.label for s in run.timeline.spans(1)] == ["step 1", "step 2", "step 3"]
    verified = verify_plan(plan, devices, steps=3, check_hlo=False)
    _assert_ok(verified)
    assert verified.report.source == "measured" and len(verified.step_times_s) == 2  # step 0 compiles
    assert verified.report.step_time_s == statistics.median(verified.step_times_s)
