"""testbed.model.gather_lowering: which gathers a compiler lowers as all-reduces and how its combiner merges them
(the rule read from XLA:TPU's recorded compiles, tests/test_xla_tpu_records.py holds the plans to it)."""

from __future__ import annotations

import math

from testbed.model.gather_lowering import NO_LOWERING, Lowering, backward_segments, lowered_merges
from testbed.sim.xla.xla_tpu import gather_allreduce_bytes, gather_lowering
from testbed.plan.io import plan_from_dict
from testbed.topology.compile_target import parse_target, target_topology

MIB = 2 ** 20


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


def test_only_a_whole_slices_gathers_are_lowered():
    topology = target_topology(parse_target("tpu:v5e:8x8"))
    model = {"kind": "gpt", "layers": 2, "d_model": 256, "heads": 4, "d_ff": 1024, "seq_len": 128, "vocab": 1024}
    whole = plan_from_dict({"name": "w", "model": model, "batch": {"global_batch": 64}, "mesh": {"fsdp": 64}})
    part = plan_from_dict({"name": "p", "model": model, "batch": {"global_batch": 64},
                           "mesh": {"fsdp": 16, "tensor": 4}})
    assert gather_lowering(topology, whole, 64) == Lowering(16 * MIB, 120 * MIB)
    assert gather_lowering(topology, part, 16) == NO_LOWERING
