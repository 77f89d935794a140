"""Sequence parallelism's reduce-scatters XLA:TPU compiles to whole all-reduces (benchmarks/xla_tpu_sequence_scatters.py,
recorded deviceless compiles) against testbed.sim.xla.xla_tpu.scatters_whole_sequence, the rule as read (not yet
applied to the tensor transfers: docs/xla_tpu.md)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import benchmark_module


ROOT = Path(__file__).resolve().parent.parent
RECORD = json.loads((ROOT / "benchmarks" / "xla_tpu_probes" / "sequence_scatters.json").read_text())


def _benchmark():
    return benchmark_module("xla_tpu_sequence_scatters")


def test_the_rule_says_every_probes_kind():
    """13 probes over v5e 2x2 to 16x16 and v5p 2x2x2 and 4x4x4: one sequence a device all-reduced whole, two
    reduce-scattered, but over every chip of a slice whose reduce-scatters are all-reduces (v5p 2x2x2, v5e 4x4)."""
    module = _benchmark()
    assert RECORD["versions"]["libtpu"] and RECORD["command"].endswith("--collect")
    assert len(RECORD["probes"]) == len(module.PROBES)
    result = module.compare(RECORD)
    assert result["agree"] == result["count"] == 13
    kinds = {r["compiled"][0] for r in result["probes"]}
    assert kinds == {"all-reduce", "reduce-scatter"}
