"""testbed.model.gather_lowering: which gathers a compiler lowers as all-reduces and how its combiner merges them
(the rule read from XLA:TPU's recorded compiles, tests/test_xla_tpu_records.py holds the plans to it)."""

from __future__ import annotations

import math

from testbed.model.gather_lowering import NO_LOWERING, Lowering, backward_segments, lowered_merges
from dataclasses import replace
from pathlib import Path

from testbed.sim.xla.xla_tpu import VECTOR_LANES, gather_allreduce_bytes, gather_lowering, lowers_vectors
from testbed.plan.io import plan_from_dict
from testbed.topology.compile_target import parse_target, target_topology

MIB = 2 ** 20
ROOT = Path(__file__).resolve().parent.parent


def test_small_gathers_merge_within_the_bound_in_order_and_segment():
    sizes = [8.0, 30.0, 8.0, 100.0, 8.0, 200.0]
    lowered, merges = lowered_merges(sizes, [0] * 6, 16.0, 120.0)
    assert lowered == {0, 2, 4}
    assert [(m.nbytes, m.members) for m in merges] == [(24.0, (0, 2, 4))]
    lowered, merges = lowered_merges(sizes, [0, 0, 1, 1, 1, 1], math.inf, 120.0)
    assert [(m.nbytes, m.members) for m in merges] == [(38.0, (0, 1)), (116.0, (2, 3, 4)), (200.0, (5,))]
    assert [m.nbytes for m in lowered_merges([100.0, 30.0], [0, 0], math.inf, 120.0)[1]] == [100.0, 30.0]
    assert lowered_merges(sizes, [0] * 6, 0.0, 120.0) == (set(), [])


def test_backward_segments_hold_the_head_alone_then_two_sets_each():
    sets = [(True, "h"), (True, "h"), (False, (2, 0)), (False, (2, 1)), (False, (1, 0)), (False, (1, 1)),
            (False, (0, 1))]
    assert backward_segments(sets) == [0, 0, 1, 1, 2, 2, 3]


def test_the_slices_that_lower_gathers():
    bound = {t: gather_allreduce_bytes(target_topology(parse_target(t)))
             for t in ("tpu:v5e:2x2", "tpu:v5e:4x4", "tpu:v5e:8x8", "tpu:v5e:16x16", "tpu:v5p:2x2x2",
                       "tpu:v5p:4x4x4", "tpu:v5p:8x8x16")}
    assert bound == {"tpu:v5e:2x2": 0.0, "tpu:v5e:4x4": 0.0, "tpu:v5e:8x8": 16 * MIB, "tpu:v5e:16x16": 16 * MIB,
                     "tpu:v5p:2x2x2": 0.0, "tpu:v5p:4x4x4": math.inf, "tpu:v5p:8x8x16": math.inf}


def test_only_a_whole_slices_gathers_are_lowered_by_size_misaligned_vectors_anywhere():
    topology = target_topology(parse_target("tpu:v5e:8x8"))
    model = {"kind": "gpt", "layers": 2, "d_model": 256, "heads": 4, "d_ff": 1024, "seq_len": 128, "vocab": 1024}
    whole = plan_from_dict({"name": "w", "model": model, "batch": {"global_batch": 64}, "mesh": {"fsdp": 64}})
    part = plan_from_dict({"name": "p", "model": model, "batch": {"global_batch": 64},
                           "mesh": {"fsdp": 16, "tensor": 4}})
    assert gather_lowering(topology, whole, 64) == Lowering(16 * MIB, 120 * MIB, VECTOR_LANES)
    assert gather_lowering(topology, part, 16) == Lowering(0.0, 120 * MIB, VECTOR_LANES)
    assert gather_lowering(topology, part, 1) == NO_LOWERING
    assert gather_lowering(replace(topology, device=replace(topology.device, buffer_rules="xla")), part,
                           16) == NO_LOWERING


def test_vectors_are_lowered_beside_the_size_bound():
    sizes = [8.0, 30.0, 8.0, 100.0]
    lowered, merges = lowered_merges(sizes, [0] * 4, 0.0, 120.0, frozenset({1, 3}))
    assert lowered == {1, 3} and [(m.nbytes, m.members) for m in merges] == [(30.0, (1,)), (100.0, (3,))]
    _, merges = lowered_merges(sizes, [0] * 4, 0.0, 120.0, frozenset({0, 1, 2}))
    assert [(m.nbytes, m.members) for m in merges] == [(46.0, (0, 1, 2))]


def test_a_plans_misaligned_vectors_are_gathered_by_merged_all_reduces():
    """llama4k-fsdp256-tensor4's norms (4096 over 256 chips: 16 a device) gather as XLA:TPU's four all-reduces: the
    forward's together, the head's backward alone, each layer's recomputation and gradient sets together; its
    128-aligned biases' (gpt2k-fsdp16-tensor4-sp's ``mlp/b1``: 128 a device) stay all-gathers."""
    from testbed.compiled.compare import predicted_collectives
    from testbed.compiled.records import load_record

    record = load_record(ROOT / "benchmarks" / "xla_tpu" / "llama4k-fsdp256-tensor4.json")
    mine = predicted_collectives(record.plan, target_topology(record.target))
    gathers = {c.kind: c for c in record.collectives if c.axes == "fsdp"}["all-gather"]
    assert mine["fsdp all-gather"] == {"count": gathers.count, "bytes": gathers.bytes} == {"count": 37,
                                                                                          "bytes": 674758656}
    # The loss, the norms' four gather merges and their gradients' one all-reduce (xla_tpu_vectors.py's probes).
    assert mine["fsdp all-reduce"]["count"] == 1 + 4 + 1
    assert lowers_vectors(target_topology(parse_target("tpu:v5e:2x2")))
