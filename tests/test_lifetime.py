"""Nothing left behind (issue 40): children die with a SIGKILLed parent, killed writes leave no temporary file
for long, the package's own files are never outputs, Ctrl-C never prints a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml

from testbed.errors import InputError
from testbed.lifetime import TEMP_SUFFIX, remove_stale_folders, stale_temporary_files
from testbed.output import output_target, write_atomic

ROOT = Path(__file__).resolve().parent.parent
PLAN = {"name": "small-pipeline", "model": {"kind": "gpt", "layers": 2, "d_model": 16, "heads": 4, "d_ff": 32,
                                            "seq_len": 8, "vocab": 32},
        "batch": {"global_batch": 8, "microbatches": 4}, "mesh": {"data": 2, "fsdp": 1, "tensor": 2, "stage": 2},
        "schedule": "1f1b"}


def _ours(token: str) -> list[int]:
    """Live (not zombie) processes whose environment carries ``token``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token.encode() in (entry / "environ").read_bytes() and \
                        (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _kill_and_wait(proc: subprocess.Popen, token: str, children: int, settle_s: float) -> list[int]:
    """Wait for ``children`` processes beside ``proc``, SIGKILL ``proc``; the processes still alive 10 s later."""
    deadline = time.monotonic() + 180
    while len(_ours(token)) < children + 1:
        assert proc.poll() is None, "the command ended before its children started"
        assert time.monotonic() < deadline, "the children never started"
        time.sleep(0.2)
    time.sleep(settle_s)
    proc.kill()
    proc.wait()
    end = time.monotonic() + 10
    while _ours(token) and time.monotonic() < end:
        time.sleep(0.2)
    left = _ours(token)
    for pid in left:  # never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    return left


def _command(args: list[str], token: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "TESTBED_TEST_TOKEN": token, "XLA_FLAGS": ""}
    return subprocess.Popen([sys.executable, "-m", "testbed.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_sigkilled_launcher_leaves_no_worker(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(PLAN))
    token = f"testbed-launcher-{uuid.uuid4().hex}"
    proc = _command(["run", "--plan", str(plan), "--processes", "2", "--steps", "1000"], token, tmp_path)
    assert _kill_and_wait(proc, token, children=2, settle_s=1.0) == []
    scratch = list(Path(tempfile.gettempdir()).glob(f"testbed-launch-{proc.pid}-*"))
    assert len(scratch) == 1  # the killed launcher's folder, until the next launch removes it:
    assert remove_stale_folders(Path(tempfile.gettempdir()), "testbed-launch-") >= 1 and not scratch[0].exists()


def test_only_the_folders_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    mine = tmp_path / f"testbed-launch-{os.getpid()}-abc"
    gone = tmp_path / f"testbed-launch-{dead.stdout.strip()}-abc"
    other = tmp_path / "testbed-launch-12ab34cd"  # an older launcher's name (no pid): left alone
    for folder in (mine, gone, other):
        folder.mkdir()
        (folder / "result-0.json").write_text("{}")
    assert remove_stale_folders(tmp_path, "testbed-launch-") == 1
    assert mine.is_dir() and other.is_dir() and not gone.exists()


def test_sigkilled_sweep_leaves_no_pool_process(tmp_path):
    plan = {**PLAN, "mesh": {"data": 8}, "batch": {"global_batch": 8, "microbatches": 1}, "schedule": "gpipe"}
    spec = {"name": "long", "plan": plan, "topology": "host-cpu-8",
            "grid": {"plan.batch.global_batch": [8 * i for i in range(1, 81)], "plan.model.layers": list(range(1, 13))}}
    (tmp_path / "long.yaml").write_text(yaml.safe_dump(spec))
    token = f"testbed-sweep-{uuid.uuid4().hex}"
    proc = _command(["sweep", "long.yaml", "--workers", "2"], token, tmp_path)
    assert _kill_and_wait(proc, token, children=2, settle_s=2.0) == []


def test_a_killed_writes_temporary_file_is_removed_at_the_next_write(tmp_path):
    target = tmp_path / "trace.json"
    child = subprocess.run([sys.executable, "-c", "import os, sys\nfrom testbed.output import atomic_path\n"
                            f"with atomic_path({str(target)!r}) as tmp:\n"
                            "    tmp.write_text('x' * 1000)\n    os._exit(9)\n"], timeout=60)
    assert child.returncode == 9
    left = [p for p in tmp_path.iterdir() if p.name.endswith(TEMP_SUFFIX)]
    assert len(left) == 1 and left[0].name.startswith(".trace.json.") and stale_temporary_files(tmp_path) == left
    live = tmp_path / f".other.json.{os.getpid()}.abcdefgh{TEMP_SUFFIX}"  # a write in progress is left alone
    live.write_text("")
    write_atomic(tmp_path / "plot.png", b"png")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "plot.png"])


@pytest.mark.parametrize("path", ["plans/demo.yaml", "topologies/host-cpu-8.yaml", "plans/new.json",
                                  "testbed/__init__.py"])
def test_the_packages_own_files_are_never_outputs(path):
    from importlib import resources

    roots = {"plans": resources.files("testbed.plans"), "topologies": resources.files("testbed.topologies"),
             "testbed": resources.files("testbed")}
    top, _, rest = path.partition("/")
    with pytest.raises(InputError) as refused:
        output_target(Path(str(roots[top])) / rest, "--trace")
    assert refused.value.field == "--trace" and "testbed's own" in refused.value.message


@pytest.mark.parametrize("delay", [0.3, 0.8, 1.5])
def test_ctrl_c_at_any_moment_prints_no_traceback(tmp_path, delay):
    proc = subprocess.Popen([sys.executable, "-m", "testbed.cli",  # the command as its console script runs it
                             "simulate", "--plan", "demo", "--topology", "host-cpu-8", "--json"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert "Traceback" not in err and proc.returncode in (0, 130, -signal.SIGINT), (proc.returncode, err[-1500:])
    if proc.returncode == 130:
        assert err.strip().endswith("interrupted")


def test_a_worker_behind_a_forking_wrapper_dies_with_its_launcher():
    """`ip netns exec`-like prefixes may fork: the worker's parent is then the wrapper, and the watchdog polls the
    launcher's pid instead."""
    child = ("import os, time\nfrom testbed.lifetime import die_with_parent\ndie_with_parent(%d)\n"
             "print(os.getpid(), flush=True)\ntime.sleep(600)\n")
    launcher_code = ("import os, subprocess, sys, time\n"
                     f"code = {child!r} % os.getpid()\n"
                     "subprocess.Popen(['sh', '-c', '\"$0\" -c \"$1\"; true', sys.executable, code])\n"
                     "time.sleep(600)\n")
    token = f"testbed-wrapper-{uuid.uuid4().hex}"
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], env={**os.environ, "TESTBED_TEST_TOKEN": token},
                                stdout=subprocess.DEVNULL)
    assert _kill_and_wait(launcher, token, children=2, settle_s=1.0) == []
