"""The play floor (testbed.explore.play_floor): at every action of the analytic tier's play, a stage's free time plus
the floors of what it has left never passes the step the play ends at, and an estimate stopped at a bar is above it."""

from __future__ import annotations

import math

import pytest

from testbed.explore.analytic import estimate
from testbed.explore.prices import StepPrices
from testbed.explore.play import Play
from testbed.explore.play_floor import action_floors, stage_rests
from testbed.plan.placement import place
from testbed.sim.step.facts import step_facts, topology_rules
from testbed.sim.step.step_rules import action_steps
from testbed.sim.step.update_facts import update_seconds
from testbed.topology.io import load_topology

from helpers import sampled_plans


def _bounds(plan, topology) -> tuple[list[float], float]:
    """Each stage's free time plus its floors left, after each action of the plan's play, and the step it ends at."""
    ids = place(plan, topology).device_ids
    facts = step_facts(plan, ids, **topology_rules(topology))
    step = StepPrices(facts, topology, ids)
    floors = action_floors(step)
    rests = stage_rests(step, floors)
    play, bounds = Play(step, 1.0), [max(rests)]
    for ruled in action_steps(facts):
        play.action(ruled)
        s, action = ruled.stage, ruled.action
        rests[s] -= floors[(s, action.chunk, action.kind)]
        bounds.append(play.free[s] + rests[s])
    return bounds, max(max(play.update(s) for s in range(facts.stages)), play.host)


@pytest.mark.parametrize(("model", "topology_name", "devices"), [("gpt-1.3b", "dgx-h100-x4@16", 16),
                                                                 ("llama3-8b", "dgx-h100-x4", 32)])
def test_play_floor_never_passes_the_step(model: str, topology_name: str, devices: int) -> None:
    topology = load_topology(topology_name)
    for plan in sampled_plans(model, devices, 10, 5):
        bounds, step = _bounds(plan, topology)
        assert step == pytest.approx(estimate(plan, topology).step_time_s, rel=1e-12)
        assert max(bounds) <= step * (1 + 1e-12)
        assert 0 < bounds[0] <= step  # it bounds something before the play


def test_play_floor_counts_the_update_left_after_fusion() -> None:
    """On one v5e chip the optimizer's update runs in the weight gradients' epilogue (testbed.sim.step.update_facts
    .fused_update): the floor prices what is left of it, as the play does, so it stays under the step."""
    from pathlib import Path

    from testbed.plan.io import load_plan

    topology = load_topology("tpu-v5e-1")
    plans = Path(__file__).resolve().parent.parent / "benchmarks" / "tpu_chip" / "plans"
    for name in ("llama1b-bf16-flash", "gpt125m-bf16", "llama400m-bf16-full"):
        plan = load_plan(str(plans / f"{name}.yaml"))
        bounds, step = _bounds(plan, topology)
        assert step == pytest.approx(estimate(plan, topology).step_time_s, rel=1e-12)
        assert max(bounds) <= step * (1 + 1e-12), name


def test_an_estimate_stops_only_above_its_bar() -> None:
    topology = load_topology("dgx-h100-x4@16")
    for plan in sampled_plans("gpt-1.3b", 16, 8, 11):
        whole = estimate(plan, topology)
        for bar in (0.5 * whole.step_time_s, 0.95 * whole.step_time_s, whole.step_time_s, math.inf):
            out = estimate(plan, topology, bar=bar)
            if isinstance(out, float):
                assert bar < out <= whole.step_time_s
            else:
                assert out == whole
        assert isinstance(estimate(plan, topology, bar=0.5 * whole.step_time_s), float) or whole.step_time_s == 0


def test_play_floor_counts_the_comm_slowdown_beside_gathers() -> None:
    """fsdp plans on a device whose compute slows beside its communication (``device.comm_slowdown``): the floor of
    an action priced whole counts the slowdown over its gathers, and still never passes the step."""
    from dataclasses import replace

    topology = load_topology("dgx-h100-superpod@64")
    assert topology.device.comm_slowdown > 0
    plain = replace(topology, device=replace(topology.device, comm_slowdown=0.0))
    plans = [p for p in sampled_plans("llama3-8b", 64, 200, 7) if p.mesh.fsdp > 1][:6]
    assert plans
    slowed = 0
    for plan in plans:
        bounds, step = _bounds(plan, topology)
        assert max(bounds) <= step * (1 + 1e-12)
        ids = place(plan, topology).device_ids
        facts = step_facts(plan, ids, **topology_rules(topology))
        with_rate, without = action_floors(StepPrices(facts, topology, ids)), action_floors(StepPrices(facts, plain, ids))
        assert all(with_rate[k] >= without[k] for k in without)
        slowed += sum(with_rate[k] > without[k] for k in without)
    assert slowed  # some actions' floors count it


def test_stage_rests_add_each_floor_in_the_schedules_order() -> None:
    """stage_rests' sums are the optimizer's compute plus each action's floor added one by one in the order played
    (the play takes them off one by one: the bounds it checks are those sums' own, to the bit)."""
    topology = load_topology("dgx-h100-x4")
    for plan in sampled_plans("llama3-8b", 32, 10, 7):
        ids = place(plan, topology).device_ids
        facts = step_facts(plan, ids, **topology_rules(topology))
        step = StepPrices(facts, topology, ids)
        floors = action_floors(step)
        want = [update_seconds(topology, step.dtype, u) for u in facts.updates]
        for s, action, _ in facts.order:
            want[s] += floors[(s, action.chunk, action.kind)]
        assert stage_rests(step, floors) == want
