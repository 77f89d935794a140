"""Multi-process runs: 2 local processes x 4 devices equal 1 process x 8; dead or hung workers stop the job."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from testbed.runner import launch
from testbed.runner.train import run_plan
from testbed.runner.devices import select_devices
from testbed.errors import InputError
from testbed.plan.io import load_plan, plan_to_dict

from helpers import CHILD_XLA_FLAGS

PLAN = """
name: small-pipeline
model: {kind: gpt, layers: 2, d_model: 16, heads: 4, d_ff: 32, seq_len: 8, vocab: 32}
batch: {global_batch: 8, microbatches: 4}
mesh: {data: 2, fsdp: 1, tensor: 2, stage: 2}
schedule: 1f1b
"""


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plans") / "small.yaml"
    path.write_text(PLAN)
    return path


def _ours(token: str) -> list[int]:
    """Live processes whose environment carries ``token`` (the workers of one test)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token.encode() in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.mark.slow  # two worker processes running a plan end to end
def test_two_processes_match_one(plan_file: Path) -> None:
    """A pipeline plan (stage 2: transfers cross the two processes) gives the single-process loss."""
    out = subprocess.run([sys.executable, "-m", "testbed.cli", "run", "--plan", str(plan_file), "--processes", "2",
                          "--steps", "2", "--json"], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "XLA_FLAGS": CHILD_XLA_FLAGS})
    assert out.returncode == 0, out.stderr[-2000:]
    multi = json.loads(out.stdout)
    single = run_plan(load_plan(str(plan_file)), select_devices(8), steps=2)
    assert multi["processes"] == 2 and multi["devices"] == 8
    assert len(multi["step_times_s"]) == 2 and len(multi["worker_step_times_s"]) == 2
    assert multi["losses"] == pytest.approx(list(single.losses), abs=1e-6)
    # Each worker's measured Report crossed the process boundary as JSON: process 0's is the run's.
    assert multi["report"]["source"] == "measured" and multi["report"]["step_time_s"] == multi["median_step_time_s"]
    assert single.report.source == "measured" and single.report.plan == multi["report"]["plan"] == "small-pipeline"


@pytest.mark.parametrize("fault, words", [("exit:1", "exited with status 3"), ("hang:1", "hung")])
def test_failed_worker_stops_the_job(plan_file: Path, fault: str, words: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    token = f"testbed-fault-{uuid.uuid4().hex}"
    monkeypatch.setenv("TESTBED_FAULT", fault)
    monkeypatch.setenv("TESTBED_TEST_TOKEN", token)
    payload = {"plan": plan_to_dict(load_plan(str(plan_file))), "steps": 2}
    start = time.monotonic()
    with pytest.raises(launch.WorkerFailed) as failed:
        launch.launch(payload, processes=2, local_devices=4, stale_s=6.0)
    assert time.monotonic() - start < 60
    assert failed.value.worker == 1
    assert "worker 1 of 2" in str(failed.value) and words in str(failed.value)
    assert _ours(token) == []


def test_busy_port_is_reported() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(InputError) as bad:
            launch.launch({"plan": {}, "steps": 1}, processes=2, local_devices=1, port=port)
    assert bad.value.field == "--port" and str(port) in bad.value.message


def test_worker_module_refuses_to_run_by_hand() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TESTBED_WORKER"}
    out = subprocess.run([sys.executable, "-m", "testbed.runner.launch"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and "not by hand" in out.stderr
