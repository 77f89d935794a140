"""Today's predictions against the v5e chip's one-chip MoE steps (benchmarks/tpu_chip/moe/, and the held-out MoE plan).

benchmarks/tpu_chip/moe/: six one-chip plans of the runner's routed experts (4-16 experts, top-1/2, dropless and
capacity factors), ``predicted.json`` testbed's predictions made before they ran, ``runs.json`` the runner's times and
XLA:TPU's memory on the chip; ``heldout/ho-moe8x-top2`` (its row in ``heldout/runs.json``) is the seventh. The
single-chip suite's goals hold here too (step time median 8% / max 15% with the bundled v5e topology; memory median
3% / max 8% against XLA:TPU's total); goals not met today are strict xfails that name the plans, so a change that
meets one fails its xfail and one that drifts fails too. benchmarks/tpu_moe_ops.py sets the priced kernels beside
the chip's per-op profiles.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from helpers import chip_predictions, worst

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "tpu_chip"
RUNS = json.loads((DATA / "moe" / "runs.json").read_text())
PREDICTED = json.loads((DATA / "moe" / "predicted.json").read_text())
HELD = [r for r in json.loads((DATA / "heldout" / "runs.json").read_text())["plans"] if r["plan"] == "ho-moe8x-top2"]
ROWS = {r["plan"]: (DATA / "moe" / f"{r['plan']}.yaml", r) for r in RUNS["plans"]} | {
    r["plan"]: (DATA / "heldout" / f"{r['plan']}.yaml", r) for r in HELD}
STEP, MEMORY = (0.08, 0.15), (0.03, 0.08)


PREDICTED_NOW = chip_predictions({name: path for name, (path, _) in ROWS.items()})


def _errors(index: int, measured) -> dict[str, float]:
    """Today's step time (``index`` 0) or memory (1) of each plan over ``measured(row)`` of its record, - 1."""
    return {name: PREDICTED_NOW[name][index] / measured(row) - 1 for name, (_, row) in ROWS.items()}


STEPS = _errors(0, lambda row: row["median_s"])
MEMORIES = _errors(1, lambda row: row["memory"]["total"])


def test_every_moe_plan_ran_on_the_chip_and_was_predicted_first() -> None:
    assert RUNS["device_kind"] == "TPU v5 lite" and RUNS["versions"]["libtpu"] and RUNS["command"]
    assert all(r["ok"] for r in RUNS["plans"]) and len(RUNS["plans"]) == len(PREDICTED["plans"]) == 6
    assert PREDICTED["predicted_on"] <= RUNS["date"][:10]
    assert sorted(p.stem for p in (DATA / "moe").glob("*.yaml")) == sorted(PREDICTED["plans"])
    assert len(HELD) == 1 and HELD[0]["ok"] and len(ROWS) == 7


@pytest.mark.xfail(strict=True, reason="six of the seven one-chip MoE steps are priced fast (median |error| 8.8%) since tpu-v5e-1 "
                   "was refitted over the dense suite timed on the runner's splash forward blocks of 2026-12-08 "
                   "(elementwise passes 5.22 -> 3.83, flash 0.769 -> 0.745): the routed layers' elementwise work is "
                   "the passes' share the dense fit moved; " + ", ".join(f"{p} {e:+.1%}" for p, e in STEPS.items()))
def test_the_step_time_median_meets_the_chip_goal() -> None:
    assert statistics.median(abs(e) for e in STEPS.values()) <= STEP[0], STEPS


def test_the_step_time_max_meets_the_chip_goal() -> None:
    assert worst(STEPS, STEP[1]) == [], STEPS


def test_the_memory_median_meets_the_chip_goal() -> None:
    assert statistics.median(abs(e) for e in MEMORIES.values()) <= MEMORY[0], MEMORIES


def test_the_memory_max_meets_the_chip_goal() -> None:
    assert worst(MEMORIES, MEMORY[1]) == [], MEMORIES


def test_the_memory_meets_the_chip_goal_against_xlas_peak() -> None:
    """Against XLA:TPU's peak (the arguments plus the most temporaries live at once, what testbed's instants price)."""
    peaks = _errors(1, lambda row: row["memory"]["peak"])
    assert statistics.median(abs(e) for e in peaks.values()) <= MEMORY[0], peaks
    assert worst(peaks, MEMORY[1]) == [], peaks


def test_both_tiers_price_the_moe_steps_alike() -> None:
    """The analytic tier (testbed.explore.analytic) reads the same rules as the task graph: the experts' fused
    weight-gradient rate, their updates, the slot buffers' passes."""
    from testbed.explore.analytic import estimate
    from testbed.plan.io import load_plan
    from testbed.sim.graph.engine import simulate
    from testbed.topology.io import load_topology

    topology = load_topology("tpu-v5e-1")
    for name, (path, _) in ROWS.items():
        plan = load_plan(str(path))
        assert estimate(plan, topology).step_time_s == pytest.approx(
            simulate(plan, topology).report.step_time_s, rel=0.03), name


def test_the_expert_update_rate_is_the_profiles_fit() -> None:
    """The routed experts' fused weight-gradient rate testbed ships is benchmarks/tpu_moe_ops.py's fit."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("tpu_moe_ops", ROOT / "benchmarks" / "tpu_moe_ops.py")
    module = sys.modules.setdefault("tpu_moe_ops", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    from testbed.topology.io import load_topology

    topology = load_topology("tpu-v5e-1")
    rows = module.kernels(topology)
    assert len(rows) == 14 and len({k.plan for k in rows}) == 7  # two kernel shapes per plan
    from testbed.model.gemm import FUSED_UPDATE_KERNEL
    from testbed.sim.price.grouped_kernels import grouped_rate

    assert module.fit(rows, topology) == pytest.approx(grouped_rate(topology.device.name, FUSED_UPDATE_KERNEL))
