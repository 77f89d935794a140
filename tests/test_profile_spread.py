"""`testbed simulate` on a plan without ``runtime:``: the step time's band over the named runtime profiles
(testbed.sim.graph.profile_spread), in the text and as ``--json`` fields; a plan stating ``runtime:`` has none."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import yaml

from testbed.cli import main
from testbed.plan.io import load_plan
from testbed.plan.runtime import PROFILES, runtime_from_dict
from testbed.sim.graph.engine import simulate
from testbed.sim.graph.profile_spread import ProfileSpread, profile_spread
from testbed.topology.io import load_topology

PLAN = {"name": "band", "topology": "dgx-h100", "precision": "bf16-mixed", "remat": "full",
        "model": {"layers": 4, "d_model": 2048, "heads": 16, "d_ff": 8192, "seq_len": 2048, "vocab": 32000},
        "batch": {"global_batch": 16, "microbatches": 2}, "mesh": {"data": 2, "tensor": 4}}


def _write(tmp_path, plan: dict) -> str:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(plan))
    return str(path)


def test_the_spread_is_each_profile_s_own_simulation():
    plan, topology = load_plan("demo"), load_topology("host-cpu-8")
    spread = profile_spread(plan, topology)
    assert [name for name, _ in spread.steps] == list(PROFILES)
    megatron = simulate(replace(plan, runtime=runtime_from_dict("megatron")), topology).report.step_time_s
    assert dict(spread.steps)["megatron"] == pytest.approx(megatron)
    assert dict(spread.steps)["testbed"] == pytest.approx(simulate(plan, topology).report.step_time_s)
    assert spread.low_s <= dict(spread.steps)["testbed"] <= spread.high_s


def test_simulate_prints_the_band_and_json_carries_it_when_the_plan_states_no_runtime(tmp_path, capsys):
    path = _write(tmp_path, PLAN)
    assert main(["simulate", "--plan", path, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    band = data["runtime_spread"]
    assert set(band["profiles"]) == set(PROFILES)
    assert band["low_s"] < band["high_s"]  # recompute, overlap and fp32 reductions move this plan's step
    assert band["low_s"] <= data["step_time_s"] <= band["high_s"]
    assert main(["simulate", "--plan", path]) == 0
    assert "over runtime profiles)" in capsys.readouterr().out.splitlines()[1]


def test_a_plan_stating_runtime_gets_no_band(tmp_path, capsys):
    assert main(["simulate", "--plan", _write(tmp_path, {**PLAN, "runtime": "megatron"}), "--json"]) == 0
    assert "runtime_spread" not in json.loads(capsys.readouterr().out)
    assert main(["simulate", "--plan", _write(tmp_path, PLAN), "--json", "--no-profile-spread"]) == 0
    assert "runtime_spread" not in json.loads(capsys.readouterr().out)


def test_a_spread_needs_a_step():
    with pytest.raises(ValueError):
        ProfileSpread(())
    assert ProfileSpread((("a", 2.0), ("b", 1.0))).to_dict()["low_s"] == 1.0


def test_the_band_rounds_each_end_on_its_own() -> None:
    """The low end in the high end's unit, not scaled by the high end's rounding (110.5 ms read as 111 ms)."""
    from testbed.cli.simulate import _band

    assert _band({"low_s": 0.11046, "high_s": 0.11954}) == " (110-120 ms over runtime profiles)"
    assert _band({"low_s": 0.87, "high_s": 1.03}) == " (0.87-1.03 s over runtime profiles)"
