"""Python children start without the working directory on sys.path: a planted ``json.py`` never runs in them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.interpreter import project_root, python_argv, python_env, safe_pythonpath
from testbed.runner import launch

from helpers import CHILD_XLA_FLAGS

#: Modules named like the standard library's: each writes a marker file when imported.
PLANTED = ("json", "logging", "socket", "subprocess")


def _plant(folder: Path) -> Path:
    """Plant the modules in ``folder``; the folder their markers would appear in."""
    markers = folder / "markers"
    markers.mkdir()
    for name in PLANTED:
        (folder / f"{name}.py").write_text(f"open({str(markers / name)!r}, 'w').close()\n"
                                           f"raise SystemExit('planted {name} imported')\n")
    return markers


def test_a_child_started_plainly_imports_the_planted_module(tmp_path: Path) -> None:
    """The hazard, shown: ``python -c`` puts the working directory first (what the children must not do)."""
    markers = _plant(tmp_path)
    subprocess.run([sys.executable, "-c", "import json"], cwd=tmp_path, capture_output=True, timeout=60)
    assert (markers / "json").exists()


def test_a_safe_child_imports_the_standard_library_and_testbed(tmp_path: Path) -> None:
    markers = _plant(tmp_path)
    out = subprocess.run(python_argv("-c", "import json, logging, socket, subprocess, testbed; print(testbed.__file__)"),
                         cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env=python_env({**os.environ, "PYTHONPATH": f".{os.pathsep}{os.pathsep}markers"}))
    assert out.returncode == 0, out.stderr
    assert not list(markers.iterdir())
    assert Path(out.stdout.strip()).resolve().is_relative_to(project_root())


def test_the_child_path_keeps_absolute_entries_and_drops_relative_ones(tmp_path: Path) -> None:
    path = safe_pythonpath(f"{tmp_path}{os.pathsep}{os.pathsep}.{os.pathsep}rel/dir", extra=[tmp_path / "prog"])
    assert path.split(os.pathsep) == [str(project_root()), str(tmp_path), str((tmp_path / "prog").resolve())]
    env = python_env({"PYTHONPATH": ""})
    assert env["PYTHONSAFEPATH"] == "1" and env["PYTHONPATH"] == str(project_root())


def test_launched_workers_import_nothing_from_the_working_directory(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers started from a folder of planted modules: they join, one exits by the injected fault (the
    cheapest end of a job), and no planted module ran in either (a planted ``json`` would stop both at import)."""
    markers = _plant(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TESTBED_FAULT", "exit:1")
    with pytest.raises(launch.WorkerFailed) as failed:
        launch.launch({"plan": {}, "steps": 1}, processes=2, local_devices=1, stale_s=30.0, timeout_s=120)
    assert "exited with status 3" in str(failed.value), str(failed.value)
    assert not list(markers.iterdir())


PLAN = """\
name: tiny
model: {kind: gpt, layers: 1, d_model: 16, heads: 2, d_ff: 32, seq_len: 8, vocab: 32}
batch: {global_batch: 4, microbatches: 1}
mesh: {data: 2}
"""


@pytest.mark.slow  # two workers compile and run a plan (a minute on a loaded 2-core machine)
def test_testbed_run_with_two_processes_from_a_folder_of_planted_modules(tmp_path: Path) -> None:
    """`testbed run --processes 2` started (as the installed `testbed` script) in a folder holding ``json.py``,
    ``logging.py``, ...: the run succeeds and no planted module ran in the command or its workers."""
    markers = _plant(tmp_path)
    (tmp_path / "tiny.yaml").write_text(PLAN)
    script = Path(sys.executable).parent / "testbed"
    command = [str(script)] if script.exists() else python_argv("-m", "testbed.cli")
    out = subprocess.run([*command, "run", "--plan", "tiny.yaml", "--devices", "emulated:2", "--processes", "2",
                          "--steps", "1", "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=400,
                         env={**os.environ, "XLA_FLAGS": CHILD_XLA_FLAGS})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["processes"] == 2
    assert not list(markers.iterdir())


def test_the_rootless_reexec_starts_python_without_the_working_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    from testbed.cluster import rootless

    seen: dict = {}
    monkeypatch.delenv(rootless.ENV, raising=False)
    monkeypatch.setattr(rootless, "userns_problem", lambda: None)
    monkeypatch.setattr(sys, "argv", ["/usr/bin/testbed", "collective", "all_reduce"])
    monkeypatch.setattr(os, "execvpe", lambda file, argv, env: seen.update(argv=argv, env=env))
    rootless.reexec_rootless()
    python = seen["argv"].index(sys.executable)
    assert seen["argv"][python:python + 4] == [sys.executable, "-P", "-m", "testbed.cli"]
    assert seen["env"]["PYTHONSAFEPATH"] == "1" and seen["env"]["PYTHONPATH"].startswith(str(project_root()))
