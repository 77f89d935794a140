"""`testbed simulate --program M:F --compile tpu:FAMILY:DIMS`: a user's step compiled by XLA:TPU for a slice without
its chips, XLA:TPU's memory reported beside the live-range estimate; bad input exit 2 with one line.

The compile itself needs libtpu: importable, or unpacked in the folder ``TESTBED_LIBTPU_PATH`` names (skipped
without it, as on CI). On the held-out programs it reproduces the chip's own memory analysis byte for byte
(benchmarks/tpu_chip/programs.json: the MLP-Mixer's 883,179,520 bytes).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.cli import main

ROOT = Path(__file__).resolve().parent.parent
CNN = f"{ROOT / 'examples' / 'predict' / 'vision_cnn.py'}:predict"


def _libtpu_path() -> str | None:
    """Where libtpu is importable from: ``TESTBED_LIBTPU_PATH``, or "" when installed; None when absent."""
    path = os.environ.get("TESTBED_LIBTPU_PATH")
    if path:
        return path if (Path(path) / "libtpu").is_dir() else None
    return "" if importlib.util.find_spec("libtpu") is not None else None


def _refused(argv: list[str], capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    return err


def test_a_target_that_is_not_the_topologys_devices_is_refused(capsys) -> None:
    err = _refused(["simulate", "--program", CNN, "--topology", "host-cpu-8", "--compile", "tpu:v5e:2x4"], capsys)
    assert "--compile" in err and "TPU-v5e" in err and "host-cpu-8" in err


def test_a_plan_is_sent_to_check_sharding(capsys) -> None:
    err = _refused(["simulate", "--plan", "demo", "--compile", "tpu:v5e:1x1"], capsys)
    assert "check-sharding" in err


def test_without_libtpu_one_line_says_what_is_missing(capsys) -> None:
    if _libtpu_path() is not None:
        pytest.skip("libtpu is importable here")
    err = _refused(["simulate", "--program", CNN, "--topology", "tpu-v5e-1", "--mesh", "data=1", "--compile",
                    "tpu:v5e:1x1"], capsys)
    assert "libtpu" in err and len(err.strip().splitlines()) <= 3


def test_the_program_compiles_for_a_v5e_chip(tmp_path: Path) -> None:
    """XLA:TPU's memory analysis of the example CNN for one v5e chip, the estimate beside it, the report's
    fusions and FLOPs (a fresh process: libtpu beside JAX on CPU)."""
    path = _libtpu_path()
    if path is None:
        pytest.skip("libtpu is not importable (set TESTBED_LIBTPU_PATH to an unpacked libtpu wheel's folder)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (path, str(ROOT)) if p), JAX_PLATFORMS="",
               ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-m", "testbed.cli", "simulate", "--program", CNN, "--topology",
                           "tpu-v5e-1", "--mesh", "data=1", "--compile", "tpu:v5e:1x1", "--json"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    memory = json.loads(done.stdout)["memory"]
    assert "XLA:TPU's memory analysis" in memory["method"] and memory["live_range_estimate"] > 0
    compiled = memory["compiled"]
    assert memory["total"] == compiled["memory"]["total"] > 0 and compiled["flops"] > 0
