"""The played floor's play (testbed.explore.floor.played_at) and its memo: the schedule's dependency order played at
each stage's floors, to the bit as the plain play of testbed.sim.step.memo.cached_order, and memoized on what it
reads (plans alike in order and floors share one play; others do not). The stage floors' memo on
testbed.explore.floor.floor_key: each plan's floors, and the computes beside them, those priced afresh for it."""

from __future__ import annotations

import random

from testbed.collectives.routed import topology_memo
from helpers import sampled_plans

from testbed.explore.floor import _stage_floors, floor_key, played_at, played_floor, stage_floors
from testbed.explore.space import SearchSpace, candidates, preset_plan
from testbed.sim.step.memo import cached_order
from testbed.topology.io import load_topology

SPACE = SearchSpace(schedules=("1f1b", "interleaved", "zb-h1", "gpipe"), microbatches=(1, 4, 8, 16),
                    zero=(0, 1, 3), remat=("none", "selective", "full"))


def _plain(plan, priced) -> float:
    """Each action once what it waits for on other stages has ended and its stage is free, at its floor."""
    end: dict[tuple, float] = {}
    free = [0.0] * plan.mesh.stage
    for s, a, w in cached_order(plan.schedule.name.value, plan.mesh.stage, plan.batch.microbatches,
                                plan.schedule.virtual_stages)[1]:
        start = max([free[s], *(end[key] for key in w.ends + w.receives if key[0] != s)])
        free[s] = end[(s, a.kind, a.microbatch, a.chunk)] = start + priced[s][(a.chunk, a.kind)]
    return max(free)


def test_played_at_is_the_plain_play_to_the_bit() -> None:
    topology = load_topology("dgx-h100-x4")
    plans = [p for p in candidates(preset_plan("llama3-8b"), 32, SPACE) if p.mesh.stage > 1]
    random.Random(11).shuffle(plans)
    for plan in plans[:24]:
        priced = stage_floors(plan, topology)
        assert played_at(plan, priced) == _plain(plan, priced)


def test_the_played_floor_memo_keys_on_order_and_floors() -> None:
    topology = load_topology("dgx-h100-x4")
    plans = [p for p in candidates(preset_plan("llama3-8b"), 32, SPACE) if p.mesh.stage > 1]
    random.Random(12).shuffle(plans)
    for plan in plans[:24]:
        want = _plain(plan, stage_floors(plan, topology))
        assert played_floor(plan, topology) == want
        memo = topology_memo(topology)["played_at"]
        key = next(k for k in memo if k[:4] == (plan.schedule.name, plan.mesh.stage, plan.batch.microbatches,
                                                 plan.schedule.virtual_stages)
                   and k[4] == tuple(tuple(c.items()) for c in stage_floors(plan, topology)))
        assert memo[key] == want


def test_the_stage_floors_memo_returns_each_plans_own_floors() -> None:
    # Plans sharing a floor_key (ZeRO stages and data/fsdp splits alike in what the floors read) meet one entry:
    # each must get what its own pricing gives, to the bit, computes too.
    for topology in (load_topology("dgx-h100-x4"), load_topology("tpu-v5e-16x16")):
        plans = sampled_plans("llama3-8b", 32, 160, 14)
        assert len({floor_key(p) for p in plans}) < len(plans)  # the sample holds plans sharing a key
        for plan in plans:
            computes: list = []
            got = stage_floors(plan, topology, computes)
            fresh: list = []
            assert got == _stage_floors(plan, topology, fresh)
            assert computes == (fresh if got is not None else [])
