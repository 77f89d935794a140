"""Held-out XLA:TPU compiles (benchmarks/xla_tpu_heldout/): multi-chip plans none of the XLA:TPU memory and
collective rules was written on, predicted (``predicted.json``, with its commit) before XLA:TPU compiled them.
Today's predictions against the compiles, at issue 54's tolerances (memory median <= 5%, max <= 10%; OOM verdicts
agree; collectives per mesh axis equal); the goals not met are strict xfails naming the plans and why."""

from __future__ import annotations

import datetime
import functools
import importlib.util
import json
import statistics
from pathlib import Path

from helpers import unmet

from testbed.compiled.compare import compare_all
from testbed.compiled.records import load_records
from testbed.plan.io import plan_from_dict, plan_to_dict

ROOT = Path(__file__).resolve().parent.parent
HELDOUT = ROOT / "benchmarks" / "xla_tpu_heldout"
PREDICTED = json.loads((HELDOUT / "predicted.json").read_text())


def _benchmark():
    spec = importlib.util.spec_from_file_location("memory_vs_xla_tpu", ROOT / "benchmarks" / "memory_vs_xla_tpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RECORDS = load_records(HELDOUT / "compiled")


@functools.cache
def _rows() -> dict[str, dict]:
    """Each held-out plan's comparison with its compile (testbed.compiled.compare), computed once, when first read."""
    return {r["plan"]: r for r in compare_all(RECORDS)["plans"]}


def test_every_heldout_plan_was_predicted_before_it_was_compiled():
    entries = {e["plan"]["name"]: e for e in _benchmark()._heldout()}
    assert sorted(r.name for r in RECORDS) == sorted(entries) == sorted(PREDICTED["plans"])
    predicted_on = datetime.date.fromisoformat(PREDICTED["predicted_on"])
    for r in RECORDS:
        assert r.ok and r.target.chips > 1, r.name
        assert datetime.datetime.fromisoformat(r.date).date() >= predicted_on, r.name
        assert "--heldout" in r.command and r.name in r.command
        assert r.target.name == entries[r.name]["target"] == PREDICTED["plans"][r.name]["target"]
        assert plan_to_dict(r.plan) == plan_to_dict(plan_from_dict(entries[r.name]["plan"], default_name=r.name))


def test_out_of_memory_verdicts_agree():
    assert [p for p, r in _rows().items() if r["predicted_fits"] != r["xla_fits"]] == []


#: Held-out plans over 10% from XLA:TPU's total, by the mechanism the compile shows (docs/xla_tpu.md).
MEMORY_APART = {
    "ho-llama4k-tensor8-sp-full": "XLA:TPU all-reduces the sequence-parallel blocks' outputs whole over the whole "
                                  "slice (testbed's collectives say so; its memory model keeps the outputs sharded) "
                                  "and regathers the recomputed inputs: full-sequence buffers",
    "ho-llama4k-fsdp128-full": "XLA:TPU's heap leaves 1.1 GB between its peak and its total, testbed's placement 6 MB",
    "ho-gpt3k-data4-tensor4-sp-selective": "XLA:TPU's heap leaves 455 MB beyond its peak (the peak within 4%), "
                                           "testbed's placement of its own buffers none",
}


def test_memory_is_within_10_percent_but_on_the_named_plans():
    """Each held-out plan within 10% of XLA:TPU's total but those :data:`MEMORY_APART` names, each still over."""
    rows = _rows()
    over = sorted(p for p, r in rows.items() if abs(r["error"]) > 0.10)
    assert over == sorted(MEMORY_APART), {p: f"{rows[p]['error']:+.1%}" for p in over}


def test_memory_within_the_issue_tolerance():
    """Issue 54's tolerance over the held-out set: median |error| <= 5%, max <= 10% (not yet met)."""
    errors = [abs(r["error"]) for r in _rows().values()]
    median, worst = statistics.median(errors), max(errors)
    unmet(median <= 0.05 and worst <= 0.10, f"memory vs XLA:TPU over {len(errors)} held-out plans: median |error| "
          f"{median:.1%}, max {worst:.1%}")


#: The held-out plans whose collectives equal XLA:TPU's compiled HLO per mesh axis (kind, count, bytes).
COLLECTIVES_EQUAL = ("ho-gpt1536-data4-tensor2-mb4", "ho-gpt1k-data8-seq4096-flash", "ho-gpt3k-data4-tensor4-sp-selective",
                     "ho-llama2k-data16-fsdp16-full", "ho-llama3k-data2-fsdp8-selective", "ho-llama4k-tensor8-sp-full")


def test_collectives_equal_the_compiled_hlo_on_the_named_plans():
    """The named plans' collectives equal the compiled HLO's; a plan that comes to equal joins the list."""
    assert sorted(p for p, r in _rows().items() if r["collectives_equal"]) == sorted(COLLECTIVES_EQUAL)


def test_collectives_per_axis_equal_the_compiled_hlo():
    """Issue 54's goal: every held-out plan's collectives equal the compiled HLO's (not yet met)."""
    rows = _rows()
    differ = [p for p, r in rows.items() if not r["collectives_equal"]]
    unmet(differ == [], f"collectives per mesh axis differ from XLA:TPU's on {len(differ)} of {len(rows)} held-out "
          "plans: the fp32 token table's gradient all-reduced whole beside tensor 2 (with collective-permutes), "
          "context under fsdp, v5p's all-reduce packing, the expert plan's data all-reduce in two")
