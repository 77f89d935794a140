"""One step, worked out once: the task graph and the analytic tier both play one StepFacts object.

testbed.sim.step.facts works out a step's stages, chunks, schedule order, sharding, costs, collectives and
sends; testbed.sim.graph.program builds the task graph from it and testbed.explore.analytic plays it. These
tests build both from one facts object and check that each reads it (and only it): what the facts say
is what the graph holds, and a change to the facts moves both.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from testbed.explore.analytic import estimate, estimate_of, plan_memory
from testbed.plan.io import load_plan
from testbed.plan.placement import place
from testbed.plan.spec import Precision
from testbed.sim.step.facts import OPTIMIZER_FLOPS_PER_PARAM, StepFacts, step_facts
from testbed.sim.graph.program import TaskKind, build_program, program_of
from testbed.topology.io import load_topology

CASES = [("gpt-small-dgx", "dgx-h100"), ("mixtral-8x7b", "dgx-h100-x4"), ("llama-tiny", "host-cpu-8")]


def _facts(name: str, topology_name: str):
    plan, topology = load_plan(name), load_topology(topology_name)
    placement = place(plan, topology)
    facts = step_facts(plan, placement.device_ids, topology.calibration.collectives.combine_bytes)
    return plan, topology, placement, facts


@pytest.mark.parametrize(("name", "topology_name"), CASES)
def test_graph_and_estimate_come_from_one_facts_object(name: str, topology_name: str) -> None:
    plan, topology, placement, facts = _facts(name, topology_name)
    program = program_of(facts, placement)
    assert program.tasks == build_program(plan, placement, combine_bytes=facts.combine_bytes).tasks
    memory = plan_memory(plan, topology)
    assert estimate_of(facts, topology, placement.device_ids, memory) == estimate(plan, topology)
    # What the facts say is what the graph holds: each stage's actions' FLOPs (the MoE chain's and the ring's
    # pieces included), its sends and gathers, and its optimizer update.
    for s, rep in enumerate(facts.representatives):
        own = [(a, facts.chunks[s][a.chunk].action(a.kind)) for st, a, _ in facts.order if st == s]
        tasks = [t for t in program.tasks if t.device == rep]
        flops = sum(t.flops for t in tasks if t.pipeline and t.kind is TaskKind.COMPUTE)
        assert math.isclose(flops, sum(w.work[0] for _, w in own), rel_tol=1e-9)
        assert sum(1 for t in tasks if t.stream == "pipe") == sum(len(w.sends) for _, w in own)
        assert sum(1 for t in tasks if t.stream == "gather") == sum(facts.gathers(a.kind) for a, _ in own)
        (optimizer,) = [t for t in tasks if t.name == "optimizer"]
        assert optimizer.flops == facts.updates[s].flops and optimizer.hbm_bytes == facts.updates[s].hbm_bytes


def _heavier_update(facts: StepFacts, factor: float) -> StepFacts:
    updates = tuple(replace(u, flops=u.flops * factor, hbm_bytes=u.hbm_bytes * factor) for u in facts.updates)
    return replace(facts, updates=updates)


@pytest.mark.parametrize(("name", "topology_name"), CASES[:2])
def test_both_tiers_read_the_facts_not_the_plan(name: str, topology_name: str) -> None:
    """A heavier optimizer update in the facts (the plan unchanged) lengthens the graph's optimizer tasks and the
    estimate's step alike."""
    plan, topology, placement, facts = _facts(name, topology_name)
    heavy = _heavier_update(facts, 100.0)
    before, after = program_of(facts, placement), program_of(heavy, placement)
    for t0, t1 in zip(before.tasks, after.tasks, strict=True):
        assert (t1.flops == 100 * t0.flops) if t0.name == "optimizer" else t1 == t0
    memory = plan_memory(plan, topology)
    light = estimate_of(facts, topology, placement.device_ids, memory)
    slow = estimate_of(heavy, topology, placement.device_ids, memory)
    assert slow.compute_s > light.compute_s and slow.step_time_s > light.step_time_s


def test_facts_are_frozen_and_the_order_puts_dependencies_first() -> None:
    _, _, _, facts = _facts("gpt-small-dgx", "dgx-h100")
    with pytest.raises(AttributeError):
        facts.params_ways = 3  # type: ignore[misc]
    _, _, _, piped = _facts("gpt-1b-cluster", "dgx-h100-x4")  # interleaved over 4 stages
    for facts in (facts, piped):
        _dependencies_first(facts)
    assert any(waits.receives for _, _, waits in piped.order)


def _dependencies_first(facts) -> None:
    seen: set[tuple] = set()
    for s, action, waits in facts.order:
        assert all(key in seen for key in waits.ends + waits.receives)
        # its own stage's actions it waits for as they end, other stages' as their sends arrive (both tiers)
        assert all(key[0] == s for key in waits.ends) and all(key[0] != s for key in waits.receives)
        seen.add((s, action.kind, action.microbatch, action.chunk))
    assert len(seen) == sum(len(row) for row in facts.schedule.actions)


def test_the_update_moves_the_state_the_memory_model_keeps() -> None:
    """The optimizer update's HBM bytes per parameter of its shard follow the state the plan keeps: mixed
    precision with an fp32 master reads the gradient, writes the bf16 parameters and reads and writes master and
    moments; ``state_dtype: bf16`` has no master, so its bf16 weights are read and written in place beside bf16
    moments; fp32 training has no separate master either."""
    plan, _, placement, _ = _facts("gpt-small-dgx", "dgx-h100")
    m = plan.optimizer.moments

    def per_param(p):
        facts = step_facts(p, placement.device_ids)
        update = facts.updates[0]
        return update.hbm_bytes / (update.flops / OPTIMIZER_FLOPS_PER_PARAM)

    assert plan.precision.mixed and plan.runtime.state_dtype == "fp32"
    assert per_param(plan) == pytest.approx(2 + 2 + 2 * (4 + 4 * m))
    bf16_state = replace(plan, runtime=replace(plan.runtime, state_dtype="bf16"))
    assert per_param(bf16_state) == pytest.approx(2 + 2 * 2 + 2 * (2 * m))
    fp32 = replace(plan, precision=Precision.FP32)
    assert per_param(fp32) == pytest.approx(4 + 2 * 4 + 2 * (4 * m))
