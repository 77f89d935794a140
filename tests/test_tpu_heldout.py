"""Today's predictions against one-chip plans the chip suite never saw, measured on the v5e chip.

benchmarks/tpu_chip/heldout/ (ten plans of shapes and settings the suite lacks), benchmarks/tpu_chip/heldout2/ (four
more: a 128,256-token tied vocabulary, multi-query attention, head dim 128 at seq 4096 with accumulation) and
benchmarks/tpu_chip/moe/ (six mixtures of experts): each folder's ``predicted.json`` was committed before its plans ran, ``runs.json`` holds the
runner's times and XLA:TPU's memory on the chip (benchmarks/tpu_chip_heldout.py sets them side by side). The
single-chip goals apply (step time median 8% / max 15% on the bundled tpu-v5e-1, memory median 3% / max 8% of
XLA:TPU's total).
The MoE plans (ho-moe8x-top2 and moe/) are also the sample of the fitted expert-update rate
(testbed.sim.price.grouped_kernels): tests/test_tpu_moe.py holds them to the goals.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHIP = ROOT / "benchmarks" / "tpu_chip"
STEP, MEMORY = (0.08, 0.15), (0.03, 0.08)


@cache
def _report() -> dict:
    spec = importlib.util.spec_from_file_location("tpu_chip_heldout", ROOT / "benchmarks" / "tpu_chip_heldout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.report()["sets"]


def _errors(name: str, key: str) -> dict[str, float]:
    return {plan: row[key] for plan, row in _report()[name]["rows"].items()}


def _meets(errors: dict[str, float], goal: tuple[float, float]) -> bool:
    values = [abs(e) for e in errors.values()]
    return statistics.median(values) <= goal[0] and max(values) <= goal[1]


@pytest.mark.parametrize("name, count", [("heldout", 10), ("heldout2", 4), ("moe", 6)])
def test_every_plan_ran_on_the_chip_after_its_prediction(name: str, count: int) -> None:
    runs = json.loads((CHIP / name / "runs.json").read_text())
    predicted = json.loads((CHIP / name / "predicted.json").read_text())
    assert runs["device_kind"] == "TPU v5 lite" and runs["versions"]["libtpu"] and runs["command"]
    assert predicted["predicted_on"] <= runs["date"][:10] and predicted["testbed_commit"]
    assert len(runs["plans"]) == len(predicted["plans"]) == count and all(r["ok"] for r in runs["plans"])
    assert sorted(p.stem for p in (CHIP / name).glob("*.yaml")) == sorted(predicted["plans"])


def test_the_held_out_plans_meet_the_step_time_goal() -> None:
    assert _meets(_errors("heldout", "error"), STEP), _errors("heldout", "error")


def test_the_second_held_out_set_meets_the_step_time_and_memory_goals() -> None:
    assert _meets(_errors("heldout2", "error"), STEP), _errors("heldout2", "error")
    assert _meets(_errors("heldout2", "memory_error"), MEMORY), _errors("heldout2", "memory_error")


def test_the_held_out_plans_meet_the_memory_goal() -> None:
    assert _meets(_errors("heldout", "memory_error"), MEMORY)


def test_no_plan_that_ran_is_predicted_out_of_memory() -> None:
    from testbed.topology.io import load_topology

    capacity = load_topology("tpu-v5e-1").device.memory_bytes
    rows = {p: r for name in ("heldout", "heldout2", "moe") for p, r in _report()[name]["rows"].items()}
    assert all(r["predicted_memory"] <= capacity for r in rows.values()), rows
