"""The slowed floor (testbed.explore.slowed_floor): each action it lengthens stays under the analytic tier's own action
floor (testbed.explore.play_floor.action_floors, which holds under the play), and the floor under the estimate."""

from __future__ import annotations

import random

import pytest

from testbed.explore.analytic import estimate, plan_memory
from testbed.explore.floor import played_floor, step_floor
from testbed.explore.gather_floor import middle_gathers
from testbed.explore.play_floor import action_floors
from testbed.explore.prices import StepPrices
from testbed.explore.slowed_floor import slowed_action_floors, slowed_floor
from testbed.explore.space import SearchSpace, candidates, preset_plan
from testbed.plan.placement import place
from testbed.sim.step.facts import step_facts, topology_rules
from testbed.topology.io import load_topology

SPACE = SearchSpace(schedules=("1f1b", "interleaved", "zb-h1"), microbatches=(4, 8), zero=(0, 3),
                    remat=("none", "selective", "full"), sequence_parallel=(False, True))


def _plans(model: str, devices: int, space: SearchSpace, count: int, seed: int, sharded: bool = True) -> list:
    plans = [p for p in candidates(preset_plan(model), devices, space)
             if not sharded or p.mesh.fsdp > 1 or p.zero == 3]
    random.Random(seed).shuffle(plans)
    return plans[:count]


def _tier_floors(plan, topology) -> dict:
    ids = place(plan, topology).device_ids
    return action_floors(StepPrices(step_facts(plan, ids, **topology_rules(topology)), topology, ids))


@pytest.mark.parametrize(("model", "devices"), [("gpt-1.3b", 32), ("llama3-8b", 64)])
def test_slowed_floor_is_under_the_tiers_action_floors_and_its_estimate(model: str, devices: int) -> None:
    """Dense fsdp/ZeRO-3 plans (pipelines, interleaved and zero-bubble too) on a topology whose compute slows beside
    its communication: every lengthened action at most the tier's floor of it, the floor at most the estimate, and
    above the step and played floors on some."""
    topology = load_topology(f"dgx-h100-superpod@{devices}")
    assert topology.device.comm_slowdown > 0
    checked, above, lengthened, kinds = 0, 0, 0, set()
    for plan in _plans(model, devices, SPACE, 400, 3):
        if not plan_memory(plan, topology).fits:
            continue
        priced = slowed_action_floors(plan, topology)
        if priced is None:
            continue
        tier = _tier_floors(plan, topology)
        for s, c, kind in middle_gathers(plan, topology):  # the actions it lengthens
            assert priced[s][(c, kind)] <= tier[(s, c, kind)] * (1 + 1e-9), (plan.mesh, s, c, kind)
            lengthened += 1
        floor = slowed_floor(plan, topology)
        assert 0 < floor <= estimate(plan, topology).step_time_s
        above += floor > max(step_floor(plan, topology), played_floor(plan, topology)) * (1 + 1e-6)
        kinds.add((plan.mesh.stage > 1, plan.schedule.virtual_stages > 1, plan.schedule.name.value))
        checked += 1
        if checked >= 24:
            break
    assert checked >= 12 and above >= checked // 2 and lengthened >= checked
    assert (True, True, "interleaved") in kinds


def test_slowed_floor_leaves_other_plans_alone() -> None:
    """No slowdown (a topology without it, TPU), no prefetch, MoE models and unsharded parameters: nothing added."""
    from dataclasses import replace

    h100 = load_topology("dgx-h100-x4")
    plan = next(p for p in _plans("gpt-1.3b", 32, SPACE, 200, 1) if p.zero == 3)
    assert h100.device.comm_slowdown == 0 and slowed_floor(plan, h100) == 0.0
    superpod = load_topology("dgx-h100-superpod@32")
    assert slowed_floor(replace(plan, runtime=replace(plan.runtime, fsdp_prefetch=0)), superpod) == 0.0
    unsharded = next(p for p in _plans("gpt-1.3b", 32, SPACE, 200, 1, False) if p.zero == 0 and p.mesh.fsdp == 1)
    assert slowed_floor(unsharded, superpod) == 0.0
    moe = next(p for p in _plans("mixtral-8x7b", 32, SearchSpace(zero=(3,)), 50, 1))
    assert slowed_floor(moe, superpod) == 0.0
