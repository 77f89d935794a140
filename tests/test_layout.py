"""testbed.model.layout: one parameter table, and everything derived from it agrees.

Counts (testbed.model.costs), memory's parameter bytes (testbed.model.memory),
the runner's shapes (testbed.runner.model) and PartitionSpecs (testbed.runner.parallel),
the controller's buffer counts (testbed.model.buffers) and the pipeline's
pieces (testbed.runner.pipeline.trainer) are each derived from the table here and
checked against each other. The fsdp/ZeRO shard rule is one function: where
it leaves a parameter whole (no dim divides), memory counts it whole, as the
runner holds it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any

import jax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from testbed.runner import model as jm
from testbed.runner.padding import FlatState, flat_shape
from testbed.runner.parallel import _path_names, layout_for, leaf_spec
from testbed.runner.pipeline.trainer import merge_params, split_params
from testbed.errors import InputError
from testbed.model import buffers, costs, layout
from testbed.model.layout import Init, ParamSpec, Part, shard_dim
from testbed.model.memory import memory_breakdown, state_bytes_per_param
from testbed.model.leaves import padded_params, runner_whole_params
from testbed.plan.sharding import state_sharding
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec
from testbed.topology.io import load_topology

HOST = load_topology("host-cpu-8")


@st.composite
def specs(draw) -> ModelSpec:
    heads = draw(st.integers(1, 4))
    return ModelSpec(layers=draw(st.integers(1, 4)), d_model=heads * draw(st.integers(1, 8)), heads=heads,
                     d_ff=draw(st.integers(1, 40)), seq_len=draw(st.integers(1, 16)), vocab=draw(st.integers(2, 50)),
                     tied_embeddings=draw(st.booleans()))


def _shapes(spec: ModelSpec) -> Any:
    return jax.eval_shape(lambda: jm.init_params(spec, 0))


def _leaves(tree: Any) -> list[tuple[list[str], tuple[int, ...]]]:
    return [(_path_names(path), tuple(leaf.shape)) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


# -- the shard rule ----------------------------------------------------------------------------

def test_shard_rule_largest_free_divisible_dim_else_none() -> None:
    assert shard_dim((8, 12), (), 4) == 1                 # largest first
    assert shard_dim((12, 8), (0,), 4) == 1               # a taken dim is skipped
    assert shard_dim((6, 6), (), 3) == 0                  # ties: the lower dim
    assert shard_dim((6, 10), (), 4) is None              # nothing divides: replicated
    assert shard_dim((8,), (0,), 2) is None               # nothing free
    assert shard_dim((7, 5), (), 1) is None               # one way: not split


def test_param_spec_is_validated_and_counts_per_device() -> None:
    w = ParamSpec(part=Part.LAYER, path=("mlp", "w1"), shape=(12, 40), tensor_dim=1, init=Init.NORMAL,
                  std=0.02, rng=2)
    assert w.size == 480 and w.name == "layers/mlp/w1"
    assert w.device_elements(2) == 240                    # tensor splits dim 1
    assert w.device_elements(1, 4) == 120                 # tensor 1 leaves dim 1 free: 40 / 4
    assert w.device_elements(2, 8) == 30                  # 12 % 8: flattened and padded, 240 / 8 exactly
    assert w.padded(2, 8) and not w.padded(2, 3) and not w.padded(2, 1)
    assert w.device_elements(2, 7) == 35                  # ceil(240 / 7): the flat shard, padding included
    assert w.gathered_elements(2, 7) == 245 and w.gathered_elements(2, 3) == 240
    assert w.device_elements(2, 3) == 80
    with pytest.raises(ValueError):
        w.device_elements(3)                              # 40 % 3
    for bad in (dict(shape=(0, 4)), dict(tensor_dim=2), dict(path=()), dict(rng=None), dict(std=0.0),
                dict(init=Init.ZEROS)):
        with pytest.raises(ValueError):
            replace(w, **bad)


# -- counts, shapes, init ------------------------------------------------------------------------

@given(specs())
@settings(max_examples=settings().max_examples * 2, deadline=None)  # the profile's share: ci 30, thorough 600
def test_runner_shapes_are_the_table(spec: ModelSpec) -> None:
    leaves = _leaves(_shapes(spec))
    # Every leaf is in the table with its shape, and the table has no leaf the runner lacks.
    for names, shape in leaves:
        assert layout.param_at(spec, names).shape == shape
    want = (len(layout.embedding_params(spec)) + spec.layers * len(layout.layer_params(spec))
            + len(layout.head_params(spec)))
    assert len(leaves) == want
    assert len(layout.layer_params(spec)) == layout.LAYER_LEAVES
    # Counts are the table's sizes.
    assert costs.embedding_param_count(spec) == sum(p.size for p in layout.embedding_params(spec))
    assert costs.layer_param_count(spec) == sum(p.size for p in layout.layer_params(spec))
    assert costs.head_param_count(spec) == sum(p.size for p in layout.head_params(spec))
    assert costs.param_count(spec) == jm.param_count(_shapes(spec)) == sum(math.prod(s) for _, s in leaves)
    assert any(p.path == ("w",) for p in layout.head_params(spec)) != spec.tied_embeddings


def test_unknown_leaf_is_an_error() -> None:
    spec = ModelSpec(layers=1, d_model=8, heads=2, d_ff=16, seq_len=4, vocab=10)
    with pytest.raises(KeyError):
        layout.param_at(spec, ["layers", "attn", "wq"])
    with pytest.raises(KeyError):
        layout.param_at(replace(spec, tied_embeddings=True), ["head", "w"])
    plan = Plan(model=spec, batch=BatchSpec(global_batch=2, microbatches=1))
    wrong = {"embed": {"tokens": jax.ShapeDtypeStruct((10, 4), "float32")}}
    with pytest.raises(ValueError, match="not the layout"):
        layout_for(wrong, plan)


def test_init_draws_from_the_table_keys() -> None:
    spec = ModelSpec(layers=2, d_model=16, heads=2, d_ff=32, seq_len=8, vocab=20)
    params = jm.init_params(spec, 5)
    keys = jax.random.split(jax.random.key(5), spec.layers + layout.GLOBAL_KEYS)
    tokens = layout.param_at(spec, ["embed", "tokens"])
    assert (params["embed"]["tokens"] == tokens.std * jax.random.normal(keys[tokens.rng], tokens.shape)).all()
    w2 = layout.param_at(spec, ["layers", "mlp", "w2"])
    k = jax.random.split(keys[layout.GLOBAL_KEYS + 1], layout.LAYER_KEYS)
    assert (params["layers"][1]["mlp"]["w2"] == w2.std * jax.random.normal(k[w2.rng], w2.shape)).all()
    assert w2.std == pytest.approx(layout.INIT_STD / 2)
    assert (params["head"]["norm"]["scale"] == 1).all() and (params["layers"][0]["attn"]["bqkv"] == 0).all()


# -- tensor and fsdp/ZeRO: runner PartitionSpecs vs memory ----------------------------------------

def _device_elements(shape: tuple[int, ...], spec: P, mesh: MeshSpec) -> int:
    n = math.prod(shape)
    for size, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        ways = math.prod(mesh.degree(a) for a in axes)
        assert size % ways == 0
        n //= ways
    return n


def _stage_trees(plan: Plan) -> list[Any]:
    shapes = _shapes(plan.model)
    return [shapes] if plan.mesh.stage == 1 else split_params(plan, shapes)


def _runner_stage_elements(plan: Plan, which: str) -> list[int]:
    """Per stage, the elements a device holds of ``which``: what the runner's specs split (a padded leaf's
    moments in their flat form, and under fsdp / ZeRO-3 its parameters and gradients: testbed.runner.padding),
    and for the padded leaves' gradients it does not pad (ZeRO-2, reported: held whole) the rule's flat shard."""
    out = []
    kind = {"moments": "optimizer"}.get(which, which)
    ways = state_sharding(plan).ways(plan, kind)
    reported = runner_whole_params(plan).get(kind, ())
    flat = FlatState(plan)
    held_flat = FlatState(plan, which="params")
    for tree in _stage_trees(plan):
        specs = getattr(layout_for(tree, plan), which)
        total = 0
        for (path, leaf), pspec in zip(jax.tree_util.tree_leaves_with_path(tree),
                                       jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
            param = layout.param_at(plan.model, _path_names(path))
            padded = param.padded(plan.mesh.tensor, ways, plan.mesh.expert)
            if which == "moments" and padded:
                held = _device_elements(flat_shape(param, plan.mesh.tensor, ways, plan.mesh.expert),
                                        flat.spec(path, pspec), plan.mesh)
            elif which != "moments" and held_flat.param(path) is not None:  # held flat over the params' axes
                held = _device_elements(flat_shape(param, plan.mesh.tensor, held_flat.ways, plan.mesh.expert),
                                        pspec, plan.mesh)
                assert held == param.device_elements(plan.mesh.tensor, held_flat.ways, plan.mesh.expert)
                if padded and param.name in reported:  # ZeRO-2 over fsdp: the rule's shard over more axes
                    held = param.device_elements(plan.mesh.tensor, ways, plan.mesh.expert)
            else:
                held = _device_elements(leaf.shape, pspec, plan.mesh)
                if padded:
                    assert param.name in reported and held == param.device_elements(plan.mesh.tensor, 1,
                                                                                    plan.mesh.expert)
                    held = -(-held // ways)
            total += held
        out.append(total)
    return out


_MESHES = [dict(data=2), dict(fsdp=2), dict(fsdp=4), dict(fsdp=8), dict(data=2, tensor=2), dict(fsdp=2, tensor=2),
           dict(data=4, tensor=2), dict(fsdp=2, tensor=2, stage=2), dict(data=2, tensor=2, stage=2),
           dict(data=2, fsdp=2, stage=2), dict(data=3, fsdp=2)]


@pytest.mark.parametrize("mesh", _MESHES, ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()))
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_memory_counts_what_the_runner_shards(mesh: dict, zero: int) -> None:
    # d_model 12 and d_ff 20 leave leaves that 8 (or 2 x tensor) cannot split: replicated by the one rule.
    spec = ModelSpec(layers=4, d_model=12, heads=2, d_ff=20, seq_len=6, vocab=30)
    m = MeshSpec(**mesh)
    plan = Plan(model=spec, batch=BatchSpec(global_batch=2 * m.data * m.fsdp, microbatches=2), mesh=m, zero=zero)
    breakdown = memory_breakdown(plan, HOST)
    param_b, grad_b, opt_b = state_bytes_per_param(plan)
    params, grads, moments = (_runner_stage_elements(plan, w) for w in ("params", "grads", "moments"))
    for s, stage in enumerate(breakdown.per_stage):
        assert stage.params_count == params[s] and stage.params == param_b * params[s]
        assert stage.grads == grad_b * grads[s]          # two microbatches: the accumulator is live whole
        assert stage.optimizer == opt_b * moments[s]


def test_one_rule_pads_what_no_dim_divides_and_both_sides_follow_it() -> None:
    # fsdp 8 cannot split the 12-wide LayerNorms, biases and positions' d: they are sharded flattened and padded,
    # ceil(elements / 8) each; the runner holds them flat and padded too (runner_whole_params names none).
    spec = ModelSpec(layers=2, d_model=12, heads=2, d_ff=20, seq_len=6, vocab=30)
    plan = Plan(model=spec, batch=BatchSpec(global_batch=8, microbatches=1), mesh=MeshSpec(fsdp=8))
    held = costs.device_stage_params(plan, 0)
    sharded = costs.device_stage_params(plan, 0, 8)
    padded = [p for p in layout.model_params(spec) if p.padded(1, 8)]
    assert {p.name for p in padded} >= {"layers/ln1/scale", "layers/attn/bo", "head/norm/bias"}
    assert set(padding_params := padded_params(plan, "params")) == {p.name for p in padded}
    assert runner_whole_params(plan) == {}  # its parameters, gradients and optimizer state: padded
    # Every device holds at most one element of padding per parameter leaf: >= 1/8 of the model, never whole.
    leaves = sum(c for _, c in layout.chunk_params(spec, 0, 0, 1))
    assert held / 8 <= sharded <= held / 8 + leaves and sharded < held
    assert sharded == sum(c * -(-p.device_elements() // 8) for p, c in layout.chunk_params(spec, 0, 0, 1))
    assert memory_breakdown(plan, HOST).device_params_count == sharded == _runner_stage_elements(plan, "params")[0]
    for p in layout.model_params(spec):
        spec_ = leaf_spec(p, tensor=1, shard_axes=("fsdp",), shard_size=8)
        assert p.padded(1, 8) == all(d is None for d in spec_)


@pytest.mark.parametrize("tensor", [1, 2, 4])
def test_tensor_dims_of_the_runner_are_the_tables(tensor: int) -> None:
    spec = ModelSpec(layers=2, d_model=16, heads=4, d_ff=32, seq_len=8, vocab=24)
    plan = Plan(model=spec, batch=BatchSpec(global_batch=4, microbatches=1), mesh=MeshSpec(tensor=tensor))
    specs = layout_for(_shapes(spec), plan).params
    for (path, pspec) in jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P)):
        param = layout.param_at(spec, _path_names(path))
        dims = tuple(pspec) + (None,) * (len(param.shape) - len(pspec))
        assert tuple(i for i, d in enumerate(dims) if d == "tensor") == param.tensor_dims(tensor)
        assert _device_elements(param.shape, pspec, plan.mesh) == param.device_elements(tensor)
    # Megatron: column (last dim) for QKV and MLP-in, row (first) for the out projections, vocab for the tables.
    roles = {p.name: p.tensor_dim for p in layout.model_params(spec)}
    assert roles["layers/attn/wqkv"] == 2 and roles["layers/mlp/w1"] == 1 and roles["layers/mlp/b1"] == 0
    assert roles["layers/attn/wo"] == 0 and roles["layers/mlp/w2"] == 0 and roles["layers/attn/bo"] is None
    assert roles["embed/tokens"] == 0 and roles["head/w"] == 1 and roles["embed/positions"] is None
    assert costs._layer_params_per_tensor_rank(spec, tensor) == sum(p.device_elements(tensor)
                                                                    for p in layout.layer_params(spec))


# -- pipeline pieces and buffers --------------------------------------------------------------------

@pytest.mark.parametrize("stages, virtual, tied", [(1, 1, False), (1, 1, True), (2, 1, False), (2, 2, False),
                                                   (4, 1, True), (1, 2, True), (2, 2, True)])
def test_pieces_buffers_and_counts_follow_the_holders(stages: int, virtual: int, tied: bool) -> None:
    spec = ModelSpec(layers=8, d_model=16, heads=4, d_ff=32, seq_len=8, vocab=24, tied_embeddings=tied)
    plan = Plan(model=spec, batch=BatchSpec(global_batch=4, microbatches=4), mesh=MeshSpec(stage=stages),
                schedule=ScheduleSpec(name="interleaved" if virtual > 1 else "1f1b", virtual_stages=virtual))
    shapes = _shapes(spec)
    pieces = split_params(plan, shapes)
    assert jax.tree.structure(merge_params(plan, pieces)) == jax.tree.structure(shapes)
    for s, c in itertools.product(range(stages), range(virtual)):
        embed, head = layout.holds(s, c, stages, virtual)
        assert embed == ((s, c) == layout.embedding_holder(stages, virtual) == (0, 0))
        assert head == ((s, c) == layout.head_holder(stages, virtual) == (stages - 1, virtual - 1))
        cost = costs.chunk_cost(plan, s, c)
        assert (cost.has_embedding, cost.has_head) == (embed, head)
        assert ("embed" in pieces[s][c], "head" in pieces[s][c]) == (embed, head)
        # The runner's piece holds the table's leaves (no tied copy); buffers count exactly those.
        piece_leaves = _leaves(pieces[s][c])
        assert len(piece_leaves) == buffers.chunk_param_arrays(plan, s, c)
        no_copy = layout.chunk_params(spec, s, c, stages, virtual, tied_copy=False)
        assert sum(math.prod(shape) for _, shape in piece_leaves) == layout.held_elements(no_copy)
        # Counts add the tied token-table copy on the head's chunk when it is not the embedding's.
        copy = spec.vocab * spec.d_model if tied and head and not embed else 0
        held = layout.held_elements(layout.chunk_params(spec, s, c, stages, virtual))
        assert held == layout.held_elements(no_copy) + copy
    assert sum(costs.stage_param_count(spec, s, stages, virtual) for s in range(stages)) == \
        costs.param_count(spec) + (spec.vocab * spec.d_model if tied and stages * virtual > 1 else 0)
    with pytest.raises(InputError):
        layout.chunk_params(spec, stages, 0, stages, virtual)
    with pytest.raises(InputError):
        layout.chunk_params(spec, 0, virtual, stages, virtual)


def test_state_sharding_ways_feed_the_rule() -> None:
    spec = ModelSpec(layers=2, d_model=16, heads=4, d_ff=32, seq_len=8, vocab=24)
    plan = Plan(model=spec, batch=BatchSpec(global_batch=8, microbatches=1), mesh=MeshSpec(data=4, fsdp=2), zero=3)
    ways = state_sharding(plan).ways(plan, "params")
    assert ways == 8
    assert costs.device_stage_params(plan, 0, ways) == _runner_stage_elements(plan, "params")[0]
