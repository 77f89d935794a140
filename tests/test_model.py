"""testbed.model.costs vs the JAX model: parameter counts, FLOPs, the stage split."""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.runner import model as jm
from testbed.model import costs as tm
from testbed.errors import InputError
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, Remat, ScheduleSpec


@st.composite
def specs(draw) -> ModelSpec:
    heads = draw(st.integers(1, 4))
    return ModelSpec(layers=draw(st.integers(1, 4)), d_model=heads * draw(st.integers(1, 8)), heads=heads,
                     d_ff=draw(st.integers(1, 40)), seq_len=draw(st.integers(1, 16)), vocab=draw(st.integers(2, 50)),
                     tied_embeddings=draw(st.booleans()))


@given(specs())
def test_param_count_equals_jax_model(spec: ModelSpec) -> None:
    shapes = jax.eval_shape(lambda: jm.init_params(spec, 0))
    assert jm.param_count(shapes) == tm.param_count(spec)
    assert tm.param_count(spec) == (tm.embedding_param_count(spec) + spec.layers * tm.layer_param_count(spec)
                                    + tm.head_param_count(spec))


def test_param_count_reference_gpt2_small() -> None:
    # GPT-2 small with tied embeddings and learned positions: the published 124,439,808 parameters.
    spec = ModelSpec(layers=12, d_model=768, heads=12, d_ff=3072, seq_len=1024, vocab=50257, tied_embeddings=True)
    assert tm.param_count(spec) == 124_439_808


def test_init_is_deterministic_and_counts_match() -> None:
    spec = ModelSpec(layers=2, d_model=16, heads=2, d_ff=32, seq_len=8, vocab=20)
    init = jax.jit(jm.init_params, static_argnums=(0, 1))
    a, b, c = init(spec, 3), init(replace(spec), 3), init(spec, 4)
    assert jm.param_count(a) == tm.param_count(spec)
    for x, y, z in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(c)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        if np.asarray(x).std() > 0:  # weights are random (biases and norms constant): another seed differs
            assert not np.array_equal(np.asarray(x), np.asarray(z))
    tokens, targets = jm.make_batch(spec, 4, 0)
    assert tokens.dtype == np.int32 and tokens.shape == (4, 8)
    np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])


@given(specs(), st.integers(1, 4), st.sampled_from([1, 2]))
def test_chunk_layers_partition(spec: ModelSpec, stages: int, virtual: int) -> None:
    if spec.layers % (stages * virtual):
        with pytest.raises(InputError):
            tm.chunk_layers(spec, stages, virtual)
        return
    chunks = tm.chunk_layers(spec, stages, virtual)
    assert sorted(layer for row in chunks for r in row for layer in r) == list(range(spec.layers))
    # Model chunk c*stages + s sits on stage s as chunk c.
    per = spec.layers // (stages * virtual)
    for s in range(stages):
        for c in range(virtual):
            assert chunks[s][c].start == (c * stages + s) * per
    held = sum(tm.stage_param_count(spec, s, stages, virtual) for s in range(stages))
    copy = spec.vocab * spec.d_model if spec.tied_embeddings and stages * virtual > 1 else 0
    assert held == tm.param_count(spec) + copy


def _plan(spec: ModelSpec, **kw) -> Plan:
    return Plan(model=spec, batch=BatchSpec(global_batch=kw.pop("batch", 4), microbatches=kw.pop("mb", 1)), **kw)


@pytest.mark.parametrize("remat", list(Remat))
def test_flops_equal_jaxpr_count(remat: Remat) -> None:
    spec = ModelSpec(layers=2, d_model=32, heads=4, d_ff=64, seq_len=16, vocab=48)
    plan = _plan(spec, remat=remat)
    params = jax.eval_shape(lambda: jm.init_params(spec, 0))
    tokens = jax.ShapeDtypeStruct((4, 16), np.int32)

    def loss(p, t):
        return jm.forward_loss(p, t, t, spec=spec, remat=remat)

    counted = jm.count_matmul_flops(jax.make_jaxpr(jax.grad(loss))(params, tokens))
    assert tm.step_flops_per_device(plan) == counted
    cost = tm.chunk_cost(plan, 0)
    assert cost.backward_flops == 2 * cost.forward_flops
    assert tm.model_flops_per_step(plan) == 3 * cost.forward_flops


@given(specs(), st.sampled_from([1, 2]), st.sampled_from([1, 2]))
@settings(max_examples=max(1, settings().max_examples * 2 // 3))  # the profile's share: ci 10, thorough 200
def test_chunk_costs_sum_to_model(spec: ModelSpec, tensor: int, stages: int) -> None:
    spec = replace(spec, layers=2, heads=2, d_model=2 * spec.head_size, d_ff=2 * spec.d_ff, vocab=2 * spec.vocab)
    plan = _plan(spec, mesh=MeshSpec(tensor=tensor, stage=stages), batch=4)
    costs = [tm.chunk_cost(plan, s) for s in range(stages)]
    forward = sum(c.forward_flops for c in costs) * tensor
    assert forward * 3 == tm.model_flops_per_step(plan)
    assert sum(c.layers for c in costs) == spec.layers
    assert costs[0].has_embedding and costs[-1].has_head
    assert costs[-1].activation_out_bytes == 0
    assert all(c.tensor_allreduces_forward == 0 for c in costs) if tensor == 1 else \
        sum(c.tensor_allreduces_forward for c in costs) == 2 * spec.layers + 1


def test_activation_bytes_order_and_scaling() -> None:
    spec = ModelSpec(layers=2, d_model=64, heads=4, d_ff=256, seq_len=32, vocab=64)
    act = {r: tm.activation_bytes_per_layer(spec, 2, "fp32", r) for r in Remat}
    assert act[Remat.FULL] < act[Remat.SELECTIVE] < act[Remat.NONE]
    # Linear in microbatch for every mode; selective and full are linear in seq too.
    for r in Remat:
        assert tm.activation_bytes_per_layer(spec, 6, "fp32", r) == 3 * act[r]
    longer = replace(spec, seq_len=96)
    for r in (Remat.SELECTIVE, Remat.FULL):
        assert tm.activation_bytes_per_layer(longer, 2, "fp32", r) == 3 * act[r]
    # Without remat the score matrix (b * heads * seq^2) and the head-major Q, K copies (2 * b * seq * d) stay.
    assert act[Remat.NONE] - act[Remat.SELECTIVE] == 4 * (2 * spec.heads * spec.seq_len ** 2
                                                           + 2 * 2 * spec.seq_len * spec.d_model)
    assert tm.activation_bytes_per_layer(spec, 2, "bf16-mixed", Remat.NONE) * 2 == act[Remat.NONE]
    assert tm.activation_bytes_per_layer(spec, 2, "fp32", Remat.NONE, tensor=2) < act[Remat.NONE]


@pytest.mark.parametrize("tensor", [1, 2, 4])
def test_traffic_splits_the_kept_activations_into_replicated_and_split(tensor: int) -> None:
    """layer_traffic_bytes partitions the no-remat activations; only the split part shrinks with the tensor axis."""
    spec = ModelSpec(layers=4, d_model=64, heads=4, d_ff=256, seq_len=32, vocab=64)
    replicated, split = tm.layer_traffic_bytes(spec, 2, "fp32", tensor)
    assert replicated + split == tm.activation_bytes_per_layer(spec, 2, "fp32", Remat.NONE, tensor)
    one_r, one_s = tm.layer_traffic_bytes(spec, 2, "fp32", 1)
    assert replicated == one_r == 4 * (4 * 64 * 64 + 4 * 64) and split * tensor == one_s
    plan = _plan(spec, mesh=MeshSpec(tensor=tensor, stage=2), batch=2)
    first, last = tm.chunk_cost(plan, 0), tm.chunk_cost(plan, 1)
    n = 2 * spec.seq_len
    # Stage 0 adds the embedding's output (replicated); the last stage the head LN and the fp32 logits.
    assert first.forward_traffic == (2 * one_r + 4 * n * spec.d_model, 2 * split)
    assert last.forward_traffic == (2 * one_r + 4 * n * (2 * spec.d_model + 2),
                                    2 * split + 4 * n * (spec.vocab // tensor + 1))
    assert first.recompute_traffic == (0, 0)
    full = tm.chunk_cost(replace(plan, remat=Remat.FULL), 0)
    assert full.recompute_traffic == (2 * one_r, 2 * split)
    selective = tm.chunk_cost(replace(plan, remat=Remat.SELECTIVE), 0)
    assert selective.recompute_traffic == (0, 2 * 4 * 2 * spec.heads * spec.seq_len ** 2 // tensor)


def test_interleaved_chunk_cost_and_bad_indices() -> None:
    spec = ModelSpec(layers=8, d_model=32, heads=4, d_ff=64, seq_len=16, vocab=48)
    plan = _plan(spec, mesh=MeshSpec(stage=2), schedule=ScheduleSpec(name="interleaved", virtual_stages=2),
                 mb=2)
    assert tm.chunk_cost(plan, 0, 0).has_embedding and not tm.chunk_cost(plan, 0, 1).has_embedding
    assert tm.chunk_cost(plan, 1, 1).has_head and not tm.chunk_cost(plan, 1, 0).has_head
    with pytest.raises(InputError):
        tm.chunk_cost(plan, 2, 0)
    with pytest.raises(InputError):
        tm.chunk_cost(plan, 0, 2)


def test_stage_chunks_compose_to_the_whole_model_and_bf16_is_close() -> None:
    spec = ModelSpec(layers=2, d_model=16, heads=2, d_ff=32, seq_len=8, vocab=40, tied_embeddings=True)
    tokens, targets = jm.make_batch(spec, 2, 1)

    @jax.jit
    def losses():
        p = jm.init_params(spec, 1)
        x = jm.embed(p["embed"], tokens)
        for stage in range(2):
            r = tm.chunk_layers(spec, 2)[stage][0]
            x = jm.stage_forward(p["layers"][r.start:r.stop], x, spec.heads)
        staged = jm.head_loss(p["head"], x, targets, p["embed"]["tokens"])
        whole = jm.forward_loss(p, tokens, targets, spec=spec)
        half = jm.forward_loss(p, tokens, targets, spec=spec, precision="bf16-mixed")
        return staged, whole, half

    staged, whole, half = losses()
    # Gradients w.r.t. the fp32 master parameters are fp32 (shapes only: nothing compiled).
    params = jax.eval_shape(lambda: jm.init_params(spec, 1))
    grads = jax.eval_shape(jax.grad(
        lambda q: jm.forward_loss(q, tokens, targets, spec=spec, precision="bf16-mixed")), params)
    np.testing.assert_allclose(staged, whole, rtol=1e-6)
    # bf16 keeps ~3 significant digits: the loss (about ln(vocab)) agrees to a few parts per thousand.
    np.testing.assert_allclose(half, whole, rtol=1e-2)
    assert all(g.dtype == np.float32 for g in jax.tree.leaves(grads))
