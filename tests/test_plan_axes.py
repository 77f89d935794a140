"""The context and expert mesh axes and the MoE model keys: validation, round trip and the zigzag split."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from testbed.errors import InputError
from testbed.model.moe import moe_layers
from testbed.plan.context import context_chunks, context_order, context_positions
import yaml

from testbed.plan.io import dump_plan, plan_from_dict
from testbed.plan.placement import place
from testbed.plan.spec import MESH_AXES, Axis

MODEL = {"layers": 4, "d_model": 32, "heads": 4, "d_ff": 64, "seq_len": 16, "vocab": 64}


def plan(mesh=None, model=None, batch=8, **top):
    return plan_from_dict({"model": {**MODEL, **(model or {})}, "batch": {"global_batch": batch},
                           "mesh": mesh or {}, **top})


@given(st.integers(1, 8), st.integers(1, 16))
def test_zigzag_gives_every_rank_two_chunks_and_equal_causal_work(context, chunk):
    seq = 2 * context * chunk
    order = context_order(seq, context)
    assert sorted(order.tolist()) == list(range(seq))  # a permutation: every token on exactly one rank
    work = []
    for r in range(context):
        pos = context_positions(seq, context, r)
        assert len(pos) == seq // context
        assert np.array_equal(pos, order[r * len(pos):(r + 1) * len(pos)])
        work.append(int((pos + 1).sum()))  # causal attention: token i attends to i + 1 keys
    assert len(set(work)) == 1
    assert sum(work) == seq * (seq + 1) // 2
    assert context_chunks(seq, context)[0] == (0, 2 * context - 1)


def test_one_context_rank_holds_the_sequence_in_order():
    assert np.array_equal(context_order(12, 1), np.arange(12))


def test_axes_are_canonical_and_placed_with_tensor_innermost():
    assert MESH_AXES == (Axis.STAGE, Axis.DATA, Axis.FSDP, Axis.EXPERT, Axis.CONTEXT, Axis.TENSOR)
    p = plan({"context": 2, "tensor": 2, "data": 2})
    placement = place(p, num_devices=8)
    assert placement.groups("tensor")[0] == (0, 1)
    assert placement.groups("context")[0] == (0, 2)
    assert placement.groups("data")[0] == (0, 4)


def test_an_order_may_leave_out_axes_of_degree_one():
    p = plan({"data": 2, "tensor": 2, "order": ["stage", "data", "fsdp", "tensor"]})
    assert set(p.mesh.order) == set(Axis)
    assert p.mesh.order[-2:] == (Axis.DATA, Axis.TENSOR) or p.mesh.order[-1] == Axis.TENSOR
    with pytest.raises(InputError) as err:
        plan({"context": 2, "order": ["stage", "data", "fsdp", "tensor"]})
    assert err.value.field == "mesh.order"


@pytest.mark.parametrize("mesh, model, field", [
    ({"context": 3}, {}, "mesh.context"),                          # 16 % 6
    ({"expert": 2}, {}, "mesh.expert"),                            # a dense model
    ({"expert": 4}, {"experts": 6}, "mesh.expert"),                # 6 % 4
    ({}, {"shared_experts": 1}, "model.shared_experts"),           # MoE key on a dense model
    ({}, {"experts": 4, "top_k": 5}, "model.top_k"),
    ({}, {"experts": 4, "first_dense_layers": 4}, "model.first_dense_layers"),
    ({}, {"experts": 4, "capacity_factor": 0}, "model.capacity_factor"),
    ({"tensor": 4}, {"experts": 4, "expert_d_ff": 6}, "model.expert_d_ff"),
])
def test_bad_axes_and_moe_keys_name_their_field(mesh, model, field):
    with pytest.raises(InputError) as err:
        plan(mesh, model)
    assert err.value.field == field


def test_the_batch_is_split_over_expert_like_data():
    p = plan({"data": 2, "expert": 2}, {"experts": 4}, batch=8)
    assert p.replicas == 4 and p.microbatch_size == 2
    with pytest.raises(InputError) as err:
        plan({"data": 2, "expert": 2}, {"experts": 4}, batch=6)
    assert err.value.field == "batch.global_batch"


def test_sequence_parallel_splits_each_context_ranks_tokens():
    plan({"context": 2, "tensor": 4}, sequence_parallel=True)  # 16 / 2 = 8 tokens per rank, 4 tensor ranks
    with pytest.raises(InputError):
        plan({"context": 4, "tensor": 4}, {"seq_len": 24}, sequence_parallel=True)  # 24 / 4 = 6 % 4


def test_moe_layers_follow_the_one_rule():
    p = plan(model={"layers": 6, "experts": 4, "first_dense_layers": 1, "moe_every": 2})
    assert [p.model.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]
    assert moe_layers(p.model) == 2
    dense = plan()
    assert moe_layers(dense.model) == 0 and not dense.model.is_moe_layer(0)


def test_the_new_keys_round_trip():
    p = plan({"context": 2, "expert": 2, "data": 2},
             {"experts": 4, "top_k": 1, "expert_d_ff": 32, "shared_experts": 1, "capacity_factor": 1.25},
             expert_imbalance=1.5)
    back = plan_from_dict(yaml.safe_load(dump_plan(p)), default_name=p.name)
    assert back == p


@pytest.mark.parametrize("mesh", [{"data": 4, "expert": 4, "context": 2, "tensor": 2},
                                  {"expert": 8, "context": 4, "tensor": 2, "stage": 2}])
def test_shrinking_keeps_the_expert_and_context_axes_valid(mesh):
    from testbed.explore.space import shrink_plan

    big = plan(mesh, {"experts": 8, "top_k": 2, "shared_experts": 2, "seq_len": 32, "layers": 8},
               batch=64, sequence_parallel=True)
    small = shrink_plan(big, 8)
    assert small.mesh.size == 8
    assert small.model.experts % small.mesh.expert == 0 and small.model.top_k <= small.model.experts
    assert small.model.seq_len % (2 * small.mesh.context) == 0 and small.sequence_parallel
    assert small.mesh.expert * small.mesh.context > 1  # the data axis shrinks first
