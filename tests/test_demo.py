"""`testbed demo`: the predict-and-compare half alone (`--no-run`) and the whole mission."""

from __future__ import annotations

import json
import re

import pytest

from testbed.cli import main


def test_demo_without_run_writes_every_picture(tmp_path, capsys):
    code = main(["demo", "--no-run", "--out", str(tmp_path), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["measured"] is None and data["verify"] is None
    assert {r["topology"] for r in data["compare"]} >= {"host-cpu-8", "dgx-h100", "eth-100g-8", "tpu-v5e-4x4"}
    # Scaling keeps the per-replica batch: global batch / data is the same on every topology.
    assert len({r["global_batch"] // r["data"] for r in data["compare"]}) == 1
    for name in ("demo-trace.json", "demo-gantt.png", "demo-compare.png", "demo-topology.png", "demo.json"):
        assert (tmp_path / name).stat().st_size > 0
    trace = json.loads((tmp_path / "demo-trace.json").read_text())
    pids = {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert len(pids) == 8
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary files left behind"


def test_demo_runs_verifies_and_times_the_host_against_its_calibration(tmp_path, capsys):
    """The whole demo: run, verify, and calibrate's own step timed beside the plan (the host's drift)."""
    code = main(["demo", "--out", str(tmp_path), "--json", "--steps", "2"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["verify"]["ok"]
    measured, rows = data["measured"], data["predicted_vs_measured"]
    ref = measured["reference_step"]
    assert ref["plan"] == "cpu-m" and ref["measured_s"] > 0
    assert ref["speed"] == pytest.approx(ref["predicted_s"] / ref["measured_s"])
    assert rows["reference_step_s"] == {"predicted": ref["predicted_s"], "measured": ref["measured_s"],
                                        "error": pytest.approx(ref["speed"] - 1)}
    at_speed = rows["step_time_at_calibrated_speed_s"]
    assert at_speed["predicted"] == rows["step_time_s"]["predicted"] == data["predicted"]["step_time_s"]
    assert at_speed["measured"] == pytest.approx(measured["median_step_time_s"] * ref["speed"])
    assert rows["memory_bytes"]["measured"] > 0
    # Predicted and measured are the same Report type, compared field by field.
    report = measured["report"]
    assert report["source"] == "measured" and data["predicted"]["source"] == "predicted"
    assert report["step_time_s"] == measured["median_step_time_s"] == rows["step_time_s"]["measured"]
    assert report["memory"]["total"] == measured["compiled_memory_bytes"] == rows["memory_bytes"]["measured"]
    errors = data["report_errors"]
    assert errors["step_time_s"] == rows["step_time_s"]["error"] and errors["mfu"] == rows["mfu"]["error"]
    assert errors["compute_s"] is None and errors["mfu"] is not None
    assert data["verify"]["report"]["source"] == "measured"
    trace = json.loads((tmp_path / "demo-measured-trace.json").read_text())
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"} == {"step 1", "step 2"}


def test_demo_table_fits_80_columns_when_piped(tmp_path):
    """rich prints 80 columns when stdout is not a terminal: no line longer, no number split."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-m", "testbed.cli", "demo", "--no-run", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    # Every topology's row whole on one line (names not cut, through its last cell), no wrapped continuation.
    for name in ("host-cpu-8", "dgx-h100", "a100-pcie-8", "eth-100g-8", "tpu-v5e-4x4"):
        row = [line for line in lines if line.startswith(f"│{name} ")]
        assert len(row) == 1 and row[0].rstrip().endswith(("fits│", "OOM│")), row
    assert not [line for line in lines if re.match(r"│\s+│", line)]
