"""Today's predictions against one v5e chip's share of published v5e runs, measured on the chip.

benchmarks/tpu_chip/proxies/: each published v5e run's model (AXLearn Fuji-7B, MaxText 16B-128B) with 1-4 of its
layers at a chip's share of the batch, as one-chip plans; ``predicted.json`` holds testbed's predictions made before
they ran, ``runs.json`` the runner's times and XLA:TPU's memory on the chip. The single-chip suite's goals hold here
too (step time median 8% / max 15% with the bundled v5e topology; memory median 3% / max 8%); goals not met today
are strict xfails that name the plans, so a change that meets one fails its xfail and one that drifts fails too.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from helpers import chip_predictions, worst

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "tpu_chip" / "proxies"
RUNS = json.loads((DATA / "runs.json").read_text())
PREDICTED = json.loads((DATA / "predicted.json").read_text())
STEP, MEMORY = (0.08, 0.15), (0.03, 0.08)


PREDICTED_NOW = chip_predictions({r["plan"]: DATA / f"{r['plan']}.yaml" for r in RUNS["plans"]})


def _errors(index: int, measured) -> dict[str, float]:
    """Today's step time (``index`` 0) or memory (1) of each proxy over ``measured(row)`` of its record, - 1."""
    return {r["plan"]: PREDICTED_NOW[r["plan"]][index] / measured(r) - 1 for r in RUNS["plans"]}


STEPS = _errors(0, lambda row: row["median_s"])
MEMORIES = _errors(1, lambda row: row["memory"]["total"])


def test_every_proxy_ran_on_the_chip_and_was_predicted_first() -> None:
    assert RUNS["device_kind"] == "TPU v5 lite" and RUNS["versions"]["libtpu"] and RUNS["command"]
    assert all(r["ok"] for r in RUNS["plans"]) and len(RUNS["plans"]) == len(PREDICTED["plans"]) == 7
    assert PREDICTED["predicted_on"] <= RUNS["date"][:10]
    assert sorted(p.stem for p in DATA.glob("*.yaml")) == sorted(PREDICTED["plans"])


def test_the_step_time_median_meets_the_chip_goal() -> None:
    assert statistics.median(abs(e) for e in STEPS.values()) <= STEP[0], STEPS


def test_the_step_time_max_meets_the_chip_goal() -> None:
    assert worst(STEPS, STEP[1]) == [], STEPS


@pytest.mark.xfail(strict=True, reason="against XLA:TPU's total proxy-maxtext16b-v5e-l2 is -12.9% and "
                                       "proxy-maxtext128b-v5e-l2 -35.9% (median 3.3%): their heaps' fragmentation "
                                       "above the live peak, which testbed's placement of its own buffers "
                                       "(testbed.model.step_heap) leaves out on one chip")
def test_the_memory_meets_the_chip_goal() -> None:
    assert statistics.median(abs(e) for e in MEMORIES.values()) <= MEMORY[0]
    assert max(abs(e) for e in MEMORIES.values()) <= MEMORY[1]


def test_the_memory_meets_the_chip_goal_against_xlas_peak() -> None:
    """Against XLA:TPU's peak (the arguments plus the most temporaries live at once, what testbed's instants
    price) every proxy meets the chip's memory goal."""
    peaks = _errors(1, lambda row: row["memory"]["peak"])
    assert statistics.median(abs(e) for e in peaks.values()) <= MEMORY[0], peaks
    assert worst(peaks, MEMORY[1]) == [], peaks


def test_the_fuji_proxies_memory_is_within_the_goal() -> None:
    assert all(abs(MEMORIES[p]) <= MEMORY[1] for p in MEMORIES if "fuji" in p), MEMORIES
