"""``runtime.pad_sequence_shards``: sequence parallelism over a tensor degree that does not divide the sequence
(a 12-way model axis at sequence 2048) pads each rank's shard as XLA does, instead of refusing the plan."""

from __future__ import annotations

import pytest

from testbed.errors import InputError
from testbed.explore.analytic import estimate
from testbed.model.activations import activation_bytes_per_layer, sequence_share
from testbed.model.memory import memory_breakdown
from testbed.plan.io import plan_from_dict
from testbed.sim.graph.engine import simulate
from testbed.topology.io import topology_from_dict

D, SEQ, T = 3072, 2048, 12


def _plan(runtime: str = "xla", sp: bool = True, seq: int = SEQ):
    return plan_from_dict({"name": "p", "precision": "bf16-mixed", "remat": "full", "sequence_parallel": sp,
                           "runtime": runtime,
                           "model": {"layers": 4, "d_model": D, "heads": 24, "d_ff": 4 * D, "seq_len": seq,
                                     "vocab": 32256, "attention": "flash"},
                           "batch": {"global_batch": 4, "microbatches": 2}, "mesh": {"tensor": T}}, default_name="p")


def test_an_uneven_shard_is_refused_unless_the_runtime_pads_it():
    with pytest.raises(InputError, match="pad_sequence_shards"):
        _plan(runtime="megatron")
    assert _plan().runtime.pad_sequence_shards


def test_the_padded_shard_holds_ceil_seq_over_t_tokens():
    assert sequence_share(SEQ * 10, SEQ, T) == 171 * 10  # 2048 / 12 rounded up
    assert sequence_share(SEQ * 10, SEQ, 8) == SEQ * 10 // 8
    plan = _plan()
    kept = activation_bytes_per_layer(plan.model, plan.microbatch_size, plan.precision, plan.remat, T, True)
    assert kept == 2 * plan.microbatch_size * 171 * D  # the block input's padded sequence shard, bf16


def test_padding_keeps_the_activations_sharded_and_moves_the_padded_sequence():
    topology = topology_from_dict({"device": {"name": "x", "flops": {"bf16": "400TFLOP/s"}, "memory": "96GB",
                                              "memory_bandwidth": "2TB/s"},
                                   "levels": [{"name": "ici", "size": T, "bandwidth": "100GB/s", "latency": "2us",
                                               "kind": "nvswitch"}]}, default_name="twelve")
    sharded, whole = memory_breakdown(_plan(), topology), memory_breakdown(_plan(sp=False), topology)
    assert sharded.activations < whole.activations / 2
    even = _plan(seq=2052)  # 171 x 12: the padded sequence, evenly split
    step, padded = simulate(_plan(), topology).report, simulate(even, topology).report
    assert step.step_time_s < padded.step_time_s  # the matmuls run on 2048 tokens, the collectives on 2052
    assert step.exposed_comm_s == pytest.approx(padded.exposed_comm_s, rel=0.02)
    assert estimate(_plan(), topology).step_time_s == pytest.approx(step.step_time_s, rel=0.1)
