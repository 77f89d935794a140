"""`testbed collective OP ... --execute emulated:N`: the timed step program runs on devices and is checked.

In-process runs use the test session's 8 emulated CPU devices (JAX is started
first, so ``emulated:N`` with N <= 8 takes the first N); one subprocess checks
the real path, where the device count is set before JAX starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from testbed.runner.collectives import execute_and_check, execution_elements
from testbed.cli import main
from testbed.collectives.algorithms import step_program
from testbed.collectives.ops import Op

# Three-device nodes, two nodes: odd groups (--over node) and a two-level grid for hierarchical (--over all).
SIX = """\
name: six-cpu
device: {name: host-cpu, flops: {fp32: 1TFLOP/s}, memory: 1GB, memory_bandwidth: 10GB/s}
levels:
  - {name: node, size: 3, bandwidth: 10GB/s, latency: 1us, kind: host}
  - {name: cluster, size: 2, bandwidth: 1GB/s, latency: 5us, kind: ethernet}
"""


@pytest.fixture(scope="module", autouse=True)
def started_jax():
    """Start JAX with the session's 8 devices before any command asks for emulated devices."""
    assert len(jax.devices()) == 8


@pytest.fixture(scope="module")
def six(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("topology") / "six-cpu.yaml"
    path.write_text(SIX)
    return str(path)


def _execute(capsys, *argv: str, code: int = 0) -> dict:
    assert main(["collective", *argv, "--repeats", "2", "--json"]) == code
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
def test_four_ranks_of_a_torus_pass_the_check(capsys, op):
    data = _execute(capsys, op, "--topology", "tpu-v5e-4x4", "--over", "x", "--bytes", "4KiB",
                    "--execute", "emulated:4")
    run = data["execute"]
    assert run["algorithm"] == data["algorithm"] and run["chosen"] == "auto: fastest"  # what the simulator timed
    assert run["ok"] and run["ranks"] == 4 and run["devices"] == "emulated:4" and run["platform"] == "cpu"
    assert run["bytes"] == 4096 and run["repeats"] == 2
    assert 0 <= run["max_abs_error"] <= run["tolerance"]
    if op in ("all_gather", "all_to_all"):
        assert run["tolerance"] == 0.0  # copies are bit-exact
    assert run["program_time_s"] > 0 and run["builtin_time_s"] > 0 and run["predicted_s"] > 0
    assert run["lax"] == {"all_reduce": "lax.psum", "all_gather": "lax.all_gather",
                          "reduce_scatter": "lax.psum_scatter", "all_to_all": "lax.all_to_all"}[op]


@pytest.mark.parametrize("op,over,algorithm,n", [
    ("all_reduce", "node", "ring", 3),
    ("reduce_scatter", "all", "hierarchical", 6),
    ("all_gather", "all", "halving_doubling", 6),
])
def test_odd_groups_and_uneven_sizes(capsys, six, op, over, algorithm, n):
    data = _execute(capsys, op, "--topology", six, "--over", over, "--bytes", "1000", "--algorithm", algorithm,
                    "--execute", f"emulated:{n}")
    run = data["execute"]
    assert run["ok"] and run["algorithm"] == algorithm and run["ranks"] == n
    blocks = 1 if op == "all_reduce" else n
    assert run["bytes"] == 1000 // (4 * blocks) * 4 * blocks  # rounded down to whole fp32 blocks
    assert data["groups"] == (2 if over == "node" else 1) == run["predicted_groups"]


def test_nccl_winner_executes_the_fastest_step_program(capsys):
    data = _execute(capsys, "all_gather", "--topology", "dgx-h100", "--over", "node", "--bytes", "1KiB",
                    "--execute", "emulated:8")
    run = data["execute"]
    programs = [r for r in data["algorithms"] if not r["algorithm"].startswith(("nccl", "nvls", "sharp"))]
    assert data["algorithm"].startswith("nccl") and run["ok"]
    assert run["algorithm"] == min(programs, key=lambda r: (r["time_s"], r["rounds"]))["algorithm"]
    assert "NCCL's" in run["chosen"]


def test_table_shows_prediction_measurements_and_check(capsys):
    assert main(["collective", "all_reduce", "--topology", "tpu-v5e-4x4", "--over", "x", "--bytes", "1KiB",
                 "--execute", "emulated:4", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for needle in ("predicted on tpu-v5e-4x4", "measured step program", "measured lax.psum", "check vs lax.psum: ok"):
        assert needle in out


def _dropped_last_round(program):
    return dataclasses.replace(program, rounds=program.rounds[:-1])


def test_a_wrong_program_fails_the_check_and_exits_1(capsys, monkeypatch):
    import testbed.cli.collective as command

    placed = command.placed_program
    monkeypatch.setattr(command, "placed_program",
                        lambda *a, **k: (_dropped_last_round(placed(*a, **k)[0]), placed(*a, **k)[1]))
    assert main(["collective", "all_reduce", "--topology", "tpu-v5e-4x4", "--over", "x", "--bytes", "1KiB",
                 "--algorithm", "ring", "--execute", "emulated:4", "--repeats", "1", "--json"]) == 1
    captured = capsys.readouterr()
    run = json.loads(captured.out)["execute"]
    assert not run["ok"] and run["max_abs_error"] > run["tolerance"]
    assert "`ring` step program for all_reduce" in captured.err and "max abs error" in captured.err


def test_the_check_catches_a_wrong_copy():
    good = step_program(Op.ALL_GATHER, "ring", 4)
    bad = _dropped_last_round(good)
    assert execute_and_check(good, 256, repeats=1, warmup=0).ok
    result = execute_and_check(bad, 256, repeats=1, warmup=0)
    assert not result.ok and result.tolerance == 0.0 and result.max_abs_error > 0


def test_execution_sizes_follow_nccl_tests_bytes():
    assert execution_elements(step_program("all_reduce", "ring", 3), 1000) == (250, 1000)
    assert execution_elements(step_program("all_gather", "ring", 3), 1000) == (83, 996)
    assert execution_elements(step_program("reduce_scatter", "ring", 3), 1000) == (249, 996)
    assert execution_elements(step_program("all_to_all", "pairwise", 3), 1000) == (249, 996)


@pytest.mark.parametrize("argv,needle", [
    (["all_reduce", "--topology", "tpu-v5e-4x4", "--over", "x", "--execute", "emulated:8"], "use --execute emulated:4"),
    (["all_reduce", "--topology", "tpu-v5e-4x4", "--over", "x", "--execute", "gpu:4"], "field `execute`"),
    (["broadcast", "--topology", "tpu-v5e-4x4", "--over", "x", "--execute", "emulated:4"], "no JAX collective"),
    (["all_reduce", "--topology", "dgx-h100", "--algorithm", "nccl_ring", "--execute", "emulated:8"],
     "no step program"),
    (["all_reduce", "--topology", "tpu-v5e-4x4", "--over", "x", "--bytes", "2", "--algorithm", "ring",
      "--execute", "emulated:4"], "field `bytes`"),
    (["all_gather", "--topology", "tpu-v5e-4x4", "--over", "x", "--execute", "emulated:4", "--repeats", "0"],
     "field `repeats`"),
])
def test_bad_execute_input_exits_2(capsys, argv, needle):
    assert main(["collective", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and err.count("\n") == 1


def test_a_fresh_process_requests_the_emulated_devices(tmp_path):
    """The user's path: JAX not started yet, so emulated:4 sets the host device count (else JAX has one CPU)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    out = subprocess.run([sys.executable, "-c", "from testbed.cli import main; raise SystemExit(main())",
                          "collective", "all_reduce", "--topology", "tpu-v5e-4x4", "--over", "x", "--bytes", "1KiB",
                          "--execute", "emulated:4", "--repeats", "1", "--json"],
                         capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)["execute"]
    assert run["ok"] and run["ranks"] == 4 and np.isfinite(run["program_time_s"])
