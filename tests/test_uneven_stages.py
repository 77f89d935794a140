"""Uneven pipeline stages (``layers_per_stage``): the rule, validation, layout, memory, simulator, both engines.

The split is decided once (``testbed.plan.stages`` resolves the plan key,
``testbed.model.layout.chunk_layers`` places the layers); these tests check
that every reader follows it and that the runner's pipelines, MPMD and SPMD,
train uneven plans exactly like the single-device fp32 reference.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from testbed.runner import devices as dev
from testbed.runner import model as jm
from testbed.runner.pipeline.spmd import (masked_layers, spmd_gpipe, spmd_schedule, stack_stage_layers,
                                   unstack_stage_layers)
from testbed.runner.pipeline.trainer import PipelineTrainer
from testbed.runner.step import ReferenceTrainer
from testbed.runner.train import _tree_errors
from testbed.errors import InputError
from testbed.explore.space import SearchSpace, candidates, resize_topology
from testbed.model import costs
from testbed.model.layout import chunk_layers, chunk_params
from testbed.model.memory import memory_breakdown
from testbed.pipeline.schedules import build_schedule
from testbed.pipeline.timing import ActionCosts, play
from testbed.plan.io import plan_from_dict, plan_to_dict
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec
from testbed.plan.stages import balanced_ends
from testbed.sim import simulate
from testbed.topology.io import load_topology

HOST = load_topology("host-cpu-8")
HOST2 = resize_topology(HOST, 2)
TINY = ModelSpec(layers=6, d_model=16, heads=2, d_ff=32, seq_len=8, vocab=32)


def _plan(layers: int = 6, stage: int = 2, mb: int = 2, schedule: str = "1f1b", virtual: int = 1,
          split=None, **mesh) -> Plan:
    return Plan(model=replace(TINY, layers=layers), batch=BatchSpec(global_batch=2 * mb * mesh.get("data", 1),
                                                                     microbatches=mb),
                mesh=MeshSpec(stage=stage, **mesh), schedule=ScheduleSpec(name=schedule, virtual_stages=virtual),
                layers_per_stage=split, name="uneven")


# -- the rule and its validation ------------------------------------------------------------

def test_balanced_ends_is_the_llama3_split() -> None:
    """Llama 3 405B: 126 layers on 16 stages, one layer fewer on the first and the last (7, 8 x 14, 7)."""
    plan = plan_from_dict({"model": {"preset": "llama3-405b"}, "batch": {"global_batch": 16, "microbatches": 16},
                           "mesh": {"stage": 16}, "layers_per_stage": "balanced-ends"})
    assert plan.stage_layers == (7,) + (8,) * 14 + (7,) and sum(plan.stage_layers) == 126
    ranges = chunk_layers(plan.model, 16, 1, plan.stage_layers)
    assert ranges[0][0] == range(0, 7) and ranges[1][0] == range(7, 15) and ranges[15][0] == range(119, 126)
    assert balanced_ends(6, 2) == (3, 3) and balanced_ends(6, 4) == (1, 2, 2, 1)
    # The default stays the even split; the key round-trips through YAML.
    assert replace(plan, layers_per_stage=None, model=replace(plan.model, layers=128)).stage_layers == (8,) * 16
    assert plan_from_dict(plan_to_dict(plan)) == plan
    listed = _plan(split=[1, 5])
    assert listed.layers_per_stage == (1, 5) and plan_from_dict(plan_to_dict(listed)) == listed


@pytest.mark.parametrize("split,layers,stage,virtual,words", [
    ([1, 2], 6, 2, 1, "sum to 3"),
    ([1, 2, 3], 6, 2, 1, "one layer count per pipeline stage"),
    ([0, 6], 6, 2, 1, "whole number >= 1"),
    ([1.5, 4.5], 6, 2, 1, "whole number >= 1"),
    ([1, 5], 6, 2, 3, "entry 0 (1) is too few for virtual_stages 3"),
    ([3, 1], 4, 2, 3, "stage 1 needs at least 2"),
    ("balanced-ends", 6, 1, 1, "mesh.stage >= 2"),
    ("balanced-ends", 7, 4, 1, "layer counts near 7 that fit: 6, 10"),
    ("balanced-ends", 6, 4, 3, "the rule's entry 0 (1) is too few"),
    ("even-ish", 6, 2, 1, "unknown rule"),
    (7, 6, 2, 1, "list of per-stage layer counts"),
    ([[1], 5], 6, 2, 1, "list of 2 whole numbers"),
])
def test_bad_layers_per_stage_names_the_field(split, layers: int, stage: int, virtual: int, words: str) -> None:
    data = {"model": {**{k: getattr(TINY, k) for k in ("d_model", "heads", "d_ff", "seq_len", "vocab")},
                      "layers": layers},
            "batch": {"global_batch": 4, "microbatches": 2}, "mesh": {"stage": stage},
            "schedule": {"name": "interleaved" if virtual > 1 else "1f1b", "virtual_stages": virtual},
            "layers_per_stage": split}
    with pytest.raises(InputError) as err:
        plan_from_dict(data)
    assert err.value.field == "layers_per_stage" and words in str(err.value)


def test_bad_plan_file_exits_2(tmp_path: Path, capsys) -> None:
    from testbed.cli.main import main

    path = tmp_path / "bad.yaml"
    path.write_text("model: {layers: 6, d_model: 16, heads: 2, d_ff: 32, seq_len: 8, vocab: 32}\n"
                    "batch: {global_batch: 4, microbatches: 2}\nmesh: {stage: 2}\nlayers_per_stage: [2, 2]\n")
    assert main(["plan", "check", str(path), "--topology", "host-cpu-8"]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "layers_per_stage" in err and "Traceback" not in err


@given(st.integers(1, 6), st.integers(1, 3), st.data())
def test_chunk_layers_cover_the_model_once_in_model_chunk_order(stages: int, virtual: int, data) -> None:
    counts = tuple(data.draw(st.integers(virtual, 4 * virtual)) for _ in range(stages))
    spec = replace(TINY, layers=sum(counts))
    ranges = chunk_layers(spec, stages, virtual, counts)
    flat = [ranges[g % stages][g // stages] for g in range(stages * virtual)]  # model chunk g = c * stages + s
    assert [i for r in flat for i in r] == list(range(spec.layers))
    for s in range(stages):  # as even as possible within a stage, the model's end chunks never the heavier
        sizes = [len(ranges[s][c]) for c in range(virtual)]
        assert sum(sizes) == counts[s] and max(sizes) - min(sizes) <= 1
        assert s or sizes[0] == min(sizes) or stages == 1  # one stage holds both ends: the head's lighter
        assert s < stages - 1 or sizes[-1] == min(sizes)
    if all(n == counts[0] and n % virtual == 0 for n in counts):  # an even list is exactly the default split
        assert ranges == chunk_layers(spec, stages, virtual)


def test_interleaved_balanced_ends_is_the_llama3_layout() -> None:
    """Meta's 126 layers on 16 stages, interleaved: with 8 chunks the first model chunk holds the embedding
    alone and the last the head and loss alone (Dubey et al. 2024, section 3.3.2); with 2 the ends are 3 + 4."""
    spec = replace(TINY, layers=126)
    for v, first, last in ((8, [0] + [1] * 7, [1] * 7 + [0]), (2, [3, 4], [4, 3])):
        ranges = chunk_layers(spec, 16, v, balanced_ends(126, 16))
        assert [len(r) for r in ranges[0]] == first and [len(r) for r in ranges[15]] == last
        assert all(len(r) == 8 // v for s in range(1, 15) for r in ranges[s])
    plan = _plan(layers=126, stage=16, mb=16, schedule="interleaved", virtual=8, split="balanced-ends")
    assert plan.stage_layers == balanced_ends(126, 16) and plan_from_dict(plan_to_dict(plan)) == plan
    assert costs.chunk_cost(plan, 0, 0).layers == 0 and costs.chunk_cost(plan, 15, 7).layers == 0


# -- memory and simulator follow the counts --------------------------------------------------

def test_memory_per_stage_follows_the_counts() -> None:
    even, front, back = (_plan(mb=4, split=s) for s in (None, (5, 1), (1, 5)))
    layer = costs.layer_param_count(TINY)
    for plan in (even, front, back):
        rows = memory_breakdown(plan, HOST).per_stage
        held = [costs.device_stage_params(plan, s) for s in range(2)]
        assert [r.params_count for r in rows] == held
        assert held[1] - held[0] == (plan.stage_layers[1] - plan.stage_layers[0]) * layer + (
            costs.head_param_count(TINY) - costs.embedding_param_count(TINY))
    # The stage with more layers holds more parameters and activations, and becomes the worst stage.
    b = memory_breakdown(back, HOST)
    e = memory_breakdown(even, HOST)
    assert b.per_stage[1].activations > e.per_stage[1].activations > 0
    assert b.per_stage[0].params < e.per_stage[0].params and b.worst_stage == 1 and b.total > e.total
    # Parameters in the layout's chunks are the stage's layers, nothing else.
    held = chunk_params(TINY, 1, 0, 2, 1, stage_layers=(1, 5))
    assert max(n for _, n in held) == 5


def test_runner_pieces_are_the_layout_split() -> None:
    """The trainer's per-chunk pytrees hold the layout's layers; the controller's buffer counts match them."""
    from testbed.runner.pipeline.trainer import merge_params, split_params
    from testbed.model.buffers import chunk_param_arrays

    plan = _plan(layers=10, stage=4, mb=4, schedule="interleaved", virtual=2, split=(2, 2, 4, 2))
    shapes = jax.eval_shape(lambda: jm.init_params(plan.model, plan.seed))
    pieces = split_params(plan, shapes)
    assert [[len(c["layers"]) for c in row] for row in pieces] == [[1, 1], [1, 1], [2, 2], [1, 1]]
    assert [[len(jax.tree.leaves(c)) for c in row] for row in pieces] == [
        [chunk_param_arrays(plan, s, c) for c in range(2)] for s in range(4)]
    assert jax.tree.structure(merge_params(plan, pieces)) == jax.tree.structure(shapes)


def test_heavier_stage_slows_the_pipeline() -> None:
    """The slowest stage governs a pipeline: 1 + 5 layers take longer than 3 + 3, in timing and simulator."""
    schedule = build_schedule("1f1b", 2, 8)
    even = play(schedule, ActionCosts(forward=(3, 3), backward=(6, 6)))
    uneven = play(schedule, ActionCosts(forward=(1, 5), backward=(2, 10)))
    assert uneven.step_time > even.step_time and uneven.busy[1] > even.busy[1]
    plans = [_plan(mb=8, split=s) for s in (None, (1, 5), (5, 1))]
    costs_ = [[costs.chunk_cost(p, s).forward_flops for s in range(2)] for p in plans]
    assert costs_[1][1] > costs_[0][1] > costs_[1][0]
    times = [simulate(p, HOST2).report.step_time_s for p in plans]
    assert times[1] > times[0] and times[2] > times[0]
    # Interleaved: each stage's count is split evenly over its chunks.
    inter = _plan(layers=6, mb=2, schedule="interleaved", virtual=2, split=(2, 4))
    assert [costs.chunk_cost(inter, 1, c).layers for c in range(2)] == [2, 2]
    assert simulate(inter, HOST2).report.step_time_s > 0


def test_search_keeps_even_splits() -> None:
    base = _plan(layers=6, stage=2, split=(1, 5))
    plans = list(candidates(base, 2, SearchSpace(schedules=("1f1b",), microbatches=(2,))))
    assert plans and all(p.layers_per_stage is None for p in plans)


# -- the engines on a tiny MLP split by the layout: every schedule, NaN receive slots ----------

D = 8      # width of the tanh layers
ROWS = 2   # rows per microbatch


def _mlp(layers: int, seed: int = 0) -> tuple[list[dict], np.ndarray]:
    """``layers`` tanh layers and a linear head."""
    rng = np.random.default_rng(seed)
    return ([{"w": rng.normal(0, 0.6, (D, D)).astype(np.float32), "b": rng.normal(0, 0.1, (D,)).astype(np.float32)}
             for _ in range(layers)], rng.normal(0, 0.5, (D, 3)).astype(np.float32))


def _layer(p: dict, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ p["w"] + p["b"])


def _mse(head: jax.Array, y: jax.Array, t: jax.Array) -> jax.Array:
    return jnp.mean((y @ head - t) ** 2)


def _batches(m: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(m, ROWS, D)).astype(np.float32), rng.normal(size=(m, ROWS, 3)).astype(np.float32))


def _mlp_reference(layers: list[dict], head: np.ndarray, xs: np.ndarray, ts: np.ndarray):
    """Single-device fp32 mean loss and layer gradients (the layers run in order, then the head)."""
    def loss(layers):
        def one(x, t):
            for p in layers:
                x = _layer(p, x)
            return _mse(head, x, t)
        return jnp.mean(jax.vmap(one)(xs, ts))

    cpu0 = jax.devices()[0]
    value, grads = jax.jit(jax.value_and_grad(loss))(jax.device_put(layers, cpu0))
    return float(value), grads


def _close(got, want) -> None:
    diff, scale = _tree_errors(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want))
    assert diff <= 1e-5 * scale


# (zb-h1 with uneven stages: the SPMD test below; every schedule on the GPT: benchmarks/uneven_stages.py)
MPMD_CASES = [("gpipe", 2, 3, 1, (1, 3)), ("1f1b", 3, 3, 1, "balanced-ends"), ("zb-h2", 4, 5, 1, (3, 1, 1, 1)),
              ("interleaved", 4, 4, 2, (2, 2, 4, 2)),
              # uneven chunks (3 layers: 1 + 2; 4: 2 + 2); balanced-ends leaves the model's end chunks empty
              ("interleaved", 2, 2, 2, (3, 4)), ("interleaved", 3, 3, 2, "balanced-ends")]


@pytest.mark.parametrize("name,p,m,v,split", MPMD_CASES)
def test_mpmd_engine_runs_uneven_stages(name: str, p: int, m: int, v: int, split) -> None:
    """The MPMD engine runs chunks the layout cut unevenly; receive slots start as NaN and nothing leaks."""
    from testbed.runner.pipeline.engine import run_schedule

    layers = sum(split) if isinstance(split, tuple) else 4  # balanced-ends on 3 stages: 1, 2, 1
    plan = _plan(layers=layers, stage=p, mb=m, schedule=name, virtual=v, split=split)
    mlp, head = _mlp(layers)
    ranges = chunk_layers(plan.model, p, v, plan.stage_layers)
    devices = jax.devices()
    params = [[{"layers": [mlp[i] for i in ranges[s][c]], **({"head": head} if (s, c) == (p - 1, v - 1) else {})}
               for c in range(v)] for s in range(p)]
    placed = [[jax.device_put(c, devices[s]) for c in row] for s, row in enumerate(params)]

    def forward(stage: int, chunk: int, prm: dict, x: jax.Array) -> jax.Array:
        for layer in prm["layers"]:
            x = _layer(layer, x)
        return x

    xs, ts = _batches(m)
    shardings = [jax.sharding.SingleDeviceSharding(devices[s]) for s in range(p)]
    loss, grads = run_schedule(build_schedule(name, p, m, v), forward, lambda prm, y, t: _mse(prm["head"], y, t),
                               placed, list(xs), list(ts), shardings)  # nan_slots: True by default
    ref_loss, ref_grads = _mlp_reference(mlp, head, xs, ts)
    assert np.isfinite(float(loss)) and abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
    _close([[g["layers"] for g in row] for row in grads], [[[ref_grads[i] for i in ranges[s][c]] for c in range(v)]
                                                          for s in range(p)])


def _spmd_mlp(stages: int, m: int, split, data: int = 1):
    plan = _plan(layers=sum(split) if isinstance(split, tuple) else 6, stage=stages, mb=m, split=split)
    mlp, head = _mlp(plan.model.layers, seed=5)
    ranges = chunk_layers(plan.model, stages, 1, plan.stage_layers)
    stacked, counts = stack_stage_layers([[mlp[i] for i in ranges[s][0]] for s in range(stages)])
    assert counts == plan.stage_layers
    mesh = jax.make_mesh((stages, data), ("stage", "data"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                         devices=jax.devices()[:stages * data])
    placed = jax.device_put(stacked, jax.NamedSharding(mesh, jax.P("stage")))
    xs, ts = _batches(m, seed=6)
    ref_loss, ref_grads = _mlp_reference(mlp, head, xs, ts)
    if data > 1:  # each stage's rows split over its own data axis
        batch = jax.NamedSharding(mesh, jax.P(None, "data"))
        xs, ts = jax.device_put(xs, batch), jax.device_put(ts, batch)
    want = [[ref_grads[i] for i in ranges[s][0]] for s in range(stages)]
    return mesh, placed, counts, masked_layers(_layer, counts), functools.partial(_mse, head), xs, ts, ref_loss, want


def _check_spmd(loss, grads, counts, ref_loss, want) -> None:
    assert np.isfinite(float(loss)) and abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
    _close(unstack_stage_layers(jax.tree.map(np.asarray, grads), counts), want)
    short = counts.index(min(counts))  # the padded slots of a smaller stage get exactly zero gradients
    assert all(np.all(np.asarray(leaf)[short, counts[short]:] == 0) for leaf in jax.tree.leaves(grads))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
def test_spmd_schedule_runs_uneven_stages(name: str) -> None:
    """One shard_map program: stages padded to the fullest and masked; 1, 2, 2, 1 layers (balanced-ends)."""
    m = 5
    mesh, placed, counts, stage_fn, loss_fn, xs, ts, ref_loss, want = _spmd_mlp(4, m, "balanced-ends")
    assert counts == (1, 2, 2, 1)
    loss, grads = spmd_schedule(build_schedule(name, 4, m), stage_fn, loss_fn, mesh)(placed, xs, ts)
    _check_spmd(loss, grads, counts, ref_loss, want)


def test_spmd_gpipe_runs_uneven_stages() -> None:
    """8 devices: 4 stages of 3, 1, 1, 1 layers, each stage with a data axis of 2."""
    m = 3
    mesh, placed, counts, stage_fn, loss_fn, xs, ts, ref_loss, want = _spmd_mlp(4, m, (3, 1, 1, 1), data=2)
    loss, grads = spmd_gpipe(stage_fn, loss_fn, mesh, m)(placed, xs, ts)
    _check_spmd(loss, grads, counts, ref_loss, want)


# -- the GPT pipeline trainer (the runner's path) against the single-device reference ---------

@pytest.mark.parametrize("schedule,virtual,split,held", [
    ("1f1b", 1, (2, 1), [[2], [1]]),
    # interleaved, stage 0's 3 layers as 1 + 2, stage 1's 2 as 1 + 1 (the embedding's chunk the lighter)
    ("interleaved", 2, (3, 2), [[1, 2], [1, 1]]),
])
def test_pipeline_trainer_runs_uneven_stages(schedule: str, virtual: int, split: tuple, held: list) -> None:
    """The runner's GPT pipeline, 2 devices, over uneven stages (1F1B: 2 + 1; interleaved: 3 + 2 split unevenly
    over 2 chunks): one step with NaN receive slots within 1e-5 of the reference. (Every schedule on 2-8 devices:
    benchmarks/uneven_stages.py; the option-mix test in tests/test_llm.py draws ``layers_per_stage`` too.)
    """
    plan = _plan(layers=sum(split), stage=2, mb=2, schedule=schedule, virtual=virtual, split=split)
    devices = dev.select_devices(plan.mesh.size)
    placement = dev.plan_placement(plan, devices)
    meshes = [dev.stage_mesh(placement, devices, s) for s in range(plan.mesh.stage)]
    trainer = PipelineTrainer(plan, meshes, return_grads=True, nan_slots=True)
    reference = ReferenceTrainer(plan, devices[0])
    state = trainer.init()
    assert [[len(c["layers"]) for c in stage] for stage in state[0]] == held
    _, loss = trainer.step(state, 0)
    _, ref_loss = reference.step(reference.init(), 0)
    assert np.isfinite(float(loss)) and abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    diff, scale = _tree_errors(trainer.full_grads(), reference.full_grads())
    assert diff <= 1e-5 * scale


def test_metas_interleaved_layout_simulates() -> None:
    """Llama 3 405B on 16,384 H100s as Meta laid it out, 126 layers on 16 stages (7, 8 x 14, 7) interleaved over
    2 chunks: the chunks are priced by their own layers (3 + 4 on the first stage), each stage holds the same
    parameters as under 1F1B, and interleaving shortens the step (a smaller bubble)."""
    from testbed.plan.io import load_plan

    topology = load_topology("llama3-h100-16k")
    flat = replace(load_plan("llama3-405b"), schedule=ScheduleSpec(name="1f1b"))  # the bundled mesh under 1F1B
    inter = replace(flat, schedule=ScheduleSpec(name="interleaved", virtual_stages=2))
    first = [costs.chunk_cost(inter, 0, c) for c in range(2)]
    assert [c.layers for c in first] == [3, 4] and first[0].forward_flops < first[1].forward_flops
    assert all(costs.device_stage_params(inter, s) == costs.device_stage_params(flat, s) for s in (0, 1, 15))
    step = simulate(inter, topology).report.step_time_s
    assert 0 < step < simulate(flat, topology).report.step_time_s
