"""A device held below its rated power: ``device.power_limit`` on its ``power_curve`` slows its math and nothing else.

The curve maps board watts to the fraction of the listed peak FLOP/s the device sustains (testbed.topology.parts
DeviceSpec); the simulator prices matmuls at that rate (testbed.sim.price.compute), memory passes at the unchanged HBM
bandwidth, and a device without a limit prices exactly as before.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from testbed.cli import main
from testbed.errors import InputError
from testbed.explore.analytic import estimate
from testbed.model.gemm import Gemm
from testbed.plan.io import plan_from_dict
from testbed.sim.price.compute import gemm_seconds, pass_seconds
from testbed.sim.graph.engine import simulate
from testbed.sim.graph.program import build_program
from testbed.plan.placement import place
from testbed.topology.io import load_topology, topology_from_dict, topology_to_dict

CURVE = ((400.0, 0.8443), (700.0, 1.0))  # H100 NVL's and SXM's rated points (benchmarks/published/runs.yaml)


def _limited(watts: float, name: str = "dgx-h100"):
    topology = load_topology(name)
    return replace(topology, device=replace(topology.device, power_limit=watts, power_curve=CURVE))


def _plan():
    return plan_from_dict({"name": "p", "model": {"layers": 4, "d_model": 1024, "heads": 16, "d_ff": 4096,
                                                  "seq_len": 1024, "vocab": 32000, "attention": "flash"},
                           "batch": {"global_batch": 16, "microbatches": 2}, "mesh": {"fsdp": 8},
                           "precision": "bf16-mixed"}, default_name="p")


def test_the_clock_fraction_interpolates_the_curve_in_watts():
    assert _limited(700).device.clock_fraction() == 1.0
    assert _limited(400).device.clock_fraction() == pytest.approx(0.8443)
    assert _limited(500).device.clock_fraction() == pytest.approx(0.8443 + 0.1557 / 3)
    assert load_topology("dgx-h100").device.clock_fraction() == 1.0
    device = _limited(500).device
    assert device.sustained_flops("bf16") == pytest.approx(device.flops("bf16") * device.clock_fraction())
    assert device.flops("bf16") == load_topology("dgx-h100").device.flops("bf16")  # the datasheet peak stays


def test_a_lower_limit_slows_matmuls_by_the_fraction_and_leaves_memory_passes():
    big = Gemm(8192, 8192, 8192)
    rated, held = load_topology("dgx-h100"), _limited(500)
    latency = rated.calibration.compute.gemm_latency_s
    assert (gemm_seconds(held, "bf16", big) - latency) == pytest.approx(
        (gemm_seconds(rated, "bf16", big) - latency) / held.device.clock_fraction())
    assert pass_seconds(held, 1e9) == pass_seconds(rated, 1e9)
    steps = [simulate(_plan(), _limited(w)).report.step_time_s for w in (400, 500, 600, 700)]
    assert steps == sorted(steps, reverse=True) and steps[0] > steps[-1]
    analytic = [estimate(_plan(), _limited(w)).step_time_s for w in (400, 700)]
    assert analytic[0] > analytic[1]


def test_no_limit_and_the_rated_power_leave_the_task_graph_and_the_step_unchanged():
    rated = load_topology("dgx-h100")
    at_rated = _limited(700)
    curve_only = replace(rated, device=replace(rated.device, power_curve=CURVE))
    base = simulate(_plan(), rated)
    for topology in (at_rated, curve_only):
        assert build_program(_plan(), place(_plan(), topology)).tasks == base.program.tasks
        assert simulate(_plan(), topology).report.step_time_s == base.report.step_time_s


def test_power_fields_round_trip_through_yaml():
    held = _limited(500)
    again = topology_from_dict(topology_to_dict(held))
    assert again.device == held.device and again.device.clock_fraction() == held.device.clock_fraction()


def _device_yaml(**power) -> dict:
    data = topology_to_dict(load_topology("dgx-h100"))
    data["device"].update(power)
    return data


@pytest.mark.parametrize("power,field,message", [
    ({"power_limit": 500}, "device.power_limit", "needs the device's power_curve"),
    ({"power_limit": 300, "power_curve": [[400, 0.84], [700, 1.0]]}, "device.power_limit", "outside"),
    ({"power_limit": "hot", "power_curve": [[400, 0.84], [700, 1.0]]}, "device.power_limit", "expected watts"),
    ({"power_limit": -5, "power_curve": [[400, 0.84], [700, 1.0]]}, "device.power_limit", "must be watts"),
    ({"power_curve": [[700, 1.0], [400, 0.84]]}, "device.power_curve", "watts increasing"),
    ({"power_curve": [[400, 0.0], [700, 1.0]]}, "device.power_curve", "fractions"),
    ({"power_curve": [[400, "most"]]}, "device.power_curve", "fraction"),
    ({"power_curve": [400, 700]}, "device.power_curve", "pairs"),
])
def test_bad_power_fields_name_the_field(power, field, message):
    with pytest.raises(InputError) as info:
        topology_from_dict(_device_yaml(**power))
    assert info.value.field == field and message in info.value.message


def test_a_bad_power_limit_in_a_topology_file_exits_2_naming_the_field(tmp_path: Path, capsys):
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(_device_yaml(power_limit="500W")))
    assert main(["topology", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert "device.power_limit" in err and "Traceback" not in err
    path.write_text(yaml.safe_dump(_device_yaml(power_limit="500W", power_curve=[["400W", 0.8443], ["700W", 1.0]])))
    assert main(["topology", "show", str(path)]) == 0


def test_a_calibrated_topology_does_not_apply_the_limit_twice():
    """``calibrate`` measures the rates a device sustains as it runs (its power limit included): the fitted topology
    prices those rates, without the limit's fraction on top."""
    from testbed.calibration.calibrated import calibrated_topology

    held = _limited(500)
    rate = 0.5 * held.device.flops("bf16")
    fitted = calibrated_topology(held, rates={"bf16": rate}, half_flops=0.0, memory_bandwidth=1e12, launch_s=0.0,
                                 host_cores=0.0, collectives=None)
    assert fitted.device.clock_fraction() == 1.0
    assert fitted.device.sustained_flops("bf16") * fitted.calibration.compute.efficiency == pytest.approx(rate)
