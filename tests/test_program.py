"""The task graph of one step: conservation of FLOPs and bytes, counts, dependencies, representatives."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from testbed.model import costs as model
from testbed.model.memory import state_bytes_per_param
from testbed.plan.placement import place
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec
from testbed.sim.program import BUCKETS, OPTIMIZER_FLOPS_PER_PARAM, TaskKind, axis_groups, build_program
from testbed.pipeline.schedules import build_schedule, sends
from testbed.plan.sharding import state_sharding

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"]


def make_plan(*, data=1, fsdp=1, tensor=1, stage=1, schedule="1f1b", virtual=1, microbatches=4, zero=0,
              remat="none", layers=8) -> Plan:
    replicas = data * fsdp
    return Plan(model=ModelSpec(layers=layers, d_model=32, heads=4, d_ff=64, seq_len=16, vocab=64),
                batch=BatchSpec(global_batch=replicas * microbatches * 2, microbatches=microbatches),
                mesh=MeshSpec(data=data, fsdp=fsdp, tensor=tensor, stage=stage),
                schedule=ScheduleSpec(name=schedule, virtual_stages=virtual), zero=zero, remat=remat)


plans = st.builds(
    lambda sched, stage, data, fsdp, tensor, zero, remat: make_plan(
        data=data, fsdp=fsdp, tensor=tensor, stage=stage, schedule=sched, zero=zero, remat=remat,
        virtual=2 if sched == "interleaved" else 1),
    st.sampled_from(SCHEDULES), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2]),
    st.sampled_from([1, 2]), st.integers(0, 3), st.sampled_from(["none", "selective", "full"]))


def _program(plan: Plan):
    placement = place(plan, num_devices=plan.mesh.size)
    return placement, build_program(plan, placement)


@given(plans)
def test_compute_flops_are_conserved(plan):
    """Each stage's actions carry exactly the model's per-device FLOPs; the optimizer its shard's update."""
    _, program = _program(plan)
    reps = program.representatives
    assert len(reps) == plan.mesh.stage
    for s, rep in enumerate(reps):
        actions = sum(t.flops for t in program.tasks if t.device == rep and t.pipeline and t.kind is TaskKind.COMPUTE)
        assert math.isclose(actions, model.step_flops_per_device(plan, s), rel_tol=1e-9)
        opt = [t for t in program.tasks if t.device == rep and t.name == "optimizer"]
        assert len(opt) == 1
        o_ways = plan.mesh.fsdp * (plan.mesh.data if plan.zero >= 1 else 1)
        # The optimizer updates its shard as the layout's one rule cuts it (leaves no dim of which o_ways
        # divides stay whole), as memory counts and the runner holds it.
        assert math.isclose(opt[0].flops, OPTIMIZER_FLOPS_PER_PARAM * model.device_stage_params(plan, s, o_ways))


@given(plans)
def test_gradient_bytes_are_conserved(plan):
    """The first reduction of every bucket sums to the stage's gradients (once per step, plus once per
    earlier microbatch for gradients sharded over fsdp or ZeRO-2/3)."""
    _, program = _program(plan)
    _, grad_b, _ = state_bytes_per_param(plan)
    for s, rep in enumerate(program.representatives):
        grad = [t for t in program.tasks if t.device == rep and t.stream == "grad" and t.name != "gather params"]
        if plan.replicas == 1:
            assert grad == []
            continue
        firsts = [t for t in grad if not any(program.tasks[d].stream == "grad" for d in t.deps)]
        # Sharded gradients: each earlier microbatch's are reduce-scattered into the accumulator.
        accumulate = [t for t in firsts if t.name.endswith("(accumulate)")]
        firsts = [t for t in firsts if t not in accumulate]
        sharded = state_sharding(plan).ways(plan, "grads") > 1
        assert len(accumulate) == (plan.schedule.virtual_stages * (plan.batch.microbatches - 1) if sharded else 0)
        assert math.isclose(sum(t.nbytes for t in accumulate),
                            sharded * (plan.batch.microbatches - 1) * model.device_stage_params(plan, s) * grad_b,
                            rel_tol=1e-9)
        assert math.isclose(sum(t.nbytes for t in firsts), model.device_stage_params(plan, s) * grad_b, rel_tol=1e-9)
        assert all(int(program.representative[d]) == rep for t in firsts for d in t.group)
        assert len(firsts) == plan.schedule.virtual_stages * min(BUCKETS, plan.model.layers // (
            plan.mesh.stage * plan.schedule.virtual_stages))


@given(plans)
def test_sends_match_the_schedule(plan):
    """One send task per inter-stage transfer of the schedule table, each between the two representatives."""
    _, program = _program(plan)
    schedule = build_schedule(plan.schedule.name, plan.mesh.stage, plan.batch.microbatches,
                              plan.schedule.virtual_stages)
    tasks = [t for t in program.tasks if t.kind is TaskKind.SEND]
    assert len(tasks) == len(sends(schedule))
    reps = program.representatives
    for t in tasks:
        src, dst = t.group
        assert src == t.device and src in reps and dst in reps and src != dst
        assert len(t.instances) == plan.mesh.size // plan.mesh.stage


@given(plans)
def test_tensor_allreduces_match_the_model(plan):
    _, program = _program(plan)
    for s, rep in enumerate(program.representatives):
        expected = 0
        if plan.mesh.tensor > 1:
            for c in range(plan.schedule.virtual_stages):
                cost = model.chunk_cost(plan, s, c)
                redo = cost.layers if plan.remat == "full" else 0  # full remat reruns the attention all-reduce
                expected += plan.batch.microbatches * (cost.tensor_allreduces_forward + cost.tensor_allreduces_backward
                                                       + redo)
        got = sum(t.count for t in program.tasks if t.device == rep and t.stream == "tensor")
        assert got == expected


@given(plans)
def test_representatives_cover_every_device(plan):
    placement, program = _program(plan)
    assert program.num_devices == plan.mesh.size
    for s in range(plan.mesh.stage):
        members = placement.stage_devices(s)
        assert {int(program.representative[d]) for d in members} == {int(placement.device_ids[s].flat[0])}
    assert sum(program.multiplicity.values()) == plan.mesh.size
    # Dependencies point backwards (checked by Program) and every collective's group is one of its instances.
    for t in program.tasks:
        if t.kind is TaskKind.COLLECTIVE:
            assert t.group in t.instances and t.device in t.group


def test_axis_groups_partition_each_stage():
    plan = make_plan(data=2, fsdp=2, tensor=2, stage=2)
    placement = place(plan, num_devices=16)
    for axes in (["data"], ["data", "fsdp"], ["tensor"], ["fsdp", "data"]):
        groups = axis_groups(placement, axes)
        for s, gs in groups.items():
            assert sorted(d for g in gs for d in g) == sorted(placement.stage_devices(s))
            assert all(len(g) == math.prod(plan.mesh.degree(a) for a in axes) for g in gs)


@pytest.mark.parametrize("zero,fsdp,ops", [
    (0, 1, {"all_reduce"}), (1, 1, {"reduce_scatter", "all_gather"}), (2, 1, {"reduce_scatter", "all_gather"}),
    (3, 1, {"reduce_scatter", "all_gather"}), (0, 2, {"reduce_scatter", "all_reduce", "all_gather"}),
])
def test_sharding_model(zero, fsdp, ops):
    """Which collectives each ZeRO stage / fsdp uses (module docstring of testbed.sim.program)."""
    plan = make_plan(data=2, fsdp=fsdp, zero=zero)
    _, program = _program(plan)
    used = {t.op for t in program.tasks if t.kind is TaskKind.COLLECTIVE}
    assert used == ops
    gathers = [t for t in program.tasks if t.stream == "gather"]
    sharded_params = fsdp > 1 or zero == 3
    assert bool(gathers) == sharded_params
    if sharded_params:  # one gather before every F (the backward keeps the gathered weights), and B with full remat
        assert len(gathers) == plan.batch.microbatches
        _, full = _program(replace(plan, remat="full"))
        assert len([t for t in full.tasks if t.stream == "gather"]) == 2 * plan.batch.microbatches


@given(plans)
def test_each_microbatch_adds_its_gradients_into_the_accumulator(plan):
    """One `accumulate` task per chunk and microbatch (none with one microbatch), after the chunk's weight
    gradients: three passes over the device's gradients, or over its shard when they accumulate sharded."""
    _, program = _program(plan)
    _, grad_b, _ = state_bytes_per_param(plan)
    m, v = plan.batch.microbatches, plan.schedule.virtual_stages
    ways = plan.mesh.fsdp * (plan.mesh.data if plan.zero >= 2 else 1)
    for s, rep in enumerate(program.representatives):
        adds = [t for t in program.tasks if t.device == rep and t.name.startswith("accumulate ")]
        if m == 1:
            assert adds == []
            continue
        assert len(adds) == m * v and all(t.stream == "compute" and t.flops == 0 for t in adds)
        total = sum(t.hbm_bytes for t in adds)
        params = sum(model.chunk_cost(plan, s, c).params for c in range(v))
        assert math.isclose(total, m * 3 * params * grad_b / ways, rel_tol=1e-9)
        kind = "W" if build_schedule(plan.schedule.name, plan.mesh.stage, m, v).split_backward else "B"
        for t in adds:  # right after a weight-gradient action of the same label (and its tensor collectives)
            source = program.tasks[t.deps[0]].name.removeprefix("tp ").split(" ")[0].split("/")[0]
            assert source == t.name.removeprefix("accumulate ") and source.startswith(kind)
