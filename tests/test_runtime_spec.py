"""The plan's ``runtime:`` section: profiles, overrides, round trip and bad input naming the field."""

import pytest
import yaml

from testbed.errors import InputError
from testbed.plan.io import load_plan, plan_from_dict, plan_to_dict
from testbed.plan.runtime import PROFILES, SOURCES, RuntimeSpec


def _plan_dict(runtime):
    d = plan_to_dict(load_plan("demo"))
    d["runtime"] = runtime
    return d


def test_default_is_the_runner_and_is_not_written():
    plan = load_plan("demo")
    assert plan.runtime == RuntimeSpec()
    assert "runtime" not in plan_to_dict(plan)


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_each_profile_round_trips(profile):
    plan = plan_from_dict(_plan_dict(profile))
    assert plan.runtime.profile == profile
    assert plan_from_dict(plan_to_dict(plan)).runtime == plan.runtime


def test_every_profile_value_cites_a_source():
    for profile, values in PROFILES.items():
        for key in values:
            assert SOURCES.get((profile, key)), f"{profile}.{key} has no source"


@pytest.mark.parametrize("runtime, field", [({"profile": "nope"}, "runtime.profile"), ({"bogus": 1}, "runtime.bogus"),
                                            (["megatron"], "runtime")])
def test_bad_runtime_names_the_field(runtime, field):
    with pytest.raises(InputError) as err:
        plan_from_dict(_plan_dict(runtime))
    assert field in str(err.value)


@pytest.mark.parametrize("runtime, field, valid", [
    ({"profile": "torchtitan", "attention_kernel": "flash9"}, "runtime.attention_kernel", "flash2"),
    ({"profile": "nemo", "fp8_scaling": "sometimes"}, "runtime.fp8_scaling", "current"),
    ({"profile": "xla", "moe_dispatch": 1}, "runtime.moe_dispatch", "")])
def test_a_bad_runtime_value_exits_2_naming_the_field(tmp_path, capsys, runtime, field, valid):
    """`testbed plan check` on a plan with a bad runtime value: exit 2, the field and a valid value named."""
    from testbed.cli.main import main

    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"model": {"layers": 4, "d_model": 64, "heads": 4, "d_ff": 256, "seq_len": 32,
                                              "vocab": 256, "attention": "flash"},
                                    "batch": {"global_batch": 16, "microbatches": 2}, "mesh": {"data": 8},
                                    "runtime": runtime}))
    code = main(["plan", "check", str(plan), "--topology", "host-cpu-8"])
    err = capsys.readouterr().err
    assert code == 2 and field in err and valid in err and "Traceback" not in err, err


def test_runner_differences_name_the_fields_the_runner_does_not_execute():
    from testbed.plan.runtime import runner_differences
    assert runner_differences(RuntimeSpec()) == ()
    # MaxText's scanned layer loop (memory only; the runner unrolls its layers) and XLA's padded uneven sequence
    # shards (the runner does not shard the sequence) are the xla profile's differences, and MaxText's dropless
    # grouped matmul over the routed tokens (the runner pads every expert's slots to the sequence).
    assert set(runner_differences(plan_from_dict(_plan_dict("xla")).runtime)) == {"scan_layers", "pad_sequence_shards",
                                                                                  "moe_padded_dropless"}
    nemo = plan_from_dict(_plan_dict("nemo")).runtime
    assert set(runner_differences(nemo)) == set(PROFILES["nemo"])
    # MaxText's remat_policy minimal (and minimal_with_context) is the runner's too (stage_forward's ``save_dots``).
    assert runner_differences(RuntimeSpec(recompute="save-dots")) == ()
    assert runner_differences(RuntimeSpec(recompute="save-dots-flash")) == ()
    assert runner_differences(RuntimeSpec(recompute="op")) == ("recompute",)


def test_the_runner_says_it_runs_its_own_behaviour():
    import jax

    from testbed.runner.train import _check_runnable
    plan = plan_from_dict({**_plan_dict({"profile": "fsdp"}), "precision": "fp32"})
    with pytest.warns(UserWarning, match="recompute"):
        _check_runnable(plan, jax.devices())


def test_every_published_case_runs_under_a_profile():
    """benchmarks/published/runs.py maps each case's stack to a profile (or the case states its runtime)."""
    import sys
    from pathlib import Path

    import yaml
    here = Path(__file__).resolve().parents[1] / "benchmarks" / "published"
    sys.path.insert(0, str(here))
    try:
        import runs
    finally:
        sys.path.remove(str(here))
    assert set(runs.STACK_PROFILES.values()) <= set(PROFILES)
    for case in yaml.safe_load((here / "runs.yaml").read_text())["cases"]:
        assert case["stack"] in runs.STACK_PROFILES or "runtime" in case["plan"], case["name"]


def test_verify_hands_the_runner_the_plan_as_given(monkeypatch):
    """verify_plan builds its trainer from the plan as given, so the runner's warning names every runtime field it
    does not run (shard_context too), and only then takes the runner's own plan for the reference and the expected
    collectives (testbed.runner.train.runner_plan)."""
    import jax

    import testbed.runner.train as train
    plan = plan_from_dict({**_plan_dict({"profile": "torchtitan"}), "precision": "fp32"})
    seen = []

    def stop(given, devices, return_grads=False):
        seen.append(given)
        raise RuntimeError("built")

    monkeypatch.setattr(train, "build_trainer", stop)
    with pytest.raises(RuntimeError, match="built"):
        train.verify_plan(plan, jax.devices())
    assert seen == [plan] and seen[0].runtime.shard_context


def test_the_runner_refuses_uneven_sequence_shards_it_cannot_split():
    """runtime.pad_sequence_shards is priced by the simulator; the runner's shard_map maps split evenly: exit 2."""
    import jax

    from testbed.errors import InputError
    from testbed.runner.train import _check_runnable
    spec = {**_plan_dict("xla"), "precision": "fp32", "sequence_parallel": True}
    spec["model"] = {**spec["model"], "seq_len": 33}  # over the demo's 2 tensor ranks
    plan = plan_from_dict(spec)
    assert plan.runtime.pad_sequence_shards and plan.model.seq_len % plan.mesh.tensor
    with pytest.raises(InputError, match="pad_sequence_shards") as info:
        _check_runnable(plan, jax.devices())
    assert info.value.field == "model.seq_len"
