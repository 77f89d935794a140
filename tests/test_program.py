"""The task graph of one step: conservation of FLOPs and bytes, counts, dependencies, representatives."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from testbed.model import costs, layout
from testbed.model.memory import state_bytes_per_param
from testbed.plan.placement import place
from testbed.plan.runtime import PYTORCH_PROGRAM
from testbed.plan.spec import MESH_AXES, Axis, BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec
from testbed.model.spans import action_spans
from testbed.sim.step.action_work import action_work
from testbed.sim.step.facts import BUCKETS, OPTIMIZER_FLOPS_PER_PARAM, step_facts
from testbed.sim.step.grad_bytes import accumulated_in_the_backward, loop_kept
from testbed.sim.graph.program import TaskKind, axis_groups, build_program
from testbed.pipeline.schedules import build_schedule, sends
from testbed.plan.sharding import gradient_reduction, loss_merged, state_sharding

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
        assert math.isclose(actions, costs.step_flops_per_device(plan, s), rel_tol=1e-9)
        opt = [t for t in program.tasks if t.device == rep and t.name == "optimizer"]
        assert len(opt) == 1
        o_ways = plan.mesh.fsdp * (plan.mesh.data if plan.zero >= 1 else 1)
        # The optimizer updates its shard as the layout's one rule cuts it (leaves no dim of which o_ways
        # divides stay whole), as memory counts and the runner holds it.
        assert math.isclose(opt[0].flops, OPTIMIZER_FLOPS_PER_PARAM * costs.device_stage_params(plan, s, o_ways))


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
        # In a loop XLA keeps, bucket by bucket as the last microbatch's (grad_bytes.loop_kept), else one each
        each = len(firsts) if loop_kept(plan) else plan.schedule.virtual_stages
        assert len(accumulate) == (each * (plan.batch.microbatches - 1) if sharded else 0)
        assert math.isclose(sum(t.nbytes * t.count for t in accumulate),
                            sharded * (plan.batch.microbatches - 1) * costs.device_stage_params(plan, s) * grad_b,
                            rel_tol=1e-9)
        assert math.isclose(sum(t.nbytes for t in firsts), costs.device_stage_params(plan, s) * grad_b, rel_tol=1e-9)
        assert all(int(program.representative[d]) == rep for t in firsts for d in t.group)
        # One bucket per layer (at most BUCKETS; every layer, a block, when the parameters are sharded) when they
        # reduce during the backward (sharded accumulation); one per chunk when the replicas' gradients are summed
        # once, after the stage's backward (ZeRO 0/1).
        # The blocks are the embedding's and the head's too where the chunk holds them (testbed.model.blocks.own_blocks).
        during = bool(gradient_reduction(plan)[0])
        layers = plan.model.layers // (plan.mesh.stage * plan.schedule.virtual_stages)
        facts = step_facts(plan, place(plan, num_devices=plan.mesh.size).device_ids)
        # A block whose gradients all merge into a later block's reduce-scatters (XLA's combiner rule across pieces,
        # testbed.model.block_scatters.block_scatters) reduces none of its own.
        blocks = sum(sum(1 for b in chunk.bucket_sizes if b) if chunk.bucket_sizes else chunk.blocks
                     for chunk in facts.chunks[s])
        per_chunk = min(BUCKETS, layers)
        expected = blocks if state_sharding(plan).ways(plan, "params") > 1 else plan.schedule.virtual_stages * per_chunk
        assert len(firsts) == (expected if during else plan.schedule.virtual_stages)


@given(plans)
def test_a_microbatchs_reduce_scatter_waits_for_its_own_backward_and_never_for_a_send(plan):
    """Sharded accumulation (fsdp, ZeRO >= 2): each earlier microbatch's reduce-scatter depends on its own backward's
    compute alone, and runs on its stage's ``grad`` stream behind the stage's other reductions only (FSDP2 issues
    its reduce-scatters in order on one stream); the pipeline's sends run on ``pipe``, so neither queues behind the
    other (they share links only while both are in flight: docs/validation.md, "Meta's per-microbatch fp32
    reduce-scatters")."""
    _, program = _program(plan)
    tasks = program.tasks
    for t in tasks:
        if t.name.endswith("(accumulate)"):
            assert t.stream == "grad" and t.op == "reduce_scatter"
            assert [(tasks[d].stream, tasks[d].device, tasks[d].kind) for d in t.deps] == \
                [("compute", t.device, TaskKind.COMPUTE)]
        if t.stream == "grad":
            assert t.op != "send" and not t.name.startswith("send")
        if t.stream == "pipe":
            assert "reduce" not in t.name


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
                cost = costs.chunk_cost(plan, s, c)
                redo = cost.layers if plan.remat == "full" else 0  # full remat reruns the attention all-reduce
                loss = 2 if cost.loss_allreduce_bytes else 0  # the vocab-parallel loss's (two merged, then one)
                expected += plan.batch.microbatches * (cost.tensor_allreduces_forward + cost.tensor_allreduces_backward
                                                       + redo + loss)
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
    """Which collectives each ZeRO stage / fsdp uses (module docstring of testbed.sim.graph.program)."""
    plan = make_plan(data=2, fsdp=fsdp, zero=zero)
    _, program = _program(plan)
    used = {t.op for t in program.tasks if t.kind is TaskKind.COLLECTIVE and t.stream != "loss"}
    assert used == ops
    gathers = [t for t in program.tasks if t.stream == "gather"]
    sharded_params = fsdp > 1 or zero == 3
    assert bool(gathers) == sharded_params
    if sharded_params:  # every F and B gathers (its blocks' merged collectives, each with its first leaf's block)
        assert len({t.name.split("/")[0] for t in gathers}) == 2 * plan.batch.microbatches
        _, full = _program(replace(plan, remat="full"))
        assert len([t for t in full.tasks if t.stream == "gather"]) == len(gathers)


@pytest.mark.parametrize("microbatches,expected", [(1, [("data+fsdp", 1)]), (3, [("fsdp", 3), ("data", 1)])])
def test_the_loss_is_all_reduced_over_the_batch_axes(microbatches, expected):
    """The step's mean loss (one fp32 value) is all-reduced as the runner's compiled step does
    (testbed.plan.sharding.loss_reductions): with one microbatch once over every axis splitting the batch; with
    several each microbatch's within its data replica, then the replicas' once. Nothing waits for it."""
    plan = make_plan(data=2, fsdp=2, microbatches=microbatches, stage=2)
    placement, program = _program(plan)
    coords = {int(d): c for c, d in np.ndenumerate(placement.device_ids)}
    losses = [t for t in program.tasks if t.stream == "loss"]
    assert all(t.op == "all_reduce" and t.nbytes == 4 and t.device == program.representatives[-1] for t in losses)
    names = [a.value for a in MESH_AXES]
    found: dict[str, int] = {}
    for t in losses:
        members = np.array([coords[d] for d in t.group])
        label = "+".join(names[k] for k in range(members.shape[1]) if len(set(members[:, k].tolist())) > 1)
        found[label] = found.get(label, 0) + 1
    assert sorted(found.items()) == sorted(expected)
    waited = {d for t in program.tasks for d in t.deps}
    assert not waited & {i for i, t in enumerate(program.tasks) if t.stream == "loss"}


@given(plans)
def test_each_microbatch_adds_its_gradients_into_the_accumulator(plan):
    """One `accumulate` task per chunk and microbatch (none with one microbatch), after the chunk's weight
    gradients: three passes over the device's gradients, or over its shard when they accumulate sharded. In JAX's
    one SPMD step (testbed.sim.step.grad_bytes.accumulated_in_the_backward) the three passes are the weight-gradient
    action's own bytes instead, in its last span (where its weight gradients are), and no task of their own."""
    placement, program = _program(plan)
    _, grad_b, _ = state_bytes_per_param(plan)
    m, v = plan.batch.microbatches, plan.schedule.virtual_stages
    ways = plan.mesh.fsdp * (plan.mesh.data if plan.zero >= 2 else 1)
    for s, rep in enumerate(program.representatives):
        adds = [t for t in program.tasks if t.device == rep and t.name.startswith("accumulate ")]
        if m == 1:
            assert adds == []
            continue
        if accumulated_in_the_backward(plan):
            assert adds == []
            split = build_schedule(plan.schedule.name, plan.mesh.stage, m, v).split_backward
            for c in range(v):
                work = step_facts(plan, placement.device_ids).chunks[s][c].action("W" if split else "B")
                cost = costs.chunk_cost(plan, s, c)
                extra = work.work[1] - action_work(cost, work.kind, split, plan.remat)[1]
                assert math.isclose(extra, 3 * cost.params * grad_b, rel_tol=1e-9)
                if work.spans:
                    assert math.isclose(sum(b for _, b in work.spans) - sum(
                        b for _, b in action_spans(plan, cost, work.kind, split, 0)), extra, rel_tol=1e-9)
            continue
        assert len(adds) == m * v and all(t.stream == "compute" and t.flops == 0 for t in adds)
        total = sum(t.hbm_bytes for t in adds)
        params = sum(costs.chunk_cost(plan, s, c).params for c in range(v))
        assert math.isclose(total, m * 3 * params * grad_b / ways, rel_tol=1e-9)
        kind = "W" if build_schedule(plan.schedule.name, plan.mesh.stage, m, v).split_backward else "B"
        for t in adds:  # right after a weight-gradient action of the same label (and its tensor collectives)
            source = program.tasks[t.deps[0]].name.removeprefix("tp ").split(" ")[0].split("/")[0]
            assert source == t.name.removeprefix("accumulate ") and source.startswith(kind)


@given(plans, st.sampled_from([0.0, 1024.0, None]))
def test_parameter_collectives_follow_the_rule(plan, combine):
    """Every gather of a chunk's sharded parameters, and its gradient reduce-scatters (each earlier microbatch's,
    the last one's buckets together), is as many collectives as testbed.plan.sharding's rule counts under the
    topology's combine_bytes (None: the stack's bound, testbed.model.leaves.combine_limit: XLA's default threshold
    for the runner's JAX program), the chunk's bytes shared among them."""
    from testbed.model.leaves import combine_limit, gathered_leaves, parameter_collectives, regathered

    placement = place(plan, num_devices=plan.mesh.size)
    program = build_program(plan, placement, combine_bytes=combine)
    facts = step_facts(plan, placement.device_ids, combine)
    param_b, grad_b, _ = state_bytes_per_param(plan)
    v, sharded = plan.schedule.virtual_stages, bool(state_sharding(plan).split_axes(plan, "params"))
    for s, rep in enumerate(program.representatives):
        for c in range(v):
            limit = combine_limit(combine, plan.runtime.gather_combine_bytes)
            assert limit == (plan.runtime.gather_combine_bytes if combine is None else combine)
            n = parameter_collectives(plan, s, c, limit, param_b)
            leaves = len(gathered_leaves(plan, s, c))
            assert (n >= 1) == sharded and n <= max(1, leaves)
            small = sum(gathered_leaves(plan, s, c)) * param_b <= limit  # one chunk's gather within the bound
            assert n == (sharded if combine is None and small else max(1, leaves) if combine == 0 and sharded else n)
            cost = costs.chunk_cost(plan, s, c)
            mine = [t for t in program.tasks if t.device == rep and (m := re.search(r"[FBW]\d+(?:\.(\d+))?", t.name))
                    and int(m.group(1) or 0) == c]
            gathers = [t for t in mine if t.stream == "gather"]
            # The backward gathers neither the embedding again nor the additive leaves (biases, norm shifts).
            held = layout.chunk_params(plan.model, s, c, plan.mesh.stage, v, stage_layers=plan.stage_layers)
            skipped = [(p, k) for p, k in held if p.additive or (s == c == 0 and p.part is layout.Part.EMBEDDING)]
            unread = layout.held_elements(skipped, plan.mesh.tensor)
            for label in {t.name.split("/")[0] for t in gathers}:  # an action's gathers: one per block
                blocks = [t for t in gathers if t.name.split("/")[0] == label]
                backward = label.split()[-1].startswith("B")
                want = max(1, n - sum(k for _, k in skipped)) if backward and combine == 0 and skipped else n
                if backward and combine != 0 and not math.isinf(limit):  # each piece's merged on their own
                    want = regathered(plan, s, c, 0, n, limit, param_b)[1]
                # A block's gathers at their merged sizes (one task per distinct size, named for the block); a block
                # whose leaves joined an earlier block's collective has none.
                named = len({t.name for t in blocks})
                assert named <= facts.chunks[s][c].blocks  # the layers', the embedding's and the head's
                assert sum(t.count for t in blocks) == max(want, named)  # a block gathering is at least one collective
                assert math.isclose(sum(t.count * t.nbytes for t in blocks),
                                    (cost.params - (unread if backward else 0)) * param_b, rel_tol=1e-9)
            if not sharded:
                assert gathers == []
                continue
            scatters = [t for t in mine if t.op == "reduce_scatter"]
            accumulate = [t for t in scatters if t.name.endswith("(accumulate)")]
            buckets = [t for t in scatters if t not in accumulate]
            if loop_kept(plan):  # each earlier microbatch's bucket by bucket, as the last one's
                assert sum(t.count for t in accumulate) == (plan.batch.microbatches - 1) * sum(t.count for t in buckets)
            else:
                assert all(t.count == n for t in accumulate)
            assert math.isclose(sum(t.count * t.nbytes for t in accumulate),
                                (plan.batch.microbatches - 1) * cost.params * grad_b, rel_tol=1e-9)
            assert sum(t.count for t in buckets) == n or len(buckets) > n  # a bucket is at least one collective
            assert math.isclose(sum(t.count * t.nbytes for t in buckets), cost.params * grad_b, rel_tol=1e-9)


@pytest.mark.parametrize("framework", ["jax", "pytorch"])
def test_in_a_loop_xla_keeps_a_microbatch_begins_once_the_one_before_it_has_ended(framework):
    """JAX's one SPMD step accumulates its microbatches in a ``lax.scan`` XLA keeps (grad_bytes.loop_kept): the
    second microbatch's gathers and forward wait for everything of the first, whose gradients leave bucket by bucket
    as its backward makes them (the loop body's reduce-scatters); a PyTorch step's next microbatch starts beside the
    first's one reduce-scatter (FSDP's post-backward hooks, on a stream of their own)."""
    plan = make_plan(fsdp=4, microbatches=2, layers=4)
    plan = replace(plan, runtime=replace(plan.runtime, **(PYTORCH_PROGRAM if framework == "pytorch" else {})))
    _, program = _program(plan)
    tasks = program.tasks
    joins = [i for i, t in enumerate(tasks) if t.name.startswith("iteration ")]
    scatters = [i for i, t in enumerate(tasks) if t.name.endswith("(accumulate)")]
    if framework == "pytorch":
        assert joins == [] and len(scatters) == 1
        return
    chunk = step_facts(plan, place(plan, num_devices=4).device_ids).chunks[0][0]
    assert len(joins) == 1 and len(scatters) == sum(len(chunk.bucket(chunk.buckets, k)) for k in range(chunk.buckets))
    assert set(scatters) <= set(tasks[joins[0]].deps)
    after = {joins[0]}  # the tasks that wait for the join: through their dependencies, or behind it in order
    for i, t in enumerate(tasks):
        if after.intersection(t.deps) or (i > joins[0] and t.stream == "compute"):
            after.add(i)
    second = [i for i, t in enumerate(tasks) if t.name.startswith(("F1", "gather F1", "B1", "gather B1"))]
    assert second and set(second) <= after


def test_host_counts_one_collective_per_leaf():
    """The bundled host (XLA:CPU combines none) gathers the validation suite's fsdp8 GPT leaf by leaf: 53
    all-gathers per pass (forward and backward, spread over the blocks) and 53 reduce-scatters, the rule's
    count (tests/test_fsdp_runner.py checks the rule against XLA); a topology without combine_bytes combines
    within XLA's default threshold (testbed.model.leaves.combine_limit), one per block of this small GPT."""
    from testbed.plan.io import load_plan
    from testbed.model.leaves import combined_sizes, gathered_leaves
    from testbed.sim.graph.engine import simulate
    from testbed.topology.io import load_topology

    host = load_topology("host-cpu-8")
    assert host.calibration.collectives.combine_bytes == 0
    plan = load_plan("plans/validation/fsdp8.yaml")
    assert len(gathered_leaves(plan, 0, 0)) == 53
    tasks = simulate(plan, host).program.tasks
    blocks = plan.model.layers
    # The backward: not the embedding's 2, nor the 25 additive leaves (6 biases and shifts a layer, the final shift).
    assert sum(t.count for t in tasks if t.op == "all_gather") == 53 + 53 - 2 - 25
    # leaf by leaf: every block gathers, the embedding's and the head's blocks of their own (the backward's embedding
    # block gathers nothing)
    assert len({t.name for t in tasks if t.op == "all_gather"}) == 2 * (blocks + 2) - 1
    assert sum(t.count for t in tasks if t.op == "reduce_scatter") == 53
    # ZeRO-1 re-gathers the updated parameters over data leaf by leaf too (53 all-gathers in zero1-dp8's step).
    zero1 = load_plan("plans/validation/zero1-dp8.yaml")
    assert [t.count for t in simulate(zero1, host).program.tasks if t.name == "gather params"] == [53]
    merged = replace(host, calibration=host.calibration.updated(collectives={"combine_bytes": None}))
    # Within XLA's default bound: the forward's gathers (all issued before its blocks compute) one collective, in the
    # first block, its first leaf's; the backward's (a linked layer's gather waits for a cotangent two pieces back,
    # so a merge spans two adjacent pieces; the last layer's, unlinked, for its own, which the head's backward
    # computes: testbed.model.leaves.backward_waits) the head alone, then pairs of layers from the last, each in
    # its first piece's block, at their own sizes.
    gathers = [t for t in simulate(plan, merged).program.tasks if t.op == "all_gather"]
    assert [(t.name, t.count) for t in gathers] == [("gather F0/0", 1), *[(f"gather B0/{k}", 1) for k in (0, 1, 3)]]
    leaf_by_leaf = simulate(plan, host).program.tasks  # the same forward bytes, merged into one
    assert gathers[0].nbytes == sum(t.count * t.nbytes for t in leaf_by_leaf if t.name.startswith("gather F"))
    assert [t.count for t in simulate(zero1, merged).program.tasks if t.name == "gather params"] == [1]
    # The combiner's rule: consecutive collectives merge while the merged one stays within the threshold.
    assert combined_sizes((4.0, 4.0, 8.0, 2.0, 1.0), 8.0) == (8.0, 8.0, 3.0)
    assert combined_sizes((4.0, 4.0), 0.0) == (4.0, 4.0) and combined_sizes((4.0, 4.0), math.inf) == (8.0,)


@pytest.mark.parametrize("precision,fsdp", [("bf16-mixed", 1), ("fp32", 1), ("bf16-mixed", 2)])
def test_the_norms_gradients_are_reduced_in_fp32_where_the_partitioner_sums_them(precision, fsdp):
    """Under bf16-mixed the replicated gradients are all-reduced at 2 bytes each, but the norms' at 4: JAX sums
    bf16 in fp32 and the partitioner reduces those fp32 partial sums (the traced runner step's bytes,
    tests/test_program_vs_plan.py). Sharded gradients are the runner's own bf16 psum_scatter: no extra. fp32 sums
    take the loss's 4 bytes along (XLA's combiner merges all-reduces of one element type)."""
    plan = replace(make_plan(data=2 // fsdp, fsdp=fsdp, microbatches=1), precision=precision)
    _, program = _program(plan)
    moved = sum(t.nbytes * t.count for t in program.tasks
                if t.kind is TaskKind.COLLECTIVE and t.stream not in ("loss", "gather"))
    params = layout.model_params(plan.model)
    everything = sum(math.prod(p.shape) * (plan.model.layers if p.part is layout.Part.LAYER else 1) for p in params)
    norms = sum(math.prod(p.shape) * (plan.model.layers if p.part is layout.Part.LAYER else 1) for p in params
                if p.path[0] in ("ln1", "ln2", "norm"))
    grad_b = 2 if precision == "bf16-mixed" else 4
    loss = 4 if loss_merged(plan, grad_b) else 0  # fp32 gradient sums carry the loss (testbed.plan.sharding)
    assert moved == everything * grad_b + (norms * 2 if grad_b == 2 and fsdp == 1 else 0) + loss


@pytest.mark.parametrize("zero", [0, 1])
def test_sequence_parallel_replicated_gradients_are_summed_over_tensor_too(zero):
    """Under sequence parallelism each tensor rank computes on its sequence shard: the tensor-replicated
    parameters' gradients (norms at fp32, row-parallel biases) are all-reduced over data and tensor at once, the
    learned position table's over data as each rank's 1/t shard (the traced runner step's reductions). With the
    optimizer state sharded (ZeRO-1) the plan keeps the dense rule. In one SPMD step of one microbatch the sum over
    data and tensor leaves as the backward's compute ends, on a stream of its own
    (testbed.sim.step.grad_bytes.summed_in_the_step)."""
    plan = replace(make_plan(data=2, tensor=2, microbatches=1, zero=zero), sequence_parallel=True,
                   precision="bf16-mixed")
    placement, program = _program(plan)
    both = axis_groups(placement, [Axis.DATA, Axis.TENSOR])[0]
    over_both = [t for t in program.tasks if t.kind is TaskKind.COLLECTIVE and t.group in both
                 and t.stream in ("grad", "sequence")]
    if zero:
        assert not over_both
        return
    m, t = plan.model, plan.mesh.tensor
    norms = 2 * m.d_model * (2 * m.layers + 1)  # scale and shift of two norms per layer and the final one
    biases = 2 * m.d_model * m.layers  # attention's and the MLP's output biases
    assert sum(x.nbytes * x.count for x in over_both) == norms * 4 + biases * 2
    data = axis_groups(placement, [Axis.DATA])[0]
    dense = sum(x.nbytes * x.count for x in program.tasks if x.stream == "grad" and x.group in data)
    params = sum(math.prod(p.shape) * (m.layers if p.part is layout.Part.LAYER else 1) for p in layout.model_params(m))
    split = params - norms - biases - m.seq_len * m.d_model  # the rest, split over tensor but the positions
    assert dense == split // t * 2 + m.seq_len * m.d_model // t * 2


def test_sequence_parallel_replicated_gradients_under_fsdp_are_summed_over_tensor_on_their_own():
    """With the parameters sharded (fsdp), the runner reduce-scatters every leaf's gradient over fsdp in its map,
    and the partitioner first sums the tensor-replicated parameters' partial sums over tensor alone (norms at
    fp32, the row-parallel biases at 2 bytes), the whole leaves (the traced runner step's bytes,
    tests/test_program_vs_plan.py); the reduce-scatters still carry every parameter."""
    plan = replace(make_plan(fsdp=2, tensor=2, microbatches=1), sequence_parallel=True, precision="bf16-mixed")
    placement, program = _program(plan)
    tensor = axis_groups(placement, [Axis.TENSOR])[0]
    fsdp = axis_groups(placement, [Axis.FSDP])[0]
    grads = [t for t in program.tasks if t.kind is TaskKind.COLLECTIVE and t.stream == "grad"]
    m, t = plan.model, plan.mesh.tensor
    norms = 2 * m.d_model * (2 * m.layers + 1)
    biases = 2 * m.d_model * m.layers
    assert sum(x.nbytes * x.count for x in grads if x.group in tensor and x.op == "all_reduce") == norms * 4 + biases * 2
    params = sum(math.prod(p.shape) // (t if p.tensor_dim is not None else 1)
                 * (m.layers if p.part is layout.Part.LAYER else 1) for p in layout.model_params(m))
    assert sum(x.nbytes * x.count for x in grads if x.group in fsdp and x.op == "reduce_scatter") == params * 2


def test_additive_parameters_are_the_biases_and_the_norms_shifts():
    """The parameters no backward reads (testbed.model.leaves.regathered_in_backward gathers the rest again)."""
    from testbed.model.leaves import regathered_in_backward

    spec = ModelSpec(layers=1, d_model=32, heads=4, d_ff=64, seq_len=16, vocab=64)
    additive = {p.name for p in layout.model_params(spec) if not regathered_in_backward(p)}
    assert additive == {"layers/ln1/bias", "layers/attn/bqkv", "layers/attn/bo", "layers/ln2/bias", "layers/mlp/b1",
                        "layers/mlp/b2", "head/norm/bias"}
