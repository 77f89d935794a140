"""Context parallelism in the runner: plans with ``mesh.context`` 2 and 4 against the single-device reference.

Tokens and targets are laid out in testbed.plan.context's zigzag order and split over ``context``; the
attention layers run ring attention (``testbed/runner/ring_attention.py``), positions (table or RoPE) follow
the order. ``verify`` compares losses and first-step gradients with the fp32 reference at 1e-5, alone
and with data, fsdp, tensor (+ sequence parallelism) and pipeline stages; the option mix of
tests/test_llm.py draws context 2 and 4 among the rest.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, strategies as st

from testbed.runner import devices as dev
from testbed.runner import model as jm
from testbed.runner.ring_attention import context_shards
from testbed.runner.rope import rope
from testbed.runner.step import SpmdTrainer, step_batch
from testbed.testing.strategies import plans
from testbed.runner.train import verify_plan
from testbed.plan.context import context_order
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec

LLAMA = dict(mlp="swiglu", norm="rmsnorm", position="rope", bias=False)
GPT = ModelSpec(layers=2, d_model=16, heads=4, d_ff=24, seq_len=16, vocab=32)
TINY = ModelSpec(layers=2, d_model=16, heads=4, kv_heads=2, d_ff=24, seq_len=16, vocab=32, **LLAMA)
FLASH = ModelSpec(layers=2, d_model=16, heads=4, kv_heads=1, d_ff=24, seq_len=16, vocab=32, attention="flash",
                  attention_block=4, **{**LLAMA, "position": "learned"})


def _plan(model: ModelSpec, **kw) -> Plan:
    mesh = MeshSpec(**{k: kw.pop(k) for k in ("data", "fsdp", "tensor", "stage", "context") if k in kw})
    batch = BatchSpec(global_batch=kw.pop("batch", 8), microbatches=kw.pop("mb", 1))
    return Plan(model=model, batch=batch, mesh=mesh, name="cp", **kw)


def _verifies(plan: Plan) -> None:
    # SPMD plans: the compiled step (already compiled) must hold the ring's collective-permutes too.
    spmd = plan.mesh.stage == 1
    result = verify_plan(plan, dev.select_devices(plan.mesh.size), steps=2, check_hlo=spmd)
    errors = result["errors"]
    assert max(errors["loss_rel"]) <= 1e-5 and max(errors["grad_rel"]) <= 1e-5, errors
    assert result["ok"], (errors, result["collectives"])
    if spmd:
        assert "context: collective-permute" in result["collectives"]["expected"]
        assert result["collectives"]["found"]["collective-permute"] > 0


# Context 2 alone: tests/test_llm.py's option mix draws it first (2 devices, flash, learned positions).
# One model but for the flash one, so the single-device reference compiles twice in all (testbed.runner.step's cache).
@pytest.mark.parametrize("plan", [
    _plan(TINY, context=4),                                                         # RoPE, GQA, SwiGLU, RMSNorm
    _plan(FLASH, data=2, context=2, mb=2),                      # flash ring, learned positions, data x context
    _plan(TINY, tensor=2, context=2, sequence_parallel=True),                       # tensor x context with SP
    _plan(TINY, fsdp=2, context=2, zero=3),                                         # FSDP maps around the ring
    _plan(TINY, stage=2, context=2, mb=2, schedule=ScheduleSpec(name="1f1b")),      # MPMD stages pass CP shards
], ids=["c4-llama", "d2c2-flash", "t2c2-sp", "f2c2-zero3", "s2c2-1f1b"])
def test_context_plans_match_reference(plan: Plan) -> None:
    _verifies(plan)


@pytest.mark.quick  # make test-quick's test of this module
def test_tokens_are_split_in_zigzag_order() -> None:
    # The trainer's batch is the global batch with its sequence dim permuted once, split over `context`:
    # context rank r holds chunks r and 2c-1-r of every sequence.
    plan = _plan(GPT, context=4)
    devices = dev.select_devices(4)
    mesh = dev.build_mesh(dev.plan_placement(plan, devices), devices)
    tokens, targets = SpmdTrainer(plan, mesh)._batch(0)
    order = context_order(16, 4)
    assert list(order[:4]) == [0, 1, 14, 15] and context_shards(plan, mesh).order.tolist() == order.tolist()
    raw_tokens, raw_targets = step_batch(plan, 0)
    np.testing.assert_array_equal(np.asarray(tokens)[0], raw_tokens[:, order])
    np.testing.assert_array_equal(np.asarray(targets)[0], raw_targets[:, order])
    assert {shard.data.shape for shard in tokens.addressable_shards} == {(1, 8, 4)}
    assert context_shards(_plan(GPT), mesh) is None


def test_positions_follow_the_zigzag_order() -> None:
    # With the sequence permuted, the position table's rows and RoPE's angles are permuted the same way:
    # one device, the model's loss on a zigzag-ordered batch equals the loss on the batch in order.
    plan = _plan(GPT, context=2)
    order = context_order(16, 2)
    tokens, targets = jm.make_batch(GPT, 2, 0)
    params = jm.init_params(GPT, 0)

    class Ordered:   # the model's view of ContextShards without a ring: single-device attention in zigzag order
        def __init__(self, order: np.ndarray):
            self.order = order

    assert plan.mesh.context == 2
    x = jm.embed(params["embed"], tokens[:, order], context=Ordered(order))
    np.testing.assert_array_equal(np.asarray(x), np.asarray(jm.embed(params["embed"], tokens))[:, order])
    rot = jax.random.normal(jax.random.key(1), (1, 16, 2, 4))
    np.testing.assert_allclose(np.asarray(rope(rot[:, order], 1e4, order)),
                               np.asarray(rope(rot, 1e4))[:, order], rtol=1e-6, atol=1e-6)


@given(st.data())
def test_strategy_draws_context_plans(data: st.DataObject) -> None:
    # The testing kit's plans strategy draws context degrees when asked (no JAX: plans only).
    plan = data.draw(plans(num_devices=[2, 4, 8], contexts=(1, 2, 4)))
    assert plan.mesh.size in (2, 4, 8) and plan.mesh.size % plan.mesh.context == 0
    assert plan.model.seq_len % (2 * plan.mesh.context) == 0
    assert data.draw(plans(num_devices=4, contexts=(4,))).mesh.context == 4
