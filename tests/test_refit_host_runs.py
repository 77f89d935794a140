"""benchmarks/refit_host_runs.py: the kept host runs refitted with the current code (no JAX)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "benchmarks" / "host_runs" / "2026-12-02" / "run-10"
_spec = importlib.util.spec_from_file_location("refit_host_runs", ROOT / "benchmarks" / "refit_host_runs.py")
refit_host_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(refit_host_runs)


def test_a_kept_run_refits_and_its_two_errors_agree():
    """Raw and at-the-calibrated-speed errors share the prediction: their ratio is the run's measured rescale
    (validate's per-round host speed) times the reference step's new-over-old prediction, plan by plan."""
    out = refit_host_runs.refit_run(RUN)
    recorded = {p["plan"]: p for p in json.loads((RUN / "validate_host.json").read_text())["plans"]}
    assert set(out["errors_raw"]) == set(recorded) == set(out["errors_at_calibrated_speed"])
    for plan, raw in out["errors_raw"].items():
        row = recorded[plan]
        ratio = row["measured_s"] / (row["diagnostics"]["measured_at_calibrated_speed_s"] * out["reference_scale"])
        assert (1 + out["errors_at_calibrated_speed"][plan]) / (1 + raw) == pytest.approx(ratio, rel=1e-9)
    summary = out["at_calibrated_speed"]
    values = [abs(e) for e in out["errors_at_calibrated_speed"].values()]
    assert summary["max_abs_error"] == pytest.approx(max(values), abs=1e-4)
    assert 0 < summary["median_abs_error"] <= summary["max_abs_error"]
    assert -0.5 < out["reference_in_sample_error"] < 0.5


@pytest.mark.quick  # make test-quick's test of this module
def test_bad_run_folders_exit_2_with_one_message(tmp_path):
    (tmp_path / "measurements.json").write_text('{"samples": []}')
    (tmp_path / "validate_host.json").write_text("not json")
    for folder in (tmp_path, tmp_path / "missing"):
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "refit_host_runs.py"), str(folder)],
                              capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 2
        assert "Traceback" not in done.stderr and str(folder) in done.stderr
        assert done.stdout == ""


def test_the_plan_summary_splits_each_error_into_its_two_ratios():
    """The error at the calibrated speed is the predicted over the measured ratio to the reference step, run by
    run; the summary's mean, spread and count beyond the goal are those of the runs' errors."""
    runs = [refit_host_runs.refit_run(RUN), refit_host_runs.refit_run(RUN.parent / "run-11")]
    for run in runs:
        for plan, error in run["errors_at_calibrated_speed"].items():
            assert 1 + error == pytest.approx(run["predicted_ratio"][plan] / run["measured_ratio"][plan], rel=1e-9)
    summary = refit_host_runs.plan_summary(runs)
    assert set(summary) == set(runs[0]["errors_at_calibrated_speed"])
    for plan, row in summary.items():
        errors = [r["errors_at_calibrated_speed"][plan] for r in runs]
        assert row["runs"] == 2
        assert row["mean_error"] == pytest.approx(sum(errors) / 2, abs=1e-4)
        assert row["sd_error"] == pytest.approx(abs(errors[0] - errors[1]) / 2, abs=1e-4)
        assert row["runs_beyond_max"] == sum(abs(e) > 0.25 for e in errors)
        for ratio in ("predicted_ratio", "measured_ratio"):
            a, b = (r[ratio][plan] for r in runs)
            assert row[f"{ratio}_cv"] == pytest.approx(abs(a - b) / (a + b), abs=1e-4)
