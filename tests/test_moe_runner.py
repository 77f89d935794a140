"""Runner: the mixture-of-experts layer (testbed.runner.moe) and MoE plans with expert parallelism.

The layer is checked against an independent dense reference on one device: every expert run on every
token, the capacity rule re-derived with a Python loop over (choice, position), outputs, the per-sequence
load-balancing loss and all gradients at fp32 (1e-5), with expert parallelism 2, 4 and 8 (all-to-all
over the ``expert`` axis) mixed with data and tensor axes; then whole plans (expert x data x tensor x
stage) through ``verify_plan`` against the single-device reference trainer.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from testbed.runner import devices as dev, model, moe
from testbed.runner.moe_folded import FoldedExpertShards
from testbed.testing.compare import assert_outputs_equal
from testbed.testing.strategies import moe_plans
from testbed.runner.train import verify_plan
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec

_AXES = ("data", "expert", "tensor")


def _mesh(data: int, expert: int, tensor: int) -> jax.sharding.Mesh:
    devices = np.asarray(jax.devices()[:data * expert * tensor]).reshape(data, expert, tensor)
    return jax.sharding.Mesh(devices, _AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def _params(key: jax.Array, d: int, e: int, fe: int, swiglu: bool, shared: int, bias: bool) -> dict:
    names = ["router", "w1", "w2"] + (["w3"] if swiglu else []) + (["b1", "b2"] + (["b3"] if swiglu else [])
                                                                   if bias else [])
    if shared:
        names += ["shared_w1", "shared_w2"] + (["shared_w3"] if swiglu else [])
    shapes = {"router": (d, e), "w1": (e, d, fe), "w3": (e, d, fe), "w2": (e, fe, d), "b1": (e, fe), "b3": (e, fe),
              "b2": (e, d), "shared_w1": (d, shared * fe), "shared_w3": (d, shared * fe),
              "shared_w2": (shared * fe, d)}
    keys = jax.random.split(key, len(names))
    # Router scale 1: well-separated probabilities (a tie within rounding would make the top-k fragile).
    return {n: (1.0 if n == "router" else 0.3) * jax.random.normal(k, shapes[n], jnp.float32)
            for n, k in zip(names, keys)}


def _kept(chosen: np.ndarray, experts: int, capacity: int) -> np.ndarray:
    """The capacity rule re-derived: per sequence, choice rank by choice rank, tokens in order."""
    rows, seq, k = chosen.shape
    kept = np.zeros(chosen.shape, bool)
    for b in range(rows):
        load = [0] * experts
        for j in range(k):
            for s in range(seq):
                e = int(chosen[b, s, j])
                kept[b, s, j] = load[e] < capacity
                load[e] += 1
    return kept


def _dense_reference(p: dict, h: jax.Array, cfg: moe.MoeConfig, chosen: np.ndarray, kept: np.ndarray
                     ) -> tuple[jax.Array, jax.Array]:
    """Every expert on every token, the routed ones picked by a mask: (output, per-sequence aux)."""
    probs = jax.nn.softmax(jnp.einsum("bsd,de->bse", h, p["router"]), axis=-1)
    top = jnp.take_along_axis(probs, jnp.asarray(chosen), axis=-1)
    gates = top / jnp.sum(top, -1, keepdims=True) if cfg.top_k > 1 else top
    mask = jax.nn.one_hot(chosen, cfg.experts) * (gates * jnp.asarray(kept, jnp.float32))[..., None]
    weights = jnp.sum(mask, axis=2)                                                # [b, s, E]
    up = jnp.einsum("bsd,edf->bsef", h, p["w1"]) + (p["b1"] if "b1" in p else 0)
    if cfg.swiglu:
        hidden = jax.nn.silu(up) * (jnp.einsum("bsd,edf->bsef", h, p["w3"]) + (p["b3"] if "b3" in p else 0))
    else:
        hidden = jax.nn.gelu(up)
    every = jnp.einsum("bsef,efd->bsed", hidden, p["w2"]) + (p["b2"] if "b2" in p else 0)
    out = jnp.einsum("bsed,bse->bsd", every, weights)
    if "shared_w1" in p:
        up = h @ p["shared_w1"]
        hidden = jax.nn.silu(up) * (h @ p["shared_w3"]) if cfg.swiglu else jax.nn.gelu(up)
        out = out + hidden @ p["shared_w2"]
    f = np.stack([np.bincount(c.ravel(), minlength=cfg.experts) for c in chosen]) / (chosen.shape[1] * cfg.top_k)
    aux = cfg.aux_coef * cfg.experts * jnp.sum(jnp.asarray(f, jnp.float32) * jnp.mean(probs, axis=1), axis=-1)
    return out, aux


def _close(got: object, want: object, mesh: object) -> None:
    """Every leaf within 1e-5 of the reference relative to its largest value (the verify metric:
    ``max|a - b| / max|b|``, testbed.runner.train), else the comparison's diagnosis of the worst elements."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape or np.max(np.abs(g - w)) > 1e-5 * max(np.max(np.abs(w)), 1e-30):
            assert_outputs_equal(got, want, rtol=1e-5, atol=1e-5 * max(np.max(np.abs(w)), 1e-30), mesh=mesh)
            raise AssertionError(f"a leaf of shape {w.shape} differs by more than 1e-5 of its largest value")


def _value_and_grads(layer, *args: jax.Array) -> tuple:
    """``(output, aux)`` of ``layer(p, h)`` and the gradients of ``sum(out * g) + sum(aux * w)`` in p and h."""
    def objective(p: dict, h: jax.Array, g: jax.Array, w: jax.Array) -> tuple:
        out, aux = layer(p, h)
        return jnp.sum(out * g) + jnp.sum(aux * w), (out, aux)

    (_, outs), grads = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(*args)
    return outs, grads


@st.composite
def _cases(draw: st.DrawFn) -> dict:
    expert = draw(st.sampled_from([2, 4, 8]))
    data, tensor = draw(st.sampled_from([(a, b) for a in (1, 2, 4) for b in (1, 2) if a * b * expert <= 8]))
    return dict(expert=expert, data=data, tensor=tensor, top_k=draw(st.sampled_from([1, 2])),
                per_rank=draw(st.sampled_from([1, 2])), capacity_factor=draw(st.sampled_from([None, 0.5, 1.0, 1.5])),
                swiglu=draw(st.booleans()), shared=draw(st.sampled_from([0, 1, 2])), bias=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)))


@settings(max_examples=max(1, settings().max_examples // 7))  # each compiles two layers and gradients: ci 2
@given(_cases())
def test_layer_matches_dense_reference(case: dict) -> None:
    """Output, aux loss and gradients of the expert-parallel layer equal the dense single-device reference."""
    expert, data, tensor = case["expert"], case["data"], case["tensor"]
    e = expert * case["per_rank"]
    rows, seq, d, fe = data * expert, 8, 16, 8
    cf = case["capacity_factor"]
    cap = seq if cf is None else max(1, min(seq, math.ceil(cf * seq * case["top_k"] / e)))
    cfg = moe.MoeConfig(experts=e, top_k=case["top_k"], capacity=cap, swiglu=case["swiglu"], aux_coef=0.01)
    kp, kh, kg, kw = jax.random.split(jax.random.key(case["seed"]), 4)
    p = _params(kp, d, e, fe, case["swiglu"], case["shared"], case["bias"])
    h = jax.random.normal(kh, (rows, seq, d), jnp.float32)
    g = jax.random.normal(kg, (rows, seq, d), jnp.float32)
    w = jax.random.uniform(kw, (rows,), jnp.float32)

    reference = jax.device_put((p, h, g, w), jax.devices()[0])
    chosen = np.asarray(jax.jit(lambda h, r: moe.route(h, r, cfg).experts)(reference[1], reference[0]["router"]))
    kept = _kept(chosen, e, cap)
    dense = lambda p, h: _dense_reference(p, h, cfg, chosen, kept)  # noqa: E731
    want = jax.jit(lambda *a: _value_and_grads(dense, *a))(*reference)

    mesh = _mesh(data, expert, tensor)
    tensor_dims = {"w1": 2, "w3": 2, "w2": 1, "b1": 1, "b3": 1, "shared_w1": 1, "shared_w3": 1, "shared_w2": 0}
    specs = {n: jax.P(*[("expert" if i == 0 and n in ("w1", "w3", "w2", "b1", "b3", "b2") else None)
                        if i != tensor_dims.get(n) else "tensor" for i in range(a.ndim)]) for n, a in p.items()}
    shard = lambda tree, spec: jax.device_put(tree, jax.NamedSharding(mesh, spec))  # noqa: E731
    ps = {n: shard(a, specs[n]) for n, a in p.items()}
    rows_spec = jax.P(("data", "expert"))
    hs, gs, ws = shard(h, rows_spec), shard(g, rows_spec), shard(w, rows_spec)
    shards = moe.ExpertShards(mesh)
    layer = lambda p, h: moe.moe_mlp(p, h, cfg, shards)  # noqa: E731
    got = jax.jit(lambda *a: _value_and_grads(layer, *a))(ps, hs, gs, ws)
    _close(got, want, mesh)
    if cf is not None and cf < 1:
        assert not kept.all()  # the case exercises drops


@pytest.mark.quick  # make test-quick's test of this module
def test_capacity_drops_by_choice_then_position() -> None:
    """Two tokens choosing the same expert with capacity 1: the earlier keeps it; first choices go first."""
    cfg = moe.MoeConfig(experts=2, top_k=2, capacity=1, swiglu=False, aux_coef=0.0)
    router = jnp.asarray([[4.0, 0.0], [0.0, 4.0]])
    h = jnp.asarray([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])  # tokens 0, 1 prefer expert 0; token 2 expert 1
    r = moe.route(h, router, cfg)
    assert r.experts[0].tolist() == [[0, 1], [0, 1], [1, 0]]
    # expert 0: token 0 first choice kept (slot 0), token 1 first choice dropped, token 2's second dropped;
    # expert 1: token 2's first choice kept, tokens 0 and 1's second choices dropped.
    assert r.slots[0].tolist() == [[0, 1], [1, 1], [0, 1]]
    assert np.allclose(np.asarray(r.gates).sum(-1), 1.0)


def test_top1_gate_is_the_probability_and_balanced_aux_is_the_coefficient() -> None:
    cfg = moe.MoeConfig(experts=4, top_k=1, capacity=8, swiglu=False, aux_coef=0.01)
    r = moe.route(jnp.zeros((1, 8, 4)), jnp.zeros((4, 4)), cfg)  # uniform probabilities: every tie to expert 0
    assert np.allclose(r.gates, 0.25) and (np.asarray(r.experts) == 0).all()
    # all assignments on expert 0 with P_i = 1/4: E x f_0 x P_0 = 4 x 1 x 1/4 = 1 x the coefficient
    assert np.allclose(r.aux, 0.01)


def test_aux_into_grads_adds_the_weight_only_in_the_backward() -> None:
    x, aux = jnp.ones((2, 3)), jnp.asarray([0.5, 2.0])
    f = lambda x, a: jnp.sum(moe.aux_into_grads(x, a, 0.25) * 3.0)  # noqa: E731
    assert float(f(x, aux)) == 18.0
    gx, ga = jax.grad(f, argnums=(0, 1))(x, aux)
    assert np.allclose(gx, 3.0) and np.allclose(ga, 0.25)


# -- whole plans: the trainers against the single-device reference ---------------------------------------

def _verify(plan: Plan, check_hlo: bool = False) -> None:
    result = verify_plan(plan, dev.select_devices(plan.mesh.size), steps=1, check_hlo=check_hlo)
    assert result.ok, (plan.mesh, plan.model, result.errors, result.collectives)


@pytest.mark.slow  # whole drawn MoE plans, trainer and reference: the layer property and the DeepSeek plan stay in make test
@settings(max_examples=max(1, settings().max_examples // 15))  # a trainer and the reference each: ci 1
@given(moe_plans())
def test_drawn_moe_plans_match_reference(plan: Plan) -> None:
    """Expert 2, 4 and 8 with data, tensor and pipeline stages (1F1B, GPipe): loss, gradients, parameters."""
    _verify(plan)


@pytest.mark.slow  # a pipelined expert x tensor plan end to end (minutes on 2 cores)
def test_mixtral_shaped_model_with_expert_tensor_and_pipeline() -> None:
    """A tiny Mixtral: GQA, SwiGLU, RMSNorm, RoPE, no biases, 8 experts top-2; expert 2 x tensor 2 x stage 2
    (interleaved 1F1B would need more layers; 1F1B here)."""
    spec = ModelSpec(layers=2, d_model=32, heads=4, kv_heads=2, d_ff=32, seq_len=8, vocab=64, mlp="swiglu",
                     norm="rmsnorm", position="rope", bias=False, experts=8, top_k=2, router_aux_loss=0.02)
    _verify(Plan(name="mixtral-tiny", model=spec, mesh=MeshSpec(expert=2, tensor=2, stage=2),
                 batch=BatchSpec(global_batch=8, microbatches=4), schedule=ScheduleSpec(name="1f1b")))


def test_deepseek_style_model_with_expert_8() -> None:
    """DeepSeekMoE-style: fine-grained experts (16 of width d_ff / 4, top-4), 2 shared experts, the first layer
    dense, capacity 1.0 (drops); expert 8 over all devices, two microbatches; the compiled step all-to-alls."""
    spec = ModelSpec(layers=3, d_model=32, heads=4, d_ff=64, seq_len=8, vocab=64, mlp="swiglu", norm="rmsnorm",
                     position="rope", bias=False, experts=16, top_k=4, expert_d_ff=16, shared_experts=2,
                     first_dense_layers=1, capacity_factor=1.0)
    _verify(Plan(name="deepseek-tiny", model=spec, mesh=MeshSpec(expert=8),
                 batch=BatchSpec(global_batch=16, microbatches=2)), check_hlo=True)


def test_load_balancing_loss_reaches_the_router_gradient() -> None:
    """The objective's router gradient is the language-model one plus ``1 / batch`` x the gradient of the
    sequences' load-balancing losses (re-derived here from the block's normed input)."""
    base = ModelSpec(layers=1, d_model=16, heads=2, d_ff=32, seq_len=8, vocab=32, experts=4, top_k=2)
    params = model.init_params(base, 0)
    tokens, targets = model.make_batch(base, 4, 1)
    real = moe.moe_mlp

    def normed_input(params: dict) -> jax.Array:
        """The MoE layer's input, returned from the same trace that sees it."""
        seen = []
        moe.moe_mlp = lambda p, h, *args: (seen.append(h), real(p, h, *args))[1]
        try:
            model.forward_loss(params, tokens, targets, spec=base)
        finally:
            moe.moe_mlp = real
        return seen[0]

    h = jax.jit(normed_input)(params)
    grads = {coef: jax.jit(jax.grad(functools.partial(
        model.forward_loss, spec=dataclasses.replace(base, router_aux_loss=coef))))(params, tokens, targets)
        for coef in (0.0, 0.5)}
    cfg = moe.moe_config(dataclasses.replace(base, router_aux_loss=0.5))
    want = jax.grad(lambda r: jnp.mean(moe.route(h, r, cfg).aux))(params["layers"][0]["moe"]["router"])
    got = grads[0.5]["layers"][0]["moe"]["router"] - grads[0.0]["layers"][0]["moe"]["router"]
    assert float(jnp.max(jnp.abs(want))) > 1e-4
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)


def test_bf16_expert_parallelism_with_data_replicas_is_refused_on_cpu() -> None:
    """XLA:CPU aborts the process on this combination: the runner refuses it first (exit 2, naming the field)."""
    from testbed.runner.train import build_trainer
    from testbed.errors import InputError

    spec = ModelSpec(layers=1, d_model=16, heads=2, d_ff=32, seq_len=8, vocab=32, experts=2)
    plan = Plan(name="moe-bf16", model=spec, mesh=MeshSpec(expert=2, data=2), precision="bf16-mixed",
                batch=BatchSpec(global_batch=4))
    with pytest.raises(InputError) as err:
        build_trainer(plan, dev.select_devices(4))
    assert err.value.field == "precision"


# -- MoE parallel folding (mesh.expert_tensor 1): each expert whole on one rank of expert x tensor ----------

@pytest.mark.parametrize("expert, data, tensor, shared, bias, swiglu, cf", [
    (1, 1, 2, 0, False, False, None),     # 2 devices: the tensor ranks alone are the expert group, no all-to-all
    (2, 1, 2, 1, True, True, 0.5),        # 4: all-to-all over expert, drops, shared experts in the map
    (2, 2, 2, 2, False, True, 1.0),       # 8: data replicas too
    (1, 2, 4, 1, True, False, None),      # 8: four tensor ranks folded
], ids=["t2", "e2-t2", "d2-e2-t2", "d2-t4"])
def test_folded_layer_matches_dense_reference(expert, data, tensor, shared, bias, swiglu, cf) -> None:
    """Output, aux loss and gradients of the folded layer (experts split over ``("expert", "tensor")``, whole;
    shared experts split over ``tensor``) equal the dense single-device reference at 1e-5."""
    e, top_k = 2 * expert * tensor, 2
    rows, seq, d, fe = data * expert, 8, 16, 8
    cap = seq if cf is None else max(1, min(seq, math.ceil(cf * seq * top_k / e)))
    cfg = moe.MoeConfig(experts=e, top_k=top_k, capacity=cap, swiglu=swiglu, aux_coef=0.01)
    kp, kh, kg, kw = jax.random.split(jax.random.key(7), 4)
    p = _params(kp, d, e, fe, swiglu, shared, bias)
    h, g = (jax.random.normal(k, (rows, seq, d), jnp.float32) for k in (kh, kg))
    w = jax.random.uniform(kw, (rows,), jnp.float32)
    reference = jax.device_put((p, h, g, w), jax.devices()[0])
    chosen = np.asarray(jax.jit(lambda h, r: moe.route(h, r, cfg).experts)(reference[1], reference[0]["router"]))
    dense = lambda p, h: _dense_reference(p, h, cfg, chosen, _kept(chosen, e, cap))  # noqa: E731
    want = jax.jit(lambda *a: _value_and_grads(dense, *a))(*reference)

    mesh = _mesh(data, expert, tensor)
    shared_dims = {"shared_w1": 1, "shared_w3": 1, "shared_w2": 0}
    specs = {n: jax.P(*[("expert", "tensor") if i == 0 and n in moe._EXPERT_KEYS else
                        "tensor" if i == shared_dims.get(n) else None for i in range(a.ndim)]) for n, a in p.items()}
    shard = lambda tree, spec: jax.device_put(tree, jax.NamedSharding(mesh, spec))  # noqa: E731
    rows_spec = jax.P(("data", "expert"))
    args = ({n: shard(a, specs[n]) for n, a in p.items()}, *(shard(x, rows_spec) for x in (h, g, w)))
    shards = FoldedExpertShards(mesh, folded=True)
    assert shards.is_folded and shards.weight_axes == (("expert",) if expert > 1 else ()) + ("tensor",)
    layer = lambda p, h: moe.moe_mlp(p, h, cfg, shards)  # noqa: E731
    _close(jax.jit(lambda *a: _value_and_grads(layer, *a))(*args), want, mesh)


def _folded_spec(shared: int = 1) -> ModelSpec:
    return ModelSpec(layers=2, d_model=32, heads=4, kv_heads=2, d_ff=32, seq_len=8, vocab=64, mlp="swiglu",
                     norm="rmsnorm", position="rope", bias=False, experts=8, top_k=2, shared_experts=shared)


def test_folded_plan_matches_reference() -> None:
    """A whole plan with ``mesh.expert_tensor: 1`` (tensor 2 x expert 2, attention tensor-parallel, the MoE layers'
    eight experts over the four ranks whole): loss, gradients and parameters equal the single-device trainer's;
    the compiled step all-to-alls."""
    _verify(Plan(name="folded", model=_folded_spec(), mesh=MeshSpec(tensor=2, expert=2, expert_tensor=1),
                 batch=BatchSpec(global_batch=8, microbatches=2)), check_hlo=True)


@pytest.mark.slow  # three trainers and their references (minutes on 2 cores)
@pytest.mark.parametrize("mesh, extra", [
    (dict(tensor=2, fsdp=2, expert_tensor=1), {}),                       # ZeRO-3 blocks around the folded map
    (dict(tensor=2, expert=2, stage=2, expert_tensor=1), {}),            # pipeline stages
    (dict(tensor=2, data=2, expert=2, expert_tensor=1), dict(zero=1, sequence_parallel=True)),
], ids=["fsdp", "stages", "zero1-sp"])
def test_folded_plans_with_other_axes_match_reference(mesh, extra) -> None:
    _verify(Plan(name="folded", model=_folded_spec(), mesh=MeshSpec(**mesh),
                 batch=BatchSpec(global_batch=8, microbatches=2), **extra))


def test_folded_map_flops_are_the_model_gemms() -> None:
    """The matmul FLOPs traced inside the folded map (one rank's shapes) are the routed and shared experts' GEMMs
    of testbed.model.gemm.moe_gemms for the plan (whole experts, ``E / (expert x tensor)`` of them), plus the
    gate-weighted combine (``2 rows seq k d``, outside the cost model: it is no GEMM of a weight)."""
    from testbed.model import moe as cost_moe
    from testbed.model.gemm import gemm_flops, moe_gemms

    spec = dataclasses.replace(_folded_spec(), capacity_factor=1.0)
    plan = Plan(model=spec, mesh=MeshSpec(tensor=2, expert=2, expert_tensor=1), batch=BatchSpec(global_batch=4))
    mesh = _mesh(1, 2, 2)
    cfg = moe.moe_config(spec)
    rows = plan.microbatch_size
    params = jax.eval_shape(lambda: model.init_params(spec, 0))["layers"][0]["moe"]
    h = jax.ShapeDtypeStruct((rows * 2, spec.seq_len, spec.d_model), jnp.float32)
    shards = FoldedExpertShards(mesh, folded=True)
    jaxpr = jax.make_jaxpr(lambda p, h: moe.moe_mlp(p, h, cfg, shards)[0])(params, h)
    maps = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "shard_map"]
    folded = max(maps, key=lambda e: model.count_matmul_flops(e.params["jaxpr"]))
    ins, outs = moe_gemms(spec, cost_moe.local_tokens(plan), cost_moe.expert_tokens(plan), 2, 2, 1)
    combine = 2 * rows * spec.seq_len * spec.top_k * spec.d_model
    assert model.count_matmul_flops(folded.params["jaxpr"]) == gemm_flops(tuple(ins[1:] + outs)) + combine
    assert ins[1].batch == spec.experts // 4 and ins[1].n == spec.d_ff  # whole experts, a quarter of them each


@pytest.mark.slow  # two 8-device SPMD steps compiled
def test_folded_step_moves_the_simulated_all_to_all_bytes() -> None:
    """XLA's compiled step of a folded plan (data 2 x expert 2 x tensor 2) moves over ``expert`` exactly the
    all-to-all bytes testbed.sim.graph.program's task graph carries (``1 / tensor`` of the unfolded plan's), and over
    ``tensor`` fewer bytes than the unfolded plan (whose expert map all-reduces the capacity-padded outputs)."""
    from testbed.plan.placement import place
    from testbed.plan.spec import Axis
    from testbed.runner import reshards
    from testbed.runner.check_sharding import compiled_spmd
    from testbed.sim.graph.program import axis_groups, build_program
    from testbed.topology.io import load_topology

    host = load_topology("host-cpu-8")
    spec = dataclasses.replace(_folded_spec(), capacity_factor=1.0)
    moved = {}
    for et in (1, None):
        plan = Plan(name="bytes", model=spec, mesh=MeshSpec(tensor=2, expert=2, data=2, expert_tensor=et),
                    batch=BatchSpec(global_batch=8))
        placement = place(plan, host)
        experts = {g for gs in axis_groups(placement, [Axis.EXPERT]).values() for g in gs}
        a2a = [t for t in build_program(plan, placement).tasks if t.op == "all_to_all"]
        assert all(tuple(t.group) in experts for t in a2a)
        simulated = sum(t.nbytes * t.count for t in a2a if t.device == a2a[0].device)  # one representative
        mesh, text = compiled_spmd(plan)
        compiled = reshards.compiled_bytes(text, mesh.devices.shape, mesh.axis_names)
        assert compiled[("expert", "all-to-all")] == simulated > 0
        moved[et] = compiled
    assert moved[1][("expert", "all-to-all")] * 2 == moved[None][("expert", "all-to-all")]
    tensor = lambda c: sum(b for (axes, _), b in c.items() if axes == "tensor")  # noqa: E731
    assert tensor(moved[1]) < tensor(moved[None])
