"""Flash attention (``model.attention: flash``) in both interpreters.

The runner's blockwise kernel (``testbed/runner/attention.py``) against the dense one
(values and gradients, fp32, 1e-5), its plan keys, and what the simulator
counts for it: the same forward FLOPs, the scores recomputed in the backward
(not in model FLOPs), no ``seq x seq`` activations, workspace or traffic.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import pytest
from hypothesis import example, given, settings, strategies as st

from testbed.runner.attention import flash_attention, plain_attention
from testbed.errors import InputError
from testbed.model import costs as tm
from testbed.model.memory import memory_breakdown
from testbed.plan.io import plan_from_dict, plan_to_dict
from testbed.plan.spec import Attention, BatchSpec, ModelSpec, Plan, Remat
from testbed.topology.io import load_topology

BASE = ModelSpec(layers=2, d_model=64, heads=8, d_ff=128, seq_len=64, vocab=64)
FLASH = replace(BASE, attention="flash", attention_block=16)


def _close(expected: jax.Array, got: jax.Array) -> bool:
    """Relative error <= 1e-5 (an absolute 1e-6 floor for exactly-zero gradients: dK at seq 1)."""
    return float(jnp.linalg.norm((expected - got).ravel())) <= 1e-5 * float(jnp.linalg.norm(expected.ravel())) + 1e-6


@st.composite
def attention_shapes(draw) -> tuple[int, int, int, int, int, int]:
    """(batch, seq, heads, kv_heads, head_dim, block): 1 to 4 blocks of 1 to 8 keys."""
    block, blocks = draw(st.integers(1, 8)), draw(st.integers(1, 4))
    heads = draw(st.sampled_from([1, 2, 4]))
    kv_heads = draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0]))
    return draw(st.integers(1, 2)), block * blocks, heads, kv_heads, draw(st.sampled_from([2, 4, 8])), block


@settings(max_examples=max(1, settings().max_examples // 5))  # each compiles two kernels and their gradients: ci 3
@given(attention_shapes(), st.integers(0, 2 ** 16))
@example((2, 24, 4, 2, 4, 6), 1)   # always: grouped-query heads over 4 blocks
def test_flash_equals_plain_attention(shape: tuple, seed: int) -> None:
    b, s, h, n, d, block = shape
    keys = jax.random.split(jax.random.key(seed), 4)
    q, w = (jax.random.normal(k, (b, s, h, d)) for k in (keys[0], keys[3]))
    k, v = (jax.random.normal(key, (b, s, n, d)) for key in keys[1:3])

    def output_and_grads(fn):
        out, pullback = jax.vjp(fn, q, k, v)
        return (out, *pullback(w))

    plain = jax.jit(lambda: output_and_grads(plain_attention))()
    flash = jax.jit(lambda: output_and_grads(lambda q, k, v: flash_attention(q, k, v, block)))()
    for expected, got in zip(plain, flash):   # output, dq, dk, dv
        assert _close(expected, got)


def test_flash_block_must_divide_seq() -> None:
    q = jnp.zeros((1, 6, 2, 4))
    with pytest.raises(ValueError, match="divide"):
        flash_attention(q, q, q, 4)


def test_flash_keeps_no_seq_by_seq_buffer() -> None:
    # The backward's residuals: q, k, v, the output and one log-sum-exp per row; nothing seq x seq.
    b, s, h, d = 1, 64, 2, 4
    q = jnp.ones((b, s, h, d))
    _, residuals = jax.vjp(lambda q: flash_attention(q, q, q, 16), q)
    sizes = [leaf.size for leaf in jax.tree.leaves(residuals) if hasattr(leaf, "size")]
    assert sizes and max(sizes) <= b * s * h * d and b * h * s * s not in sizes


@pytest.mark.quick  # make test-quick's test of this module
def test_plan_keys_and_block_rule() -> None:
    data = {"model": {"layers": 1, "d_model": 16, "heads": 2, "d_ff": 8, "seq_len": 384, "vocab": 8,
                      "attention": "flash"}, "batch": {"global_batch": 1}}
    plan = plan_from_dict(data)
    assert plan.model.attention is Attention.FLASH and plan.model.flash_block == 128   # largest divisor <= 128
    assert plan_from_dict(plan_to_dict(plan)) == plan
    assert replace(plan.model, seq_len=96).flash_block == 96 and replace(plan.model, seq_len=131).flash_block == 1
    explicit = plan_from_dict({**data, "model": {**data["model"], "attention_block": 64}})
    assert explicit.model.flash_block == 64 and plan_from_dict(plan_to_dict(explicit)) == explicit
    for key, value in (("attention", "ring"), ("attention_block", 100), ("attention_block", 0)):
        with pytest.raises(InputError) as bad:
            plan_from_dict({**data, "model": {**data["model"], key: value}})
        assert bad.value.field == f"model.{key}"


@pytest.mark.parametrize("tensor", [1, 2])
def test_flash_flops_forward_equal_backward_recomputes_scores(tensor: int) -> None:
    b, s, d = 2, BASE.seq_len, BASE.d_model
    scores = 2 * b * s * s * d // tensor          # Q K^T on one tensor rank
    assert tm.layer_forward_flops(FLASH, b, tensor) == tm.layer_forward_flops(BASE, b, tensor)
    # FlashAttention-2: backward = 2.5 x the forward's attention FLOPs (4 matmuls + Q K^T again).
    assert tm.recompute_flops_per_layer(FLASH, b, "none", tensor) == scores
    assert tm.recompute_flops_per_layer(FLASH, b, "selective", tensor) == scores
    full = tm.recompute_flops_per_layer(BASE, b, "full", tensor)
    assert tm.recompute_flops_per_layer(FLASH, b, "full", tensor) == full + scores
    plan = Plan(model=FLASH, batch=BatchSpec(global_batch=4))
    # MFU counts model FLOPs: flash's recompute is not in them.
    assert tm.model_flops_per_step(plan) == tm.model_flops_per_step(replace(plan, model=BASE))
    cost = tm.chunk_cost(plan, 0)
    assert cost.recompute_flops == BASE.layers * 2 * 4 * s * s * d


def test_flash_memory_and_traffic_have_no_scores() -> None:
    b, n, c = 2, 2 * 64, 4
    for remat in ("none", "selective"):
        kept = tm.activation_bytes_per_layer(FLASH, b, "fp32", remat)
        # Selective plain attention keeps exactly the non-score part; flash adds the fp32 row log-sum-exp.
        assert kept == tm.activation_bytes_per_layer(BASE, b, "fp32", "selective") + 4 * b * 8 * 64
    assert tm.activation_bytes_per_layer(FLASH, b, "fp32", "full") == c * n * 64
    replicated, split = tm.layer_traffic_bytes(FLASH, b, "fp32")
    plain_replicated, plain_split = tm.layer_traffic_bytes(BASE, b, "fp32")
    assert replicated == plain_replicated and plain_split - split > c * b * 8 * 64 * 64   # the scores' bytes and more
    # Longer sequences: flash's kept bytes grow linearly, plain's quadratically.
    longer = replace(FLASH, seq_len=128)
    assert tm.activation_bytes_per_layer(longer, b, "fp32", "none") == 2 * tm.activation_bytes_per_layer(
        FLASH, b, "fp32", "none")
    plan = Plan(model=FLASH, batch=BatchSpec(global_batch=4), remat=Remat.SELECTIVE)
    assert tm.chunk_cost(plan, 0).recompute_traffic == (0, 0)
    host = load_topology("host-cpu-8")
    flash, plain = (memory_breakdown(replace(plan, model=m, remat=Remat.NONE), host) for m in (FLASH, BASE))
    assert flash.activations < plain.activations and flash.workspace < plain.workspace
    assert flash.params == plain.params and flash.optimizer == plain.optimizer


def test_dropout_masks_of_flash_are_regenerated() -> None:
    # FlashAttention draws its probability masks again in the backward: only the residual-stream masks count.
    b, n, d = 2, 128, 64
    dropped = replace(FLASH, dropout=0.1)
    assert tm.activation_bytes_per_layer(dropped, b, "fp32", "none") - tm.activation_bytes_per_layer(
        FLASH, b, "fp32", "none") == 2 * n * d

