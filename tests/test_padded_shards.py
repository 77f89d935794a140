"""Flattened, padded ZeRO/FSDP partitions: any rank count shards the model state (testbed.model.layout's one rule).

Where no free dim of a parameter divides the shard count, the rule shards it flattened and padded: each rank
``ceil(elements / ways)``. The memory model counts the padding, the simulator's gathers and reduce-scatters move
it (bytes conserved: shard times shard count), and the runner keeps such a parameter's optimizer state flat and
padded (testbed.runner.padding), its result equal to the single-device reference. Rank counts 3 and 12 here, so
the counts do not divide.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from testbed.model import costs, layout
from testbed.model.memory import memory_breakdown, state_bytes_per_param
from testbed.plan.placement import place
from testbed.model.leaves import moved_elements, padded_params, runner_whole_params
from testbed.plan.sharding import state_sharding
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec
from testbed.runner import devices as dev
from testbed.runner.parallel import _path_names
from testbed.runner.padding import FlatState, flat_shape, flatten, unflatten
from testbed.runner.train import build_trainer, verify_plan
from testbed.sim.graph.program import build_program
from testbed.topology.io import load_topology

HOST = load_topology("host-cpu-8")
MODEL = ModelSpec(layers=2, d_model=16, heads=4, d_ff=32, seq_len=8, vocab=32)


def _plan(model: ModelSpec = MODEL, microbatches: int = 2, schedule: str = "1f1b", **kw) -> Plan:
    mesh = {k: kw.pop(k) for k in ("data", "fsdp", "tensor", "stage") if k in kw}
    replicas = mesh.get("data", 1) * mesh.get("fsdp", 1)
    return Plan(model=model, batch=BatchSpec(global_batch=2 * replicas * microbatches, microbatches=microbatches),
                mesh=MeshSpec(**mesh), schedule=ScheduleSpec(name=schedule), **kw)


def test_zero1_over_12_ranks_shards_the_optimizer_state_with_its_padding() -> None:
    # d_model 16, d_ff 32, vocab 32: no dim of any parameter is a multiple of 12, so sharding only divisible dims
    # would keep it all whole.
    plan = _plan(data=12, zero=1)
    _, _, opt_b = state_bytes_per_param(plan)
    held = costs.device_stage_params(plan, 0)
    leaves = layout.chunk_params(MODEL, 0, 0, 1)
    assert all(p.shard_dim(1, 12) is None for p, _ in leaves)
    assert set(padded_params(plan)) == {p.name for p, _ in leaves}
    shard = sum(n * math.ceil(p.size / 12) for p, n in leaves)
    breakdown = memory_breakdown(plan, HOST)
    assert breakdown.per_stage[0].optimizer == opt_b * shard
    padding = 12 * shard - held
    assert 0 < padding < 12 * sum(n for _, n in leaves)  # under one element per rank and leaf
    assert breakdown.optimizer < opt_b * held / 11       # sharded: nowhere near the whole state
    # The runner shards that state too (no optimizer state is reported whole); parameters are not sharded at zero 1.
    assert runner_whole_params(plan) == {}


@pytest.mark.parametrize("mesh", [dict(data=3, zero=1), dict(data=3, zero=2), dict(fsdp=3), dict(data=3, zero=3),
                                  dict(fsdp=3, tensor=2, stage=2), dict(data=12, zero=1)],
                         ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()))
def test_collective_bytes_carry_the_padding_and_are_conserved(mesh: dict) -> None:
    """Each gather outputs, and each reduce-scatter takes, shard x shard count: the padded total."""
    plan = _plan(**mesh)
    param_b, grad_b, _ = state_bytes_per_param(plan)
    placement = place(plan, num_devices=plan.mesh.size)
    program = build_program(plan, placement)
    sharding = state_sharding(plan)
    p_ways, o_ways = sharding.ways(plan, "params"), sharding.ways(plan, "optimizer")
    for s, rep in enumerate(program.representatives):
        shard = costs.device_stage_params(plan, s, o_ways)
        assert moved_elements(plan, s, None, "optimizer") == o_ways * shard >= costs.device_stage_params(plan, s)
        mine = [t for t in program.tasks if t.device == rep]
        gathers = [t for t in mine if t.op == "all_gather" and t.name.startswith("gather F")]
        if p_ways > 1:
            assert gathers
            for label in {t.name.split("/")[0] for t in gathers}:  # one forward's gathers, a block each
                blocks = [t for t in gathers if t.name.split("/")[0] == label]
                chunk = 0  # one chunk per stage here
                total = sum(t.nbytes * t.count for t in blocks)
                assert math.isclose(total, p_ways * costs.device_stage_params(plan, s, p_ways) * param_b)
                assert math.isclose(total, moved_elements(plan, s, chunk) * param_b)
        # The step's last reduce-scatters of the gradients (into the optimizer's shards): the padded total.
        final = [t for t in mine if t.op == "reduce_scatter" and "accumulate" not in t.name]
        assert math.isclose(sum(t.nbytes * t.count for t in final), o_ways * shard * grad_b, rel_tol=1e-9)
        regather = [t for t in mine if t.name == "gather params"]
        if o_ways > p_ways and plan.mesh.data > 1:
            assert math.isclose(regather[0].nbytes * regather[0].count,
                                o_ways * shard / plan.mesh.fsdp * param_b, rel_tol=1e-9)


@pytest.mark.parametrize("shape, tensor_dim, tensor, expert_dim, expert, ways",
                         [((7,), None, 1, None, 1, 3), ((6, 10), 1, 2, None, 1, 4), ((4, 6, 5), 2, 1, 0, 2, 7),
                          ((4, 6, 10), 2, 2, 0, 2, 3)])
def test_flat_form_round_trips_and_keeps_each_tensor_block(shape, tensor_dim, tensor, expert_dim, expert, ways) -> None:
    param = layout.ParamSpec(part=layout.Part.LAYER, path=("moe", "w1"), shape=shape, tensor_dim=tensor_dim,
                             init=layout.Init.ZEROS, expert_dim=expert_dim)
    x = jnp.arange(math.prod(shape), dtype=jnp.float32).reshape(shape) + 1
    y = flatten(x, param, tensor, ways, expert)
    assert y.shape == flat_shape(param, tensor, ways, expert)
    assert y.shape[-1] % ways == 0 and y.shape[-1] // ways == param.device_elements(tensor, ways, expert)
    np.testing.assert_array_equal(unflatten(y, param, tensor, expert), x)
    assert float(jnp.sum(y)) == float(jnp.sum(x))  # the padding is zeros
    # Row k of the flat form is the block tensor rank k holds (its dims split as the tensor axis splits them).
    if tensor > 1 and expert == 1:
        block = np.split(np.asarray(x), tensor, axis=tensor_dim)[1].ravel()
        np.testing.assert_array_equal(np.asarray(y)[1, :block.size], block)


@pytest.mark.parametrize("mesh", [dict(data=3, zero=1), dict(data=3, stage=2, zero=2, precision="bf16-mixed")],
                         ids=["spmd-dp3-zero1", "pipeline-dp3-pp2-zero2-bf16"])
def test_runner_shards_the_padded_optimizer_state_and_matches_the_reference(mesh: dict) -> None:
    plan = _plan(**mesh)
    o_ways = state_sharding(plan).ways(plan, "optimizer")
    devices = dev.select_devices(plan.mesh.size)
    trainer = build_trainer(plan, devices)
    _, opt_state = trainer.init()
    flat = FlatState(plan)
    # Every Adam moment of a padded parameter is its flat form, each device holding ceil(elements / 3) of it.
    states = opt_state if isinstance(opt_state, list) else [opt_state]
    seen = 0
    for state in states:
        for path, leaf in jax.tree_util.tree_leaves_with_path(state):
            names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
            if "mu" not in names and "master" not in names:
                continue
            param = layout.param_at(MODEL, _path_names(path))
            block = leaf.addressable_shards[0].data.shape
            assert math.prod(block) == param.device_elements(plan.mesh.tensor, o_ways)
            seen += flat._param(path) is not None  # padded (all but the stacked q, k, v: 3 divides their dim 1)
    assert seen >= len(layout.layer_params(MODEL)) - 1
    result = verify_plan(plan, devices, steps=2, check_hlo=False)
    assert result.ok, result.errors
    if plan.precision.name == "FP32":
        assert result.max_rel_err <= 1e-5


@pytest.mark.parametrize("mesh", [dict(fsdp=3), dict(data=2, fsdp=3, precision="bf16-mixed"), dict(fsdp=3, tensor=2),
                                  dict(data=3, zero=3), dict(fsdp=3, stage=2)],
                         ids=["fsdp3", "dp2-fsdp3-bf16", "fsdp3-tp2", "dp3-zero3", "pipeline-fsdp3-pp2"])
def test_runner_holds_padded_fsdp_parameters_flat_and_matches_the_reference(mesh: dict) -> None:
    """Under fsdp / ZeRO-3 the runner holds a parameter the rule pads flat and padded (testbed.runner.padding):
    each device ``ceil(elements / ways)`` of its tensor-rank block, gathered flat and rebuilt where it is used,
    its gradient reduce-scattered flat; the steps still equal the single-device reference's."""
    plan = _plan(**mesh)
    ways = state_sharding(plan).ways(plan, "params")
    assert runner_whole_params(plan) == {}
    devices = dev.select_devices(plan.mesh.size)
    trainer = build_trainer(plan, devices)
    params, _ = trainer.init()
    held = FlatState(plan, which="params")
    seen = 0
    for tree in params if isinstance(params, list) else [params]:
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            param = layout.param_at(MODEL, _path_names(path))
            block = leaf.addressable_shards[0].data.shape
            assert math.prod(block) == param.device_elements(plan.mesh.tensor, ways)
            if held.param(path) is not None:
                assert leaf.shape == flat_shape(param, plan.mesh.tensor, ways)
                seen += 1
    assert seen >= len(layout.layer_params(MODEL)) - 1  # all but the stacked q, k, v (3 divides their dim 1)
    result = verify_plan(plan, devices, steps=2, check_hlo=False)
    assert result.ok, result.errors
    if plan.precision.name == "FP32":
        assert result.max_rel_err <= 1e-5
