"""One process on ``--devices local`` needs no sockets: a TPU VM that allows none runs the runner's commands.

``run`` then ``verify`` of a one-device plan run in one fresh process (as a user's would: JAX's own local
devices) whose ``socket.socket`` raises; the launcher and cluster code (testbed.runner.launch, testbed.cluster)
stay unimported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import CHILD_XLA_FLAGS

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import io, json, socket, sys
from contextlib import redirect_stdout

class NoSocket(socket.socket):
    def __init__(self, *args, **kwargs):
        raise OSError("sockets are not allowed here")

socket.socket = NoSocket
from testbed.cli.main import main
for argv in json.loads(sys.argv[1]):
    with redirect_stdout(io.StringIO()) as out:
        status = main(argv)
    loaded = [m for m in sys.modules if m.startswith(("testbed.runner.launch", "testbed.cluster"))]
    print(json.dumps({"status": status, "loaded": loaded, "stdout": out.getvalue()}))
"""


def _run(*commands: list[str]) -> list[tuple[dict, dict]]:
    """Each command's ``--json`` output and what the process had loaded after it: one process runs them all in
    turn (one JAX start), as a user's session would."""
    env = {**os.environ, "XLA_FLAGS": CHILD_XLA_FLAGS}
    env["JAX_PLATFORMS"] = "cpu"
    argvs = [[*argv, "--json"] for argv in commands]
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(argvs)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    tails = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 0 and len(tails) == len(commands), done.stdout[-2000:] + done.stderr[-3000:]
    assert all(t["status"] == 0 for t in tails), done.stdout[-2000:] + done.stderr[-3000:]
    return [(json.loads(t["stdout"]), t) for t in tails]


def test_local_run_and_verify_open_no_socket(tmp_path: Path) -> None:
    plan = tmp_path / "one.yaml"
    plan.write_text("model: {layers: 2, d_model: 64, heads: 2, d_ff: 128, seq_len: 32, vocab: 128}\n"
                    "batch: {global_batch: 4, microbatches: 2}\nmesh: {data: 1}\n")
    (ran, tail), (verified, tail2) = _run(["run", "--plan", str(plan), "--devices", "local", "--steps", "2"],
                                          ["verify", "--plan", str(plan), "--devices", "local"])
    assert ran["devices"] == 1 and ran["processes"] == 1 and len(ran["step_times_s"]) == 2
    assert tail["loaded"] == []
    assert verified["ok"] and tail2["loaded"] == []
