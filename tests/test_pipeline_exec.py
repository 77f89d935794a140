"""Executing schedule tables: loss and every gradient equal a single-device fp32 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from testbed.runner.pipeline import engine as pipeline

from testbed.runner.pipeline import spmd as pipeline_spmd
from testbed.runner.pipeline.engine import MpmdEngine, run_schedule
from testbed.runner.pipeline.spmd import spmd_gpipe, spmd_schedule
from testbed.pipeline.schedules import build_schedule

D = 8          # feature width of the tiny MLP
ROWS = 2       # rows per microbatch (even: splits over a data axis of 2)


def _init(stages: int, virtual: int, seed: int = 0) -> list[list[dict]]:
    """params[stage][chunk] of a tanh MLP; the last model chunk also has a linear head."""
    rng = np.random.default_rng(seed)
    chunks = stages * virtual
    params = [[None] * virtual for _ in range(stages)]
    for g in range(chunks):
        p = {"w": rng.normal(0, 0.6, (D, D)).astype(np.float32), "b": rng.normal(0, 0.1, (D,)).astype(np.float32)}
        if g == chunks - 1:
            p["head"] = rng.normal(0, 0.5, (D, 3)).astype(np.float32)
        params[g % stages][g // stages] = p
    return params


def _chunk(params: dict, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ params["w"] + params["b"])


def _stage_forward(stage: int, chunk: int, params: dict, x: jax.Array) -> jax.Array:
    return _chunk(params, x)


def _loss(params: dict, y: jax.Array, targets: jax.Array) -> jax.Array:
    return jnp.mean((y @ params["head"] - targets) ** 2)


def _data(m: int, seed: int = 1) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(ROWS, D)).astype(np.float32) for _ in range(m)]
    ts = [rng.normal(size=(ROWS, 3)).astype(np.float32) for _ in range(m)]
    return xs, ts


@jax.jit
@jax.value_and_grad
def _reference_loss(flat: list[dict], xs: jax.Array, ts: jax.Array) -> jax.Array:
    """Mean over microbatches of the loss through model chunks 0..G-1 in order (one device)."""
    def one(x, t):
        h = x
        for p in flat:
            h = _chunk(p, h)
        return _loss(flat[-1], h, t)

    return jnp.mean(jax.vmap(one)(xs, ts))


def _reference(params: list[list[dict]], xs, ts) -> tuple[float, list[list[dict]]]:
    """Single-device fp32 loss and gradients, laid out ``[stage][chunk]`` like the engines'."""
    stages, virtual = len(params), len(params[0])
    flat = [params[g % stages][g // stages] for g in range(stages * virtual)]
    cpu0 = jax.devices()[0]
    loss, g = _reference_loss(jax.device_put(flat, cpu0), jax.device_put(np.stack(xs), cpu0),
                              jax.device_put(np.stack(ts), cpu0))
    return float(loss), [[g[c * stages + s] for c in range(virtual)] for s in range(stages)]


def _assert_close(got, want, rel: float = 1e-5) -> None:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.all(np.isfinite(a))
        scale = max(float(np.max(np.abs(b))), 1e-30)
        assert float(np.max(np.abs(a - b))) <= rel * scale


def _placed(params, shardings):
    return [[jax.device_put(p, sh) for p in row] for row, sh in zip(params, shardings)]


CASES = [(name, p, m, v)
         for name in ("gpipe", "1f1b", "zb-h1", "zb-h2")
         for p, m in ((1, 3), (2, 1), (2, 5), (4, 4), (4, 6))
         for v in (1,)] + [("interleaved", p, m, v) for p, m, v in ((1, 3, 2), (2, 4, 2), (4, 4, 2), (2, 2, 3))]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_mpmd_matches_reference(name: str, p: int, m: int, v: int) -> None:
    devices = jax.devices()
    shardings = [jax.sharding.SingleDeviceSharding(devices[s]) for s in range(p)]
    params = _init(p, v)
    xs, ts = _data(m)
    schedule = build_schedule(name, p, m, v)
    loss, grads = run_schedule(schedule, _stage_forward, _loss, _placed(params, shardings), xs, ts, shardings)
    ref_loss, ref_grads = _reference(params, xs, ts)
    assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
    _assert_close(grads, ref_grads)
    for s in range(p):
        for leaf in jax.tree.leaves(grads[s]):
            assert leaf.devices() == {devices[s]}


def test_mpmd_stage_submeshes_with_data_axis_and_reuse() -> None:
    """Stages of 2 devices each (a data axis), the engine reused for a second step with new data."""
    p, m = 2, 4
    devices = np.asarray(jax.devices()[: 2 * p]).reshape(p, 2)
    meshes = [jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=list(devices[s]))
              for s in range(p)]
    act = [jax.NamedSharding(mesh, jax.P("data")) for mesh in meshes]
    rep = [jax.NamedSharding(mesh, jax.P()) for mesh in meshes]
    params = _init(p, 1, seed=3)
    engine = MpmdEngine(build_schedule("zb-h1", p, m), _stage_forward, _loss, act, nan_slots=False)
    for seed in (5, 6):
        xs, ts = _data(m, seed)
        loss, grads = engine.step(_placed(params, rep), xs, ts)
        ref_loss, ref_grads = _reference(params, xs, ts)
        assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
        _assert_close(grads, ref_grads)
        assert grads[1][0]["w"].sharding.mesh.devices.tolist() == list(devices[1])


def test_mpmd_receive_slots_start_as_nan() -> None:
    """Run out of dependency order, an action reads its still-NaN receive slot and the loss is NaN."""
    schedule = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError):
        MpmdEngine(type(schedule)(name="broken", stages=2, microbatches=2, split_backward=False,
                                  actions=(schedule.actions[0][::-1], schedule.actions[1])), _stage_forward, _loss)
    engine = MpmdEngine(schedule, _stage_forward, _loss)
    order = list(engine._order)
    first_on_1 = next(i for i, (s, a) in enumerate(order) if s == 1)
    engine._order = [order[first_on_1]] + order[:first_on_1] + order[first_on_1 + 1:]
    xs, ts = _data(2)
    loss, _ = engine.step(_init(2, 1), xs, ts)
    assert np.isnan(float(loss))
    engine.nan_slots = False
    with pytest.raises(KeyError):
        engine.step(_init(2, 1), xs, ts)


@pytest.mark.parametrize("p,m,data", [(1, 3, 1), (2, 3, 2), (4, 5, 1)])
def test_spmd_gpipe_matches_reference(p: int, m: int, data: int) -> None:
    """One jitted shard_map program over the stage axis (stages may have a data axis of their own);
    bubble slots carry NaN, results stay finite."""
    mesh = jax.make_mesh((p, data), ("stage", "data"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                         devices=jax.devices()[: p * data])
    params = _init(p, 1, seed=7)
    head = params[-1][0]["head"]
    stacked = {"w": np.stack([row[0]["w"] for row in params]), "b": np.stack([row[0]["b"] for row in params])}
    xs, ts = _data(m, seed=8)
    step = spmd_gpipe(_chunk, lambda y, t: _loss({"head": head}, y, t), mesh, m)
    sharded = jax.device_put(stacked, jax.NamedSharding(mesh, jax.P("stage")))
    batch = jax.NamedSharding(mesh, jax.P(None, "data"))
    loss, grads = step(sharded, jax.device_put(np.stack(xs), batch), jax.device_put(np.stack(ts), batch))
    ref_loss, ref_grads = _reference(params, xs, ts)
    assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
    want = {"w": np.stack([g[0]["w"] for g in ref_grads]), "b": np.stack([g[0]["b"] for g in ref_grads])}
    _assert_close(grads, want)


def _spmd_case(p: int, m: int):
    mesh = jax.make_mesh((p,), ("stage",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:p])
    params = _init(p, 1, seed=9)
    head = params[-1][0]["head"]
    stacked = jax.device_put({k: np.stack([row[0][k] for row in params]) for k in ("w", "b")},
                             jax.NamedSharding(mesh, jax.P("stage")))
    xs, ts = _data(m, seed=10)
    return mesh, params, stacked, xs, ts, (lambda y, t: _loss({"head": head}, y, t))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
def test_spmd_schedule_matches_reference(name: str) -> None:
    """Any one-chunk table as one shard_map program (lax.switch per tick, ppermute both ways)."""
    p, m = 4, 5
    mesh, params, stacked, xs, ts, loss_fn = _spmd_case(p, m)
    loss, grads = spmd_schedule(build_schedule(name, p, m), _chunk, loss_fn, mesh)(stacked, np.stack(xs), np.stack(ts))
    ref_loss, ref_grads = _reference(params, xs, ts)
    assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
    _assert_close(grads, {k: np.stack([g[0][k] for g in ref_grads]) for k in ("w", "b")})


def test_spmd_schedule_early_read_is_nan(monkeypatch) -> None:
    """Stage 1 running F0 one tick before it arrives reads its NaN receive buffer."""
    table = pipeline_spmd._tick_table

    def early(schedule):
        kinds, mbs = table(schedule)
        kinds, mbs = kinds.copy(), mbs.copy()
        assert kinds[0, 1] == 0 and kinds[1, 1] == 1 and mbs[1, 1] == 0
        kinds[0, 1], kinds[1, 1] = 1, 0
        return kinds, mbs

    monkeypatch.setattr(pipeline_spmd, "_tick_table", early)
    mesh, _, stacked, xs, ts, loss_fn = _spmd_case(2, 2)
    loss, _ = spmd_schedule(build_schedule("gpipe", 2, 2), _chunk, loss_fn, mesh)(stacked, np.stack(xs), np.stack(ts))
    assert np.isnan(float(loss))


def _gpt_stage_forward(heads: int, stage: int, chunk: int, params: dict, x: jax.Array) -> jax.Array:
    from testbed.runner import model

    if "embed" in params:
        x = model.embed(params["embed"], x)
    return model.stage_forward(params["layers"], x, heads)


def _gpt_loss(params: dict, y: jax.Array, targets: jax.Array) -> jax.Array:
    from testbed.runner import model

    return model.head_loss(params["head"], y, targets)


def test_mpmd_runs_the_gpt_model() -> None:
    """The project's GPT (testbed.runner.model) split into interleaved chunks by testbed.model.costs.chunk_layers."""
    import functools

    from testbed.runner import model
    from testbed.model.costs import chunk_layers
    from testbed.plan.spec import ModelSpec

    spec = ModelSpec(layers=2, d_model=8, heads=2, d_ff=16, seq_len=4, vocab=16)
    name, p, v, m = "interleaved", 1, 2, 2
    full = model.init_params(spec, seed=0)
    tokens, targets = model.make_batch(spec, 2 * m, seed=1)
    ranges = chunk_layers(spec, p, v)
    devices = jax.devices()
    params = []
    for s in range(p):
        row = []
        for c in range(v):
            chunk = {"layers": [full["layers"][i] for i in ranges[s][c]]}
            if s == 0 and c == 0:
                chunk["embed"] = full["embed"]
            if s == p - 1 and c == v - 1:
                chunk["head"] = full["head"]
            row.append(jax.device_put(chunk, devices[s]))
        params.append(row)
    shardings = [jax.sharding.SingleDeviceSharding(devices[s]) for s in range(p)]
    loss, grads = run_schedule(build_schedule(name, p, m, v), functools.partial(_gpt_stage_forward, spec.heads),
                               _gpt_loss, params, list(tokens.reshape(m, 2, -1)), list(targets.reshape(m, 2, -1)),
                               shardings)
    per_mb = jax.jit(jax.value_and_grad(functools.partial(model.forward_loss, spec=spec)))
    results = [per_mb(full, tokens[2 * i: 2 * i + 2], targets[2 * i: 2 * i + 2]) for i in range(m)]
    ref_loss = sum(float(r[0]) for r in results) / m
    ref = jax.tree.map(lambda *g: sum(g) / m, *[r[1] for r in results])
    assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
    for s in range(p):
        for c in range(v):
            want = {"layers": [ref["layers"][i] for i in ranges[s][c]]}
            if "embed" in grads[s][c]:
                want["embed"] = ref["embed"]
            if "head" in grads[s][c]:
                want["head"] = ref["head"]
            _assert_close(grads[s][c], want)
    assert "embed" in grads[0][0] and "head" in grads[p - 1][v - 1]


def _to_bf16(params: dict) -> dict:
    return jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)


@pytest.mark.parametrize("prepare", [None, _to_bf16])
@pytest.mark.parametrize("first,last", [(True, False), (False, False), (False, True)])
def test_forward_keeps_no_copy_of_the_parameters(first, last, prepare):
    """The stored residuals leave the chunk's (prepared) weights out and the backward is exact."""
    params = _init(1, 1)[0][0]
    if not last:
        params = {k: v for k, v in params.items() if k != "head"}
    x = jnp.asarray(_data(1)[0][0])
    targets = jnp.asarray(_data(1)[1][0]) if last else None
    y, stored = pipeline._forward(_stage_forward, _loss, prepare, 0, 0, first, last, params, x, targets)
    names = [path[0].key for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    taken = {names[i] for i in stored.slots if i >= 0}
    # The input gradient needs w (and the loss's needs head): taken out, not stored; the first chunk needs no w.
    assert taken == ({"w"} if not first else set()) | ({"head"} if last else set())
    assert (D, D) not in {tuple(np.shape(leaf)) for leaf in stored.kept}
    cotangent = jnp.ones_like(y)
    grads = pipeline._pull(prepare, stored, params, cotangent)
    cast = prepare or (lambda p: p)
    body = ((lambda p: _stage_forward(0, 0, cast(p), x)) if not last
            else (lambda p: _loss(cast(p), _stage_forward(0, 0, cast(p), x), targets)))
    reference = jax.vjp(body, params)[1](cotangent)[0]
    assert grads[0]["w"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(grads[0]["w"]), np.asarray(reference["w"]), rtol=1e-6, atol=1e-6)
