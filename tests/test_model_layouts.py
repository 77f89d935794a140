"""Attention and block layouts: ``model.head_dim``, ``model.parallel_block``, ``model.sliding_window``.

In both interpreters: the plan keys (bad input names the field), the layout table's shapes, FLOPs against the
traced JAX program, the tensor-parallel collectives against XLA's compiled step, the windowed kernels against a
direct masked softmax, and the runner's parallel steps against the single-device reference.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from testbed.cli import main
from testbed.errors import InputError
from testbed.model import costs as tm
from testbed.model import layout
from testbed.model.memory import memory_breakdown
from testbed.plan.io import plan_from_dict, plan_to_dict
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan
from testbed.runner import devices as dev
from testbed.runner import model as jm
from testbed.runner.attention import flash_attention, plain_attention
from testbed.runner.train import verify_plan
from testbed.topology.io import load_topology

BASE = ModelSpec(layers=2, d_model=16, heads=4, d_ff=24, seq_len=8, vocab=32)
LLAMA = dict(mlp="swiglu", norm="rmsnorm", position="rope", bias=False)


def _plan(model: ModelSpec, **kw) -> Plan:
    mesh = MeshSpec(**{k: kw.pop(k) for k in ("data", "fsdp", "tensor", "stage", "context") if k in kw})
    batch = BatchSpec(global_batch=kw.pop("batch", 8), microbatches=kw.pop("mb", 1))
    return Plan(model=model, batch=batch, mesh=mesh, name="layouts", **kw)


def _data(**model) -> dict:
    return {"model": {"layers": 2, "d_model": 16, "heads": 4, "d_ff": 24, "seq_len": 8, "vocab": 32, **model},
            "batch": {"global_batch": 8}}


# -- plan keys ----------------------------------------------------------------------------------

@pytest.mark.parametrize("model, field", [
    (dict(head_dim=0), "model.head_dim"), (dict(head_dim="wide"), "model.head_dim"),
    (dict(head_dim=2.5), "model.head_dim"), (dict(sliding_window=0), "model.sliding_window"),
    (dict(sliding_window=[4]), "model.sliding_window"), (dict(parallel_block="yes"), "model.parallel_block"),
    (dict(parallel_block=True, experts=4), "model.parallel_block"),
    (dict(d_model=18), "model.heads"), (dict(head_dim=5, position="rope"), "model.position"),
    (dict(head_dim=1 << 20), "model.head_dim"),
])
def test_bad_keys_name_their_field(model: dict, field: str) -> None:
    with pytest.raises(InputError) as bad:
        plan_from_dict(_data(**model))
    assert bad.value.field == field


def test_keys_round_trip_and_defaults() -> None:
    plan = plan_from_dict(_data(head_dim=6, parallel_block=True, sliding_window=3, attention="flash",
                                attention_block=2, **LLAMA))
    m = plan.model
    assert (m.head_dim, m.head_size, m.q_dim, m.kv_dim, m.parallel_block, m.sliding_window) == (6, 6, 24, 24, True, 3)
    assert plan_from_dict(plan_to_dict(plan)) == plan
    # d_model / heads by default (stored unset, also when written out equal), so replace(d_model=) keeps the rule.
    default = plan_from_dict(_data(head_dim=4))
    assert default.model.head_dim is None and "head_dim" not in plan_to_dict(default)["model"]
    assert replace(default.model, d_model=32).head_size == 8
    assert "parallel_block" not in plan_to_dict(default)["model"]
    # heads need not divide d_model once head_dim is set (Gemma-style).
    assert plan_from_dict(_data(d_model=18, head_dim=4)).model.q_dim == 16


def test_sliding_window_under_context_parallelism_is_priced_whole() -> None:
    """The ring computes every block it meets and masks the window (testbed/runner/ring_attention.py): the
    simulator prices its attention as without a window."""
    spec = replace(BASE, seq_len=32, attention="flash", attention_block=4)
    ring, windowed = (tm.chunk_cost(_plan(s, context=2), 0) for s in (spec, replace(spec, sliding_window=4)))
    assert windowed.forward_flops == ring.forward_flops
    assert tm.chunk_cost(_plan(replace(spec, sliding_window=4)), 0).forward_flops < \
        tm.chunk_cost(_plan(spec), 0).forward_flops


def test_cli_exit_2_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text("model: {layers: 2, d_model: 16, heads: 4, d_ff: 24, seq_len: 8, vocab: 32, head_dim: -1}\n"
                    "batch: {global_batch: 8}\n")
    assert main(["plan", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "model.head_dim" in err and "Traceback" not in err


# -- layout, FLOPs, memory -------------------------------------------------------------------------

def test_layout_shapes_follow_head_dim_and_parallel_block() -> None:
    spec = replace(BASE, head_dim=6, parallel_block=True)
    names = {p.name: p for p in layout.model_params(spec)}
    assert names["layers/attn/wqkv"].shape == (16, 3, 24) and names["layers/attn/bqkv"].shape == (3, 24)
    assert names["layers/attn/wo"].shape == (24, 16) and not any(n.startswith("layers/ln2") for n in names)
    gqa = {p.name: p for p in layout.model_params(replace(spec, kv_heads=2))}
    assert gqa["layers/attn/wq"].shape == (16, 24) and gqa["layers/attn/wkv"].shape == (16, 2, 12)
    for s in (spec, replace(spec, kv_heads=2, **LLAMA)):
        shapes = jax.eval_shape(lambda: jm.init_params(s, 0))
        assert jm.param_count(shapes) == tm.padded_param_count(s)
        for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
            names_on_path = [getattr(k, "key", None) for k in path]
            assert layout.param_at(s, [n for n in names_on_path if isinstance(n, str)]).shape == leaf.shape
    # One layer: q, k, v and out projections of d x heads*head_dim, one norm less.
    d, q = 16, 24
    assert tm.layer_param_count(spec) == tm.layer_param_count(BASE) + 4 * d * (q - d) + 3 * (q - d) - 2 * d


def test_window_scales_flash_attention_work_and_memory() -> None:
    spec = ModelSpec(layers=1, d_model=64, heads=4, d_ff=64, seq_len=1024, vocab=64, attention="flash",
                     attention_block=64)
    attention = lambda s: tm._layer_matmul_flops(s, 1)[1]  # noqa: E731  (scores and values)
    full = 2 * 2 * 1024 * 1024 * 64
    assert attention(spec) == full
    # A window of 128 keys: each K/V block of 64 meets 64 + 128 query rows, not 1024.
    windowed = replace(spec, sliding_window=128)
    assert windowed.score_rows == 192 and attention(windowed) == full * 192 // 1024
    assert replace(spec, sliding_window=1).score_rows == 64 and replace(spec, sliding_window=4096).score_rows == 1024
    # Plain attention scores the whole matrix and masks: no saving.
    assert replace(windowed, attention="plain").score_rows == 1024
    host = load_topology("host-cpu-8")
    assert memory_breakdown(_plan(windowed), host).workspace < memory_breakdown(_plan(spec), host).workspace


def test_parallel_block_prices_one_collective_per_layer() -> None:
    serial, parallel = (tm.chunk_cost(_plan(replace(BASE, parallel_block=p), tensor=2), 0) for p in (False, True))
    assert (serial.tensor_allreduces_forward, serial.tensor_allreduces_backward) == (5, 5)
    assert (parallel.tensor_allreduces_forward, parallel.tensor_allreduces_backward) == (3, 3)
    assert parallel.tensor_collectives("B", "full") == (("all_reduce", 3),)       # nothing to redo: no ln2 input
    sp = tm.chunk_cost(_plan(replace(BASE, parallel_block=True), tensor=2, sequence_parallel=True), 0)
    assert sp.tensor_collectives("F", "none") == (("all_gather", 3), ("reduce_scatter", 3))
    assert sp.tensor_collectives("B", "full") == (("all_gather", 5), ("reduce_scatter", 3))


def _activation_reductions(plan: Plan) -> dict[str, int]:
    """Buffers of the activation's shape ``[batch, seq, d]`` each tensor collective kind of the compiled SPMD
    step reduces or gathers (a combined tuple counts each of its buffers)."""
    from testbed.runner.check_sharding import compiled_spmd

    b, s, d = plan.batch.global_batch, plan.model.seq_len, plan.model.d_model
    _, text = compiled_spmd(plan)
    shapes = {"all-reduce": f"f32[{b},{s},{d}]", "reduce-scatter": f"f32[{b},{s // 2},{d}]",
              "all-gather": f"f32[{b},{s},{d}]"}
    out = {k: 0 for k in shapes}
    for line in text.splitlines():
        match = re.search(r"=\s*(.*?)\b(all-reduce|reduce-scatter|all-gather)(-start)?\(", line)
        if match:
            out[match.group(2)] += match.group(1).count(shapes[match.group(2)])
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_compiled_collectives_are_the_priced_ones(sp: bool) -> None:
    """XLA's compiled step on 2 tensor ranks moves as many activation buffers over ``tensor`` as chunk_cost
    prices, serial and parallel blocks alike: a parallel block saves one collective per layer each way."""
    for parallel in (False, True):
        plan = _plan(replace(BASE, parallel_block=parallel, bias=False), tensor=2, batch=4, sequence_parallel=sp)
        cost = tm.chunk_cost(plan, 0)
        priced: dict[str, int] = {}
        for kind in ("F", "B"):
            for op, n in cost.tensor_collectives(kind, plan.remat):
                priced[op.replace("_", "-")] = priced.get(op.replace("_", "-"), 0) + n
        found = _activation_reductions(plan)
        assert {k: n for k, n in found.items() if n} == priced, (parallel, found, priced)


# -- the windowed kernels ------------------------------------------------------------------------------

def _direct(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int | None) -> np.ndarray:
    b, s, heads, dh = q.shape
    group = heads // k.shape[2]
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(dh)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    seen = (j <= i) & ((i - j < window) if window else True)
    scores = np.where(seen, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", probs / probs.sum(-1, keepdims=True), vv)


@pytest.mark.parametrize("seq, block, window, kv", [(16, 4, 5, 2), (16, 4, 1, 4), (16, 2, 3, 1), (16, 8, 20, 2),
                                                     (12, 4, 8, 2)])
def test_windowed_kernels_equal_a_direct_masked_softmax(seq: int, block: int, window: int, kv: int) -> None:
    rng = np.random.default_rng(seq * block + window)
    q = rng.standard_normal((2, seq, 4, 6)).astype(np.float32)
    k, v = (rng.standard_normal((2, seq, kv, 6)).astype(np.float32) for _ in range(2))
    want = _direct(q, k, v, window)
    flash = flash_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), block, window)
    plain = plain_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), window)
    np.testing.assert_allclose(np.asarray(flash), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(plain), want, rtol=1e-5, atol=1e-5)
    weights = jnp.asarray(rng.standard_normal(want.shape).astype(np.float32))
    grads = [jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v) * weights), argnums=(0, 1, 2))(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
        for f in (lambda q, k, v: flash_attention(q, k, v, block, window),
                  lambda q, k, v: plain_attention(q, k, v, window))]
    for a, b in zip(*grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


# -- the runner against the reference ----------------------------------------------------------------

@pytest.mark.parametrize("model, mesh", [
    (dict(head_dim=6, parallel_block=True, kv_heads=1, **LLAMA), dict(tensor=2)),
    (dict(parallel_block=True, sliding_window=3, attention="flash", attention_block=2, head_dim=2),
     dict(data=2, tensor=2, sequence_parallel=True, remat="selective")),
    (dict(head_dim=6, sliding_window=5, kv_heads=2, parallel_block=True, **LLAMA),
     dict(stage=2, tensor=2, fsdp=2, mb=2, remat="full")),
    (dict(head_dim=6, sliding_window=3, attention="flash", attention_block=2, **LLAMA), dict(context=2, data=2)),
], ids=["2dev-tp-mqa", "4dev-sp-window-flash", "8dev-pipeline-fsdp", "4dev-ring-window"])
def test_runner_matches_reference(model: dict, mesh: dict) -> None:
    plan = _plan(replace(BASE, **model), **mesh)
    result = verify_plan(plan, dev.select_devices(plan.mesh.size), steps=2, check_hlo=False)
    errors = result["errors"]
    assert result["ok"] and max(errors["loss_rel"]) <= 1e-5 and max(errors["grad_rel"]) <= 1e-5, errors


@pytest.mark.parametrize("options, mesh", [
    (dict(head_dim=32), dict(data=4)), (dict(parallel_block=True), dict(data=4)),
    (dict(parallel_block=True), dict(data=2, tensor=2)),
    (dict(attention="flash", attention_block=16, sliding_window=16), dict(data=4)),
], ids=["head-dim", "parallel", "parallel-tp", "flash-window"])
def test_memory_matches_xla(options: dict, mesh: dict) -> None:
    """The memory model within 5% of XLA's compiled bytes for the runner's step (2 microbatches), as for the
    dense and flash models of tests/test_compiled_memory.py; the parallel block on 2 tensor ranks through
    testbed.runner.parallel.TensorShards' maps."""
    from testbed.runner.step_timer import compiled_memory
    from testbed.runner.train import build_trainer

    spec = ModelSpec(layers=2, d_model=64, heads=4, d_ff=256, seq_len=64, vocab=128, **options)
    plan = _plan(spec, batch=16, mb=2, **mesh)
    trainer = build_trainer(plan, dev.select_devices(plan.mesh.size))
    measured = compiled_memory(trainer, trainer.init())
    predicted = memory_breakdown(plan, load_topology("host-cpu-8")).total
    assert abs(predicted - measured) / measured < 0.05


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_traced_step_moves_the_plans_tensor_bytes(parallel: bool, sp: bool) -> None:
    """The runner's SPMD step, traced (testbed.runner.program) and priced on 32 H100s at TP 8, moves exactly the
    tensor-axis bytes the plan's model does, with a head width apart from d_model / heads, serial or parallel."""
    from testbed.plan.placement import place
    from testbed.plan.spec import MESH_AXES
    from testbed.runner.program.plans import trace_plan
    from testbed.sim.graph.engine import simulate
    from testbed.sim.graph.traced import collective_bytes, simulate_workload

    topology = load_topology("dgx-h100-x4")
    model = ModelSpec(layers=2, d_model=1024, heads=16, head_dim=96, d_ff=4096, seq_len=1024, vocab=32768,
                      parallel_block=parallel)
    plan = _plan(model, data=4, tensor=8, batch=4, precision="bf16-mixed", sequence_parallel=sp)
    traced, planned = simulate_workload(trace_plan(plan), topology), simulate(plan, topology)
    ids, names = place(plan, topology).device_ids, tuple(a.value for a in MESH_AXES)
    moved, expected = (collective_bytes(p.program, ids, names)["tensor"] for p in (traced, planned))
    assert moved == expected
