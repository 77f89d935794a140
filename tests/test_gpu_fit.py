"""``device.sustained`` and its category fit over the published GPU steps (benchmarks/published/gpu_fit.py).

The field multiplies every matmul's rate and nothing else (testbed.topology.parts.DeviceSpec); the fit finds one
value per GPU generation by least absolute error with its leave-one-out error, and the shipped topologies must
carry what the fit finds.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from testbed.calibration.calibrated import calibrated_topology
from testbed.cli import main
from testbed.errors import InputError
from testbed.explore.analytic import estimate
from testbed.model.gemm import Gemm
from testbed.plan.io import plan_from_dict
from testbed.plan.placement import place
from testbed.sim.price.compute import gemm_seconds, pass_seconds
from testbed.sim.graph.engine import simulate
from testbed.sim.graph.program import build_program
from testbed.topology.io import load_topology, topology_from_dict, topology_to_dict

PUBLISHED = Path(__file__).resolve().parents[1] / "benchmarks" / "published"
sys.path.insert(0, str(PUBLISHED))

import gpu_fit  # noqa: E402
import runs  # noqa: E402


def _held(x: float, name: str = "dgx-h100"):
    return gpu_fit.held(load_topology(name), x)


def _plan():
    return plan_from_dict({"name": "p", "model": {"layers": 4, "d_model": 1024, "heads": 16, "d_ff": 4096,
                                                  "seq_len": 1024, "vocab": 32000, "attention": "flash"},
                           "batch": {"global_batch": 16, "microbatches": 2}, "mesh": {"fsdp": 8},
                           "precision": "bf16-mixed"}, default_name="p")


def test_sustained_slows_every_matmul_by_its_fraction_and_leaves_memory_passes():
    full, held = load_topology("dgx-h100"), _held(0.8)
    latency = full.calibration.compute.gemm_latency_s
    for gemm, dtype in ((Gemm(8192, 8192, 8192), "bf16"), (Gemm(512, 256, 128), "bf16"),
                        (Gemm(8192, 8192, 8192), "fp8"), (Gemm(4096, 4096, 128, flash=True), "bf16")):
        assert gemm_seconds(held, dtype, gemm, casts=False) - latency == pytest.approx(
            (gemm_seconds(full, dtype, gemm, casts=False) - latency) / 0.8), (gemm, dtype)
    assert pass_seconds(held, 1e9) == pass_seconds(full, 1e9)
    steps = [simulate(_plan(), _held(x)).report.step_time_s for x in (0.6, 0.8, 1.0)]
    assert steps == sorted(steps, reverse=True) and steps[0] > steps[-1]
    assert estimate(_plan(), _held(0.6)).step_time_s > estimate(_plan(), _held(1.0)).step_time_s


def test_sustained_multiplies_a_power_limit_s_fraction():
    curve = ((400.0, 0.8443), (700.0, 1.0))
    base = load_topology("dgx-h100")
    limited = replace(base, device=replace(base.device, power_limit=500.0, power_curve=curve, sustained=0.9))
    device = limited.device
    assert device.sustained_flops("bf16") == pytest.approx(device.flops("bf16") * device.clock_fraction() * 0.9)


def test_sustained_one_leaves_the_task_graph_and_the_step_unchanged():
    base = load_topology("dgx-h100")
    one = _held(1.0)
    assert one.device == base.device
    reference = simulate(_plan(), base)
    assert build_program(_plan(), place(_plan(), one)).tasks == reference.program.tasks
    assert simulate(_plan(), one).report.step_time_s == reference.report.step_time_s


def test_sustained_round_trips_through_yaml_and_calibrate_drops_it():
    held = _held(0.85)
    assert topology_from_dict(topology_to_dict(held)).device == held.device
    assert "sustained" not in topology_to_dict(load_topology("dgx-h100"))["device"]
    rate = 0.5 * held.device.flops("bf16")
    fitted = calibrated_topology(held, rates={"bf16": rate}, half_flops=0.0, memory_bandwidth=1e12, launch_s=0.0,
                                 host_cores=0.0, collectives=None)
    assert fitted.device.sustained == 1.0  # the measured rates already hold what the device sustained
    assert fitted.device.sustained_flops("bf16") * fitted.calibration.compute.efficiency == pytest.approx(rate)


def _device_yaml(**fields) -> dict:
    data = topology_to_dict(load_topology("dgx-h100"))
    data["device"].update(fields)
    return data


@pytest.mark.parametrize("value", [0, -0.5, 1.2, True, "most"])
def test_a_bad_sustained_names_the_field(value, tmp_path: Path, capsys):
    with pytest.raises(InputError) as info:
        topology_from_dict(_device_yaml(sustained=value))
    assert info.value.field == "device.sustained" and "fraction" in info.value.message
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(_device_yaml(sustained=value)))
    assert main(["topology", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert "device.sustained" in err and "Traceback" not in err


def _row(math: float, other: float, sustained: float, category: str = "c") -> dict:
    """A decomposed case whose published step is exactly the model's at ``sustained``."""
    return {"case": f"{category}-{math}", "category": category, "generation": "X", "math_s": math,
            "other_s": other, "published_s": other + math / sustained}


def test_the_fit_recovers_the_value_that_made_the_data_and_leave_one_out_is_then_exact():
    rows = [_row(m, o, 0.83) for m, o in ((10, 1), (5, 0), (20, 3), (3, 0.5))]
    assert gpu_fit.fit(rows) == 0.83
    assert max(abs(e) for e in gpu_fit.leave_one_out(rows)) < 1e-9
    assert gpu_fit.error(rows[0], 0.9) > 0 > gpu_fit.error(rows[0], 0.75)  # faster math: a higher predicted rate


def test_leave_one_out_sees_a_row_the_others_do_not_explain():
    rows = [_row(m, o, 0.8) for m, o in ((10, 1), (5, 0), (20, 3), (3, 0.5), (8, 1))]
    rows[0]["published_s"] *= 1.25  # this run was 25% slower than the others' value says
    report = gpu_fit.generation_report(rows)
    assert report["fitted"] < 0.8  # least squares leans toward the slow run
    assert report["rows"][0]["leave_one_out"] == pytest.approx(0.25)  # predicted 25% fast: the others hold 0.8
    assert report["leave_one_out"]["max_abs_error"] == pytest.approx(0.25)
    assert 0 < report["rows"][0]["in_sample"] < 0.25


def test_every_gpu_topology_of_the_published_cases_carries_one_value_per_generation():
    """Each generation's topologies (bundled and runs.yaml's) ship one ``device.sustained`` (never per case)."""
    cases, inline = runs.load_cases()
    names = {c["topology"] for c in cases} | {"dgx-a100-superpod"}
    values: dict[str, set[float]] = {}
    for name in names:
        topology = inline[name] if name in inline else load_topology(name)
        if gpu_fit.generation(topology):
            values.setdefault(gpu_fit.generation(topology), set()).add(topology.device.sustained)
    assert set(values) == set(gpu_fit.GENERATIONS)
    assert all(len(v) == 1 for v in values.values()), values


def test_stale_names_each_topology_whose_shipped_value_is_not_its_generation_s_fit():
    rows = [{"topology": "dgx-a100-superpod"}, {"topology": "dgx-h100-superpod"}]
    ships = gpu_fit.shipped(rows)
    a100 = float(next(iter(ships["A100"])))
    h100 = float(next(iter(ships["H100"])))
    assert gpu_fit.stale(ships, {"A100": a100, "H100": h100}) == {}
    assert gpu_fit.stale(ships, {"A100": a100, "H100": h100 - 0.05}) == {
        "dgx-h100-superpod": {"shipped": h100, "fitted": h100 - 0.05}}


def test_a_case_splits_into_math_and_the_rest_named_by_its_base_topology():
    """The split reproduces the simulated step at sustained 1 and (within the linear model) at the probe, and names
    the topology the case resizes, which :func:`gpu_fit.shipped` loads."""
    from testbed.explore.space import resize_topology

    topology = resize_topology(load_topology("dgx-h100-superpod"), 8)
    at_one = simulate(_plan(), gpu_fit.held(topology, 1.0)).report.step_time_s
    row = gpu_fit._split("p", "runs x", _plan(), topology, published_s=at_one, base="dgx-h100-superpod",
                         origin=("x", "https://example.org/table"))
    assert row["topology"] == "dgx-h100-superpod" and row["generation"] == "H100" and row["stack"] == "x"
    assert row["math_s"] > 0 and row["other_s"] >= 0
    assert gpu_fit.error(row, 1.0) == pytest.approx(0.0, abs=1e-9)
    assert gpu_fit.shipped([row])["H100"]


def test_fits_gives_one_entry_per_generation_with_its_own_stale_topologies():
    rows = [_row(m, o, 0.8) for m, o in ((10, 1), (5, 0), (20, 3))]
    report = {"parameter": "device.sustained", "generations": {"A100": gpu_fit.generation_report(rows),
                                                               "H100": gpu_fit.generation_report(rows)},
              "shipped": {"A100": {"0.8": ["a"]}, "H100": {"0.9": ["h"]}},
              "stale": {"h": {"shipped": 0.9, "fitted": 0.8}}, "shared_alternative": {}}
    out = gpu_fit.fits(report)
    assert set(out) == {"gpu_compute_A100", "gpu_compute_H100"}
    assert out["gpu_compute_A100"]["fitted"] == 0.8 and out["gpu_compute_A100"]["stale"] == {}
    assert out["gpu_compute_H100"]["stale"] == {"h": {"shipped": 0.9, "fitted": 0.8}}
    assert out["gpu_compute_A100"]["in_sample"]["cases"] == 3
