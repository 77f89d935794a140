"""Bounds before work (issue 40): extreme values are refused with their stated range, before anything runs."""

from __future__ import annotations

import copy
import importlib.util
import sys
import time
from pathlib import Path

import pytest
import yaml

from testbed.cli.main import main
from testbed.errors import InputError
from testbed.fields import load_yaml
from testbed.topology.io import load_topology, topology_from_dict, topology_to_dict

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fuzz_inputs", ROOT / "benchmarks" / "fuzz_inputs.py")
fuzz = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("fuzz_inputs", fuzz)
_spec.loader.exec_module(fuzz)

MOE = {"name": "moe", "model": {"layers": 2, "d_model": 32, "heads": 4, "d_ff": 64, "seq_len": 16, "vocab": 128,
                                "experts": 4, "top_k": 2, "capacity_factor": 1.25},
       "batch": {"global_batch": 8, "microbatches": 1}, "mesh": {"data": 8}}


def _err(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("value", [1e308, float("inf"), 1001, 0, -1])
def test_capacity_factor_has_a_finite_range(value, tmp_path, capsys):
    plan = copy.deepcopy(MOE)
    plan["model"]["capacity_factor"] = value
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(plan))
    code, err = _err(["simulate", "--plan", str(tmp_path / "p.yaml"), "--topology", "host-cpu-8"], capsys)
    assert code == 2 and "model.capacity_factor" in err and "Traceback" not in err, err
    if value in (1e308, 1001):  # finite and positive: the range is what refuses it
        assert "(0, 1000]" in err, err


@pytest.mark.parametrize("group, name, value, words", [
    ("elementwise", "split_passes", 1e308, "at most 1000 passes"),
    ("elementwise", "cache_bytes", 1e300, "at most 1e+21"),
    ("compute", "launch_overhead_s", 1e308, "at most 3600 seconds"),
    ("controller", "step_s", 1e9, "at most 3600 seconds"),
])
def test_calibration_values_have_finite_ranges(group, name, value, words):
    data = topology_to_dict(load_topology("a100-pcie-8"))
    data.setdefault("calibration", {}).setdefault(group, {})[name] = value
    with pytest.raises(InputError) as bad:
        topology_from_dict(data)
    assert bad.value.field.endswith(f"{group}.{name}") and words in bad.value.message


@pytest.mark.parametrize("price", [1e-300, float("inf"), float("nan"), 1e7, 0])
def test_prices_are_finite_and_in_range(price):
    data = topology_to_dict(load_topology("a100-pcie-8"))
    data["price_per_device_hour"] = price
    with pytest.raises(InputError) as bad:
        topology_from_dict(data)
    assert bad.value.field == "price_per_device_hour"
    if price in (1e-300, 1e7):  # finite and positive: the range is what refuses it
        assert "from 1e-06 to 1e+06" in bad.value.message


@pytest.mark.parametrize("price", ["1e-300", "inf", "1e7"])
def test_search_price_is_checked(price, capsys):
    code, err = _err(["search", "--model", "gpt-tiny", "--topology", "host-cpu-8", "--objective", "cost",
                      "--price", price], capsys)
    assert code == 2 and "field `--price`" in err and "from 1e-06 to 1e+06" in err, err


def test_search_devices_beyond_the_limit_are_refused_at_once(capsys):
    start = time.monotonic()
    code, err = _err(["search", "--model", "gpt-tiny", "--topology", "dgx-h100", "--devices", "8589934592"], capsys)
    assert code == 2 and "field `--devices`" in err and "1,048,576" in err, err
    assert time.monotonic() - start < 30  # it built nothing (building that space would exhaust memory)


@pytest.mark.parametrize("size", ["1e30", "1e20"])
def test_collective_execute_sizes_beyond_host_memory_are_refused_before_jax(size, capsys):
    with fuzz.jax_trapped():
        code, err = _err(["collective", "all-reduce", "--topology", "host-cpu-8", "--execute", "emulated:8",
                          "--bytes", size], capsys)
    assert code == 2 and "field `bytes`" in err and "host memory" in err, err


def test_a_plain_large_yaml_is_not_called_an_alias_bomb(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("values:\n" + "".join(f"- {i}\n" for i in range(120_000)))  # yaml.safe_dump's text, 60x sooner
    with pytest.raises(InputError) as plain:
        load_yaml(big)
    assert "aliases" not in plain.value.message and "more than 100,000 values" in plain.value.message
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("a: &a [1,2,3,4,5,6,7,8,9,10]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
                    "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
                    "e: [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\n")
    with pytest.raises(InputError) as aliased:
        load_yaml(bomb)
    assert "aliases repeated inside aliases" in aliased.value.message


def test_search_space_beyond_the_plan_limits_is_not_enumerated():
    """A layout whose pipeline needs more actions than the limit is no candidate (it would not fit in memory)."""
    from testbed.explore.search import _within_limits
    from testbed.explore.space import SearchSpace, candidates, preset_plan
    from testbed.plan.limits import MAX_PIPELINE_ACTIONS

    base = preset_plan("gpt-tiny", global_batch=1 << 17)
    space = SearchSpace(microbatches=(1 << 16,), schedules=("1f1b",))
    plans = list(candidates(base, 8, space))
    assert plans and all(_within_limits(p) for p in plans)  # the space enumerates none past the limit
    assert not [p for p in plans if p.mesh.stage * p.batch.microbatches * 3 > MAX_PIPELINE_ACTIONS]
    assert any(p.mesh.stage == 1 for p in plans)  # the unpipelined layouts of that microbatch count remain


@pytest.mark.parametrize("path, value, field", [
    (("levels", 0, "bandwidth"), 1e-307, "level node.bandwidth"),
    (("levels", 0, "latency"), 1e308, "level node.latency"),
    (("device", "memory_bandwidth"), 1e-307, "device.memory_bandwidth"),
    (("device", "flops", "fp32"), 1e-307, "device.flops.fp32"),
    (("device", "flops", "fp32"), 1e300, "device.flops.fp32"),
    (("device", "memory"), 1e300, "device.memory"),
])
def test_topology_rates_and_times_have_stated_ranges(path, value, field):
    """Such values are refused when read; unchecked, they divide by zero inside the simulator (a traceback from
    `simulate`)."""
    data = topology_to_dict(load_topology("host-cpu-8"))
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(InputError) as bad:
        topology_from_dict(data)
    assert field in bad.value.render() and " to " in bad.value.message, bad.value.render()


def test_check_sharding_refuses_a_plan_of_too_many_programs_before_jax(tmp_path, capsys):
    plan = {"name": "deep", "model": {"layers": 256, "d_model": 32, "heads": 4, "d_ff": 64, "seq_len": 16,
                                      "vocab": 128},
            "batch": {"global_batch": 8, "microbatches": 8}, "mesh": {"stage": 8},
            "schedule": {"name": "interleaved", "virtual_stages": 32}}
    (tmp_path / "deep.yaml").write_text(yaml.safe_dump(plan))
    with fuzz.jax_trapped():
        code, err = _err(["check-sharding", "--plan", str(tmp_path / "deep.yaml"), "--topology", "host-cpu-8"], capsys)
    assert code == 2 and "field `schedule.virtual_stages`" in err and "programs" in err, err


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"])
def test_peak_counts_equal_the_held_sets(name):
    """The linear peak count is the longest held list of held_during (which is quadratic in microbatches)."""
    from testbed.pipeline.schedules import (build_schedule, held_during, peak_deferred_weight_grads,
                                            peak_inflight)

    schedule = build_schedule(name, 4, 8, virtual=2 if name == "interleaved" else 1)
    for release in ("B", "W"):
        want = tuple(max((len(h) for h in held_during(row, "F", release if schedule.split_backward else "B")),
                         default=0) for row in schedule.actions)
        assert peak_inflight(schedule, release) == want
    assert peak_deferred_weight_grads(schedule) == tuple(
        max((len(h) for h in held_during(row, "B", "W")), default=0) if schedule.split_backward else 0
        for row in schedule.actions)
