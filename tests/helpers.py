"""Helpers several test modules share; a test module imports them by name (``from helpers import ...``), pytest
putting ``tests/`` on ``sys.path``."""

from __future__ import annotations

import os
import re
from dataclasses import replace

import pytest

from testbed.cli.main import main
from testbed.topology.io import load_topology


#: ``XLA_FLAGS`` for a test's child process that compiles: conftest's compile flags (LLVM optimisation level 0, the
#: fusion emitters: the tests check what programs compute, never how fast the compiled code runs) without its device
#: count (the child sets its own).
CHILD_XLA_FLAGS = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()


def unmet(met: bool, reason: str) -> None:
    """A strict expected failure decided when the test runs, for a goal whose numbers are computed then (not at
    collection): xfail with ``reason`` while the goal is not ``met``, fail once it is (make it an assertion)."""
    if met:
        pytest.fail(f"the goal is now met ({reason}): turn this expected failure into an assertion")
    pytest.xfail(reason)


def refused(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """The command's standard error for ``argv``, asserting it exits 2 with one line and no traceback."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def with_xla_merges(topology):
    """``topology`` with XLA's default merge bound (``calibration.collectives.combine_bytes`` None): the merged
    gathers and reduce-scatters a test holds, where XLA:TPU itself merges none (benchmarks/xla_tpu_collectives.py)."""
    c = topology.calibration
    return replace(topology, calibration=replace(c, collectives=replace(c.collectives, combine_bytes=None)))


def merging_tpu():
    """tpu-v5e-16x16 with XLA's default merge bound (``with_xla_merges``)."""
    return with_xla_merges(load_topology("tpu-v5e-16x16"))



def chip_predictions(paths: dict) -> dict[str, tuple[float, float]]:
    """Today's (step seconds, memory bytes) of each named one-chip plan file on the bundled tpu-v5e-1
    (testbed.sim.graph.engine.simulate, testbed.model.memory.memory_breakdown)."""
    from testbed.model.memory import memory_breakdown
    from testbed.plan.io import load_plan
    from testbed.sim.graph.engine import simulate

    topology = load_topology("tpu-v5e-1")
    out = {}
    for name, path in paths.items():
        plan = load_plan(str(path))
        out[name] = (simulate(plan, topology).report.step_time_s, float(memory_breakdown(plan, topology).total))
    return out


def worst(errors: dict[str, float], limit: float) -> list[str]:
    """The names whose error's magnitude passes ``limit``, sorted."""
    return sorted(p for p, e in errors.items() if abs(e) > limit)


def sampled_plans(model: str, devices: int, count: int, seed: int) -> list:
    """``count`` plans of a preset model drawn (seeded) from a search space of every schedule kind, microbatch count,
    ZeRO stage and remat: the samples the play tests hold their exactness claims on."""
    import random

    from testbed.explore.space import SearchSpace, candidates, preset_plan

    space = SearchSpace(schedules=("1f1b", "interleaved", "zb-h1"), microbatches=(1, 4, 8), zero=(0, 1, 3),
                        remat=("none", "selective", "full"))
    plans = list(candidates(preset_plan(model), devices, space))
    random.Random(seed).shuffle(plans)
    return plans[:count]


def benchmark_module(name: str):
    """The module of ``benchmarks/<name>.py``, loaded from its file (the benchmarks are scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
