"""Sequence parallelism's reduce-scatters XLA:TPU compiles to whole all-reduces (benchmarks/xla_tpu_sequence_scatters.py,
recorded deviceless compiles) against testbed.sim.xla.xla_tpu.scatters_whole_sequence, and the rule in the tensor
transfers both tiers price."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import benchmark_module

from testbed.model.costs import chunk_cost
from testbed.plan.io import plan_from_dict
from testbed.sim.step.action_work import tensor_transfers
from testbed.sim.xla.xla_tpu import scatters_whole_sequence

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


def _plan(batch: int, fsdp: int, tensor: int, sp: bool = True):
    return plan_from_dict({"model": {"kind": "gpt", "layers": 2, "d_model": 1024, "heads": 16, "d_ff": 4096,
                                     "seq_len": 2048, "vocab": 32000},
                           "batch": {"global_batch": batch}, "mesh": {"fsdp": fsdp, "tensor": tensor},
                           "sequence_parallel": sp})


def test_the_tensor_transfers_all_reduce_where_the_rule_holds():
    """At one sequence a device the forward's and backward's sequence reduce-scatters are all-reduces of the same
    bytes; at two, or off XLA:TPU, or without sequence parallelism, nothing changes."""
    one, two = _plan(8, 8, 4), _plan(16, 8, 4)
    assert scatters_whole_sequence(one, True) and not scatters_whole_sequence(two, True)
    assert not scatters_whole_sequence(one, False) and not scatters_whole_sequence(_plan(8, 8, 4, False), True)
    assert scatters_whole_sequence(_plan(16, 1, 4), True, whole_slice=True)
    cost = chunk_cost(one, 0, 0)
    for kind in ("F", "B"):
        plain, whole = (tensor_transfers(cost, kind, one.remat, whole=w) for w in (False, True))
        assert any(op == "reduce_scatter" for op, *_ in plain) and not any(op == "reduce_scatter" for op, *_ in whole)
        assert [(n, b) for _, n, b in plain] == [(n, b) for _, n, b in whole]
