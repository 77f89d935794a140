"""Today's predictions against the single-chip TPU suite measured on a v5e chip (benchmarks/tpu_chip.py).

The recorded data lives in ``benchmarks/tpu_chip/``: ``runs.json`` (step times, memory_analysis, MFU; date,
JAX/libtpu versions, command), ``calibrated.yaml`` (calibrate --devices local on the chip) and ``plans/``.
Goals (issue "Run on a real TPU"): step time within median 8% / max 15% with the bundled v5e device, median
5% / max 10% with the chip's calibration; memory within median 3% / max 8% of XLA:TPU's; no plan that ran
predicted out of memory; the runner's MFU >= 50% on the Llama-style 400M-1B flash plans.

No chip measurement is recorded yet: every test here is skipped until ``benchmarks/tpu_chip/runs.json``
exists (docs/tpu.md says how a session with a chip makes it).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "tpu_chip"
RUNS = DATA / "runs.json"

pytestmark = pytest.mark.skipif(not RUNS.exists(), reason="no TPU chip measurement recorded yet "
                                "(benchmarks/tpu_chip/runs.json: run benchmarks/tpu_chip.py on a chip, docs/tpu.md)")

#: (median, max) |relative error| allowed.
STEP_BUNDLED, STEP_CALIBRATED, MEMORY = (0.08, 0.15), (0.05, 0.10), (0.03, 0.08)
#: Plans whose measured MFU must reach :data:`MFU_GOAL`.
MFU_PLANS, MFU_GOAL = ("llama400m-bf16-full", "llama400m-bf16-flash-seq4096", "llama1b-bf16-flash-full"), 0.50


def _runs() -> dict:
    return json.loads(RUNS.read_text())


def _measured() -> list[tuple[object, dict]]:
    from testbed.plan.io import load_plan

    return [(load_plan(str(DATA / "plans" / f"{row['plan']}.yaml")), row) for row in _runs()["plans"] if row["ok"]]


def _one_chip(calibrated: bool):
    from testbed.calibration.calibrated import base_topology
    from testbed.topology.io import load_topology

    if calibrated:
        return load_topology(str(DATA / "calibrated.yaml"))
    return base_topology(None, "tpu", 1, _runs()["device_kind"])


def _within(errors: list[float], limits: tuple[float, float]) -> None:
    worst = max(abs(e) for e in errors)
    assert statistics.median(abs(e) for e in errors) <= limits[0] and worst <= limits[1], errors


def test_recorded_with_its_provenance() -> None:
    runs = _runs()
    assert runs["date"] and runs["command"] and runs["versions"]["jax"] and runs["platform"] == "tpu"
    assert len([r for r in runs["plans"] if r["ok"]]) >= 10


@pytest.mark.parametrize("calibrated, limits", [(False, STEP_BUNDLED), (True, STEP_CALIBRATED)])
def test_step_time(calibrated: bool, limits: tuple[float, float]) -> None:
    from testbed.sim.engine import simulate

    topology = _one_chip(calibrated)
    _within([simulate(plan, topology).report.step_time_s / row["median_s"] - 1 for plan, row in _measured()], limits)


def test_memory() -> None:
    from testbed.model.memory import memory_breakdown

    topology = _one_chip(False)
    errors, out_of_memory = [], []
    for plan, row in _measured():
        predicted = memory_breakdown(plan, topology)
        errors.append(predicted.total / row["memory"]["total"] - 1)
        if predicted.total > topology.device.memory_bytes:
            out_of_memory.append(row["plan"])
    assert not out_of_memory
    _within(errors, MEMORY)


def test_runner_mfu() -> None:
    rows = {row["plan"]: row for _, row in _measured()}
    assert {p: rows[p]["mfu"] for p in MFU_PLANS if rows[p]["mfu"] < MFU_GOAL} == {}
