"""`testbed run` / `testbed verify` on the command line: bad device choices exit 2 naming the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testbed.cli import main


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "testbed.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_local_devices_too_few_for_the_mesh() -> None:
    # A fresh process with one CPU device; the demo mesh needs 8.
    out = _cli("run", "--plan", "demo", "--devices", "local", env={"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2
    assert "field `mesh`" in out.stderr and "needs 8 devices but JAX has 1" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("args, field", [
    (["run", "--devices", "emulated:4"], "--devices"),          # JAX already started here with 8 devices
    (["verify", "--devices", "tpu:8"], "--devices"),
    (["run", "--steps", "0"], "--steps"),
    (["run", "--processes", "3"], "--processes"),               # 8 devices do not split over 3 processes
])
def test_bad_choices_exit_2(args: list[str], field: str, capsys: pytest.CaptureFixture) -> None:
    assert main([*args, "--plan", "demo"]) == 2
    assert f"field `{field}`" in capsys.readouterr().err


def test_run_prints_the_contract_keys(tmp_path, capsys: pytest.CaptureFixture) -> None:
    plan = tmp_path / "dp.yaml"
    plan.write_text("name: dp\nmodel: {kind: gpt, layers: 1, d_model: 8, heads: 2, d_ff: 16, seq_len: 4, vocab: 16}\n"
                    "batch: {global_batch: 8}\nmesh: {data: 8}\n")
    trace = tmp_path / "run-trace.json"
    assert main(["run", "--plan", str(plan), "--steps", "2", "--json", "--trace", str(trace)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"platform", "devices", "processes", "step_times_s", "loss", "median_step_time_s",
            "compile_time_s", "report"} <= set(data)
    assert data["devices"] == 8 and data["processes"] == 1 and len(data["step_times_s"]) == 2
    assert data["loss"] > 0
    # The simulator's Report, measured: the median step; what the runner does not time is None.
    report = data["report"]
    assert report["source"] == "measured" and report["step_time_s"] == data["median_step_time_s"]
    assert report["plan"] == "dp" and report["devices"] == 8 and report["exposed_comm_s"] is None
    # The measured steps as the simulator's trace: one span per step on every device.
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(range(8)) and {e["name"] for e in spans} == {"step 1", "step 2"}
    assert data["trace"] == str(trace)


def test_run_refuses_a_trace_path_before_running(tmp_path, capsys: pytest.CaptureFixture) -> None:
    assert main(["run", "--plan", "demo", "--trace", str(tmp_path / "missing" / "t.json")]) == 2
    assert "field `--trace`" in capsys.readouterr().err
