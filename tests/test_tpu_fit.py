"""The TPU compute calibration's category fit (benchmarks/published/tpu_fit.py) and what runs.yaml ships."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

PUBLISHED = Path(__file__).resolve().parents[1] / "benchmarks" / "published"
sys.path.insert(0, str(PUBLISHED))

import runs  # noqa: E402
import tpu_fit  # noqa: E402

from testbed.sim.graph.engine import simulate  # noqa: E402


def _row(matmul: float, passes: float, other: float, efficiency: float, elementwise: float,
         device: str = "TPU-a") -> dict:
    """A decomposed case whose published step time is exactly the model's at (efficiency, elementwise)."""
    return {"case": f"{device}-{matmul}", "device": device, "matmul_s": matmul, "pass_s": passes, "other_s": other,
            "published_s": matmul / efficiency + elementwise * passes + other}


def test_fit_recovers_the_values_that_made_the_data():
    rows = [_row(m, x, c, 0.62, 2.3) for m, x, c in ((10, 1, 0.1), (5, 2, 0.0), (20, 0.5, 1.0), (3, 1.5, 0.2))]
    assert tpu_fit.fit(rows) == (0.62, 2.3)  # the shared alternative fits passes too
    assert max(abs(e) for e in tpu_fit.leave_one_out(rows)) < 1e-9


def test_error_moves_the_right_way():
    row = _row(10, 1, 0.0, 0.7, 2.0)
    assert tpu_fit.error(row, 0.7, 2.0) == pytest.approx(0.0)
    assert tpu_fit.error(row, 0.8, 2.0) > 0 > tpu_fit.error(row, 0.6, 2.0)  # faster matmuls: more tokens/s
    assert tpu_fit.error(row, 0.7, 1.0) > 0 > tpu_fit.error(row, 0.7, 3.0)  # more passes: fewer


def test_leave_one_out_sees_a_row_the_others_do_not_explain():
    rows = [_row(m, x, 0.0, 0.7, 2.0) for m, x in ((10, 1), (5, 2), (20, 0.5), (3, 1.5), (8, 1))]
    rows[0]["published_s"] *= 1.2  # this run was 20% slower than the others' values say
    errors = tpu_fit.leave_one_out(rows)
    assert errors[0] == pytest.approx(0.2, abs=0.01)  # predicted 20% fast: the others still fit (0.7, 2.0)


def test_runs_yaml_ships_one_calibration_per_tpu_generation_and_it_moves_the_step():
    cases, inline = runs.load_cases()
    shipped = tpu_fit.shipped(inline)
    generations = {inline[name].device.name for names in shipped.values() for name in names}
    assert len(shipped) == len(generations) == 4, shipped  # one value per generation (v4, v5e, v5p, v6e): none per slice or case
    for names in shipped.values():
        assert len({inline[n].device.name for n in names}) == 1
    case = next(c for c in cases if c["name"] == "maxtext-llama31-8b-v6e-8chip")
    plan, topology = runs.case_plan(case), runs.case_topology(case, inline)
    cal = topology.calibration
    shipped_s = simulate(plan, topology).report.step_time_s
    faster = simulate(plan, tpu_fit.calibrated(topology, cal.compute.efficiency + 0.1, 0.0)).report.step_time_s
    assert faster < shipped_s


def test_per_device_fit_recovers_two_generations_and_the_shared_fit_cannot():
    shape = ((10, 1, 0.1), (5, 2, 0.0), (20, 0.5, 1.0), (3, 1.5, 0.2))
    rows = [_row(m, x, c, 0.6, 0.0, "TPU-a") for m, x, c in shape]
    rows += [_row(m, x, c, 0.8, 0.0, "TPU-b") for m, x, c in shape]
    assert tpu_fit.fit_per_device(rows) == ({"TPU-a": 0.6, "TPU-b": 0.8}, tpu_fit.PER_DEVICE_PASSES)
    report = tpu_fit.per_device_report(rows, shared=0.7)
    assert report["leave_one_out"]["max_abs_error"] < 1e-4 and report["sum_squared_error"] < 1e-8
    shared = tpu_fit.fit(rows)
    assert sum(abs(tpu_fit.error(r, *shared)) for r in rows) > 0.5  # one value cannot fit both generations
    with_passes = [_row(m, x, c, 0.6, 2.0, "TPU-a") for m, x, c in shape]  # the per-generation fit's passes are 0:
    assert tpu_fit.fit_per_device(with_passes, passes=2.0) == ({"TPU-a": 0.6}, 2.0)  # stated, not fitted


def test_least_squares_spreads_the_error_where_least_absolute_error_interpolates_a_row():
    """Three rows wanting different efficiencies: least absolute error would fit one of them exactly (an
    in-sample error of 0 that leave-one-out does not keep); least squares leaves each some error."""
    rows = [_row(10, 0, 0, e, 0.0, "TPU-a") for e in (0.7, 0.8, 0.9)]
    efficiencies, _ = tpu_fit.fit_per_device(rows)
    assert 0.7 < efficiencies["TPU-a"] < 0.9
    assert min(abs(tpu_fit.error(r, efficiencies["TPU-a"], 0.0)) for r in rows) > 0.005


def test_per_device_leave_one_out_falls_back_to_the_shared_value_for_a_lone_device():
    rows = [_row(m, x, 0.0, 0.7, 0.0) for m, x in ((10, 1), (5, 2), (20, 0.5))] + [_row(8, 1, 0.0, 0.9, 0.0, "TPU-z")]
    report = tpu_fit.per_device_report(rows, shared=0.7)
    assert report["rows"][-1]["in_sample"] == pytest.approx(0.0, abs=1e-9)  # its own value fits it exactly
    assert report["rows"][-1]["leave_one_out"] < -0.15  # left out, it takes 0.7: predicted slow, as it is


def test_stale_names_each_topology_whose_calibration_is_not_the_fit():
    cases, inline = runs.load_cases()
    cases = [c for c in cases if tpu_fit.in_category(c)]
    shipped = {c["device"]: inline[c["topology"]].calibration.compute.efficiency for c in cases}
    fitted = {"efficiency": dict(shipped), "elementwise_passes": 0.0}
    assert tpu_fit.stale(cases, inline, fitted) == {}
    fitted["efficiency"]["TPU-v5p"] += 0.05
    moved = tpu_fit.stale(cases, inline, fitted)
    assert moved and all(inline[name].device.name.startswith("TPU") for name in moved)
    assert {c["topology"] for c in cases if c["device"] == "TPU-v5p"} == set(moved)
