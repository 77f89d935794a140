"""`testbed demo`: the predict-and-compare half alone (`--no-run`) and the whole mission.

The bundled demo plan is predicted, compared and drawn (`--no-run`, one subprocess that also prints the table);
the whole mission (run, verify, the host timed against its calibration) runs on a copy of it with the same mesh
(data 2 x tensor 2 x stage 2), schedule (1F1B) and precision but a smaller model, so the test pays for the
demo's wiring and not for compiling a bigger GPT three times. `make demo` runs the bundled plan itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from testbed.cli import main


def test_demo_without_run_writes_every_picture_and_fits_80_columns_when_piped(tmp_path):
    """One `demo --no-run` (a subprocess, stdout piped): its demo.json and pictures, and its table.

    rich prints 80 columns when stdout is not a terminal: no line longer, no number split."""
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
    data = json.loads((tmp_path / "demo.json").read_text())
    assert data["plan"] == "demo" and data["measured"] is None and data["verify"] is None
    assert {r["topology"] for r in data["compare"]} >= {"host-cpu-8", "dgx-h100", "eth-100g-8", "tpu-v5e-4x4"}
    # Scaling keeps the per-replica batch: global batch / data is the same on every topology.
    assert len({r["global_batch"] // r["data"] for r in data["compare"]}) == 1
    for name in ("demo-trace.json", "demo-gantt.png", "demo-compare.png", "demo-topology.png", "demo.json"):
        assert (tmp_path / name).stat().st_size > 0
    trace = json.loads((tmp_path / "demo-trace.json").read_text())
    pids = {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert len(pids) == 8
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary files left behind"


def _small_demo_plan(folder) -> str:
    """The bundled demo plan with a smaller model (same mesh, schedule, precision and optimizer)."""
    from testbed.plan.io import dump_plan, load_plan

    plan = yaml.safe_load(dump_plan(load_plan("demo")))
    assert [plan["mesh"][axis] for axis in ("data", "fsdp", "tensor", "stage")] == [2, 1, 2, 2]
    plan["model"].update(layers=2, d_model=16, d_ff=32, seq_len=8, vocab=32)
    plan["batch"] = {"global_batch": 8, "microbatches": 2}
    path = folder / "demo-small.yaml"
    path.write_text(yaml.safe_dump(plan))
    return str(path)


@pytest.mark.slow  # the whole demo with JAX; --no-run stays in make test
def test_demo_runs_verifies_and_times_the_host_against_its_calibration(tmp_path, capsys):
    """The whole demo: run, verify, and calibrate's own step timed beside the plan (the host's drift)."""
    code = main(["demo", "--plan", _small_demo_plan(tmp_path), "--out", str(tmp_path / "out"), "--json",
                 "--steps", "2"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["verify"]["ok"]
    assert data["plan"] == "demo" and data["topology"] == "host-cpu-8" and data["devices"] == 8
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
    trace = json.loads((tmp_path / "out" / "demo-measured-trace.json").read_text())
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"} == {"step 1", "step 2"}
