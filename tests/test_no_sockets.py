"""One process on ``--devices local`` needs no sockets: a TPU VM that allows none runs the runner's commands.

``run`` and ``verify`` of a one-device plan run in a fresh process (as a user's would: JAX's own local
devices) whose ``socket.socket`` raises; the launcher and cluster code (testbed.runner.launch, testbed.cluster)
stay unimported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import json, socket, sys

class NoSocket(socket.socket):
    def __init__(self, *args, **kwargs):
        raise OSError("sockets are not allowed here")

socket.socket = NoSocket
from testbed.cli.main import main
status = main(sys.argv[1:])
loaded = [m for m in sys.modules if m.startswith(("testbed.runner.launch", "testbed.cluster"))]
print(json.dumps({"status": status, "loaded": loaded}), file=sys.stderr)
"""


def _run(*args: str) -> tuple[dict, dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([sys.executable, "-c", _CHILD, *args, "--json"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    tail = json.loads(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0 and tail["status"] == 0, done.stderr[-3000:]
    return json.loads(done.stdout), tail


def test_local_run_and_verify_open_no_socket(tmp_path: Path) -> None:
    plan = tmp_path / "one.yaml"
    plan.write_text("model: {layers: 2, d_model: 64, heads: 2, d_ff: 128, seq_len: 32, vocab: 128}\n"
                    "batch: {global_batch: 4, microbatches: 2}\nmesh: {data: 1}\n")
    ran, tail = _run("run", "--plan", str(plan), "--devices", "local", "--steps", "2")
    assert ran["devices"] == 1 and ran["processes"] == 1 and len(ran["step_times_s"]) == 2
    assert tail["loaded"] == []
    verified, tail = _run("verify", "--plan", str(plan), "--devices", "local")
    assert verified["ok"] and tail["loaded"] == []
