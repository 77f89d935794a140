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


def _plan(batch: int, fsdp: int, tensor: int, sp: bool = True, remat: str = "selective"):
    return plan_from_dict({"model": {"kind": "gpt", "layers": 2, "d_model": 1024, "heads": 16, "d_ff": 4096,
                                     "seq_len": 2048, "vocab": 32000},
                           "batch": {"global_batch": batch}, "mesh": {"fsdp": fsdp, "tensor": tensor},
                           "sequence_parallel": sp, "remat": remat})


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


def _traced_scatters(batch: int) -> tuple[list, list]:
    """(the traced step's tensor reduce-scatters, those XLA:TPU's compiled collectives keep) of a GPT step with
    sequence parallelism over fsdp 4 x tensor 4 of a v5e 4x4 slice, ``batch`` sequences in all."""
    from testbed.runner.program.plans import trace_plan
    from testbed.sim.graph.traced import compiled_collectives
    from testbed.topology.io import load_topology

    plan = plan_from_dict({"model": {"kind": "gpt", "layers": 1, "d_model": 512, "heads": 8, "d_ff": 2048,
                                     "seq_len": 512, "vocab": 4096},
                           "batch": {"global_batch": batch}, "mesh": {"fsdp": 4, "tensor": 4},
                           "sequence_parallel": True})
    workload = trace_plan(plan)
    compiled = compiled_collectives(workload, load_topology("tpu-v5e-4x4"))
    return ([op for op in workload.ops if op.collective == "reduce_scatter" and "tensor" in op.axes],
            [op for op in compiled.ops if op.collective == "reduce_scatter" and "tensor" in op.axes])


def test_the_traced_tier_all_reduces_one_sequence_a_device_whole():
    """The traced tier reads the same case off the program's shapes (TracedOp.sequence: a reduce-scatter of a
    ``[1, s, d]`` buffer along s) and lowers it (testbed.sim.xla.xla_tpu.lowered_scatters); two sequences a device
    stay reduce-scatters, as the probes compile them."""
    traced, kept = _traced_scatters(4)
    assert traced and all(op.sequence for op in traced) and kept == []
    traced, kept = _traced_scatters(8)
    assert traced and not any(op.sequence for op in traced) and len(kept) == len(traced)


def test_an_fsdp_block_plays_span_by_span_with_whole_all_reduces():
    """The task graph and the analytic tier play an fsdp block's spans each with its collectives after it
    (testbed.sim.step.block_spans); the whole all-reduces take the reduce-scatters' places there, so the action keeps
    its span play rather than all its collectives after its compute."""
    from testbed.model.spans import action_spans
    from testbed.sim.step.block_spans import block_spans

    one = _plan(8, 8, 4, remat="none")
    cost = chunk_cost(one, 0, 0)
    pieces = int(cost.has_embedding) + cost.layers + int(cost.has_head)
    for kind in ("F", "B"):
        spans = action_spans(one, cost, kind, False)
        plain, whole = (tensor_transfers(cost, kind, one.remat, whole=w) for w in (False, True))
        gathered = kind == "B"  # fsdp gathers the head's weight again for the backward
        cut_plain, cut_whole = (block_spans(cost, kind, spans, t, gathered, pieces) for t in (plain, whole))
        assert cut_plain and len(cut_whole) == len(cut_plain)
        ops = [op for block in cut_whole for span in block for op, _, _ in span[2]]
        assert "all_reduce" in ops and "reduce_scatter" not in ops
