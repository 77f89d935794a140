"""The search at flagship scale (issue 35): uneven stages in the space, exact pruning, progress off a terminal.

The pruning must not change what the search finds: its memory bounds are
exact lower bounds of the memory model, its step floor a lower bound of the
analytic estimate (checked on flagship-scale plans too), the best-first tier
finds the fastest estimates estimating all does, and the collective bounds of
a hierarchy are the same with one group of each kind as with all of them. The
flagship search itself (Llama 3 405B on 16,384 H100s as typed, its best plan
no slower than Meta's published layout) is benchmarks/flagship_search.py:
about a minute of CPU, which exits 1 when the property fails.
"""

from __future__ import annotations

from dataclasses import replace
import random

import numpy as np
import pytest

from testbed.collectives.bounds import distinct_groups, lower_bound
from testbed.collectives.timing import groups_time, timed_groups
from testbed.errors import InputError
from testbed.explore.analytic import estimate, plan_memory
from testbed.explore.floor import placed_floor, played_floor, step_floor
from testbed.explore.search import _analytic_tier, _overflows, evaluate
from testbed.explore.space import SearchSpace, candidate_groups, candidates, preset_plan
from testbed.model.memory import state_floor
from testbed.plan.stages import balanced_ends, near_even
from testbed.topology.io import load_topology


def test_near_even_split() -> None:
    """Each stage within one layer of the others, the ends lighter; Llama 3's split where balanced-ends applies."""
    assert near_even(126, 16) == balanced_ends(126, 16) == (7,) + (8,) * 14 + (7,)
    assert near_even(10, 4) == (2, 3, 3, 2) and near_even(7, 2) == (4, 3) and near_even(9, 4) == (2, 3, 2, 2)
    assert near_even(8, 4) is None and near_even(3, 4) is None
    for layers in range(1, 40):
        for stages in range(2, 12):
            split = near_even(layers, stages)
            if split is not None:
                assert sum(split) == layers and max(split) - min(split) == 1 and split[-1] == min(split)


def test_candidates_include_uneven_stages() -> None:
    base = preset_plan("llama3-405b")
    plans = list(candidates(base, 128, SearchSpace(schedules=("1f1b", "interleaved"), zero=(1,), remat=("full",),
                                                      microbatches=(16,))))
    stages = {p.mesh.stage: p.stage_layers for p in plans}
    assert stages[16] == (7,) + (8,) * 14 + (7,) and stages[2] == (63, 63) and stages[32][0] == 3
    # Interleaved too: uneven stages split over their chunks (testbed.plan.stages.chunk_counts), as Meta's layout.
    inter = {(p.mesh.stage, p.schedule.virtual_stages): p.layers_per_stage for p in plans
             if p.schedule.name.value == "interleaved"}
    assert inter[(16, 2)] == inter[(16, 4)] == (7,) + (8,) * 14 + (7,)
    assert inter[(2, 3)] is None and (2, 2) not in inter  # an even stage split keeps even chunks (126 = 2 x 3 x 21)


def test_group_kinds_bound_as_all_groups() -> None:
    """A hierarchy's translated groups: one of each kind gives the slowest bound of all of them."""
    topology = load_topology("dgx-h100-x4")
    for groups in ([tuple(range(i, 32, 8)) for i in range(8)], [tuple(range(i * 8, i * 8 + 8)) for i in range(4)],
                   [(0, 1, 8, 9), (2, 3, 10, 11), (16, 17, 18, 19)]):
        groups = tuple(groups)
        kinds = distinct_groups(topology, groups)
        assert set(kinds) <= set(groups)
        for op in ("all_reduce", "all_gather", "broadcast"):
            assert max(lower_bound(topology, op, g, 1e6) for g in kinds) == \
                max(lower_bound(topology, op, g, 1e6) for g in groups)


def test_group_kinds_are_each_kinds_first_group_in_order() -> None:
    """distinct_groups keeps the first group of each kind, in the order given (the rows' bytes decide kinds)."""
    topology = load_topology("dgx-h100-x4")
    groups = ((8, 9, 10, 11), (0, 1, 8, 9), (12, 13, 14, 15), (2, 3, 10, 11), (0, 1, 2, 3))
    assert distinct_groups(topology, groups) == ((8, 9, 10, 11), (0, 1, 8, 9))


def test_groups_time_takes_numpy_ranks_and_refuses_groups_of_unequal_size() -> None:
    """groups_time's normalization: numpy ranks time as Python ints do; groups of unequal size are bad input."""
    topology = load_topology("dgx-h100-x4")
    plain = groups_time(topology, "all_reduce", ((0, 1, 2, 3), (4, 5, 6, 7)), 1e6)
    assert groups_time(topology, "all_reduce", np.arange(8).reshape(2, 4), 1e6 + 0.0).time_s == plain.time_s
    with pytest.raises(InputError, match="same non-zero size"):
        groups_time(topology, "all_reduce", ((0, 1, 2, 3), (4, 5, 6)), 1e6)


def test_timed_groups_time_as_all_the_groups() -> None:
    """timed_groups: one group for translates on disjoint links, all of them otherwise; groups_time of them is that
    of all the groups, at every op and size (the analytic tier times them in their place)."""
    for name, groups in (("dgx-h100-x4", [tuple(range(i * 8, i * 8 + 8)) for i in range(4)]),
                         ("dgx-h100-x4", [tuple(range(i, 32, 8)) for i in range(8)]),
                         ("tpu-v5e-4x4", [tuple(range(i * 4, i * 4 + 4)) for i in range(4)]),
                         ("tpu-v5e-4x4", [(0, 1, 4, 5), (2, 3, 6, 7), (8, 9, 12, 13), (10, 11, 14, 15)])):
        topology = load_topology(name)
        timed = timed_groups(topology, np.asarray(groups))
        assert timed == tuple(groups) or timed == tuple(groups[:1])
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            for nbytes in (1e3, 1e6, 3e8):
                assert groups_time(topology, op, timed, nbytes).time_s == groups_time(topology, op, groups, nbytes).time_s
    assert len(timed_groups(load_topology("dgx-h100-x4"), [tuple(range(i * 8, i * 8 + 8)) for i in range(4)])) == 1


def test_pruning_bounds_are_lower_bounds() -> None:
    """Memory floors never above the exact worst device; the step floor never above the estimate."""
    topology = load_topology("dgx-h100-x4")
    plans = list(candidates(preset_plan("gpt-1.3b"), 32, SearchSpace(remat=("none", "full"), microbatches=(1, 4, 8),
                                                                    sequence_parallel=(False, True))))
    random.Random(0).shuffle(plans)
    checked = 0
    for plan in plans[:80]:
        memory = plan_memory(plan, topology)
        assert state_floor(plan) <= memory.total
        assert _overflows(plan, topology, 1.0, None) <= (not memory.fits)
        floor = step_floor(plan, topology)
        if floor is not None and memory.fits:
            assert floor <= estimate(plan, topology, memory).step_time_s
            checked += 1
    assert checked >= 10
    # At flagship scale, tensor-parallel plans (the floor counts their blocking tensor collectives) included.
    topology, flash = load_topology("llama3-h100-16k"), preset_plan("llama3-405b", 2048)
    flash = replace(flash, model=replace(flash.model, attention=type(flash.model.attention)("flash")))
    plans = [p for p in candidates(flash, 16_384, SearchSpace(schedules=("1f1b", "interleaved"), zero=(1,),
                                                             remat=("full",), sequence_parallel=(False, True)))
             if p.mesh.tensor > 1]
    random.Random(1).shuffle(plans)
    for plan in plans[:20]:
        floor, est = step_floor(plan, topology), estimate(plan, topology)
        assert floor is not None and floor <= est.step_time_s


def test_moe_floors_are_lower_bounds() -> None:
    """MoE plans, with and without expert parallelism's chains (Mixtral's every layer MoE; DeepSeek-MoE's first layer
    dense, shared experts beside the all-to-alls): the step floor and the played floor never above the estimate."""
    for name, seed in (("mixtral-8x7b", 4), ("deepseek-moe-16b", 5)):
        topology = load_topology("dgx-h100-x4")
        plans = [p for p in candidates(preset_plan(name), 32, SearchSpace(remat=("none", "full"), microbatches=(1, 4, 8),
                                                                          sequence_parallel=(False, True)))
                 if p.mesh.context == 1]
        random.Random(seed).shuffle(plans)
        chains = 0
        for plan in plans[:40]:
            est = estimate(plan, topology).step_time_s
            floor, played = step_floor(plan, topology), played_floor(plan, topology)
            assert floor is not None and floor * (1 - 1e-12) <= played <= est
            chains += plan.mesh.expert > 1
        assert chains >= 10


def test_placed_floor_is_a_lower_bound_above_the_step_floor() -> None:
    """The step floor with each plan's tensor collectives priced on its own placement: never above the estimate,
    never below the step floor where it applies, above it for most tensor-parallel plans (dense and MoE models, SP
    on and off, one node and a superpod, the flagship's)."""
    space = SearchSpace(remat=("none", "full"), microbatches=(1, 4, 8), sequence_parallel=(False, True))
    cases = [("gpt-1.3b", "dgx-h100-x4", 32, space, 0), ("mixtral-8x7b", "dgx-h100-x4", 32, space, 1),
             ("deepseek-moe-16b", "dgx-h100-x4", 32, space, 2),
             ("gpt-1.3b", "dgx-a100-superpod@64", 64, SearchSpace(schedules=("1f1b", "interleaved", "zb-h1"),
                                                                   sequence_parallel=(False, True)), 3)]
    applied = tighter = 0
    for name, topology_name, devices, sampled, seed in cases:
        topology = load_topology(topology_name)
        plans = [p for p in candidates(preset_plan(name), devices, sampled) if p.mesh.tensor > 1 and p.mesh.context == 1]
        random.Random(seed).shuffle(plans)
        for plan in plans[:20]:
            placed, floor = placed_floor(plan, topology), step_floor(plan, topology)
            assert placed <= estimate(plan, topology).step_time_s
            if placed:
                assert placed >= floor * (1 - 1e-12)
                applied += 1
                tighter += placed > floor * (1 + 1e-6)
    assert applied >= 30 and tighter >= 0.8 * applied
    topology, flash = load_topology("llama3-h100-16k"), preset_plan("llama3-405b", 2048)
    flash = replace(flash, model=replace(flash.model, attention=type(flash.model.attention)("flash")))
    plans = [p for p in candidates(flash, 16_384, SearchSpace(schedules=("1f1b", "interleaved"), zero=(1,),
                                                             remat=("full",), sequence_parallel=(False, True)))
             if p.mesh.tensor > 1]
    plans = [p for p in plans if p.mesh.fsdp == 1]  # (fsdp gathers: no placed floor)
    random.Random(4).shuffle(plans)
    for plan in plans[:8]:
        assert step_floor(plan, topology) <= placed_floor(plan, topology) <= estimate(plan, topology).step_time_s


def test_played_floor_is_a_lower_bound_above_the_step_floor() -> None:
    """The schedule played at each action's floor: never above the estimate, never below the step floor (but for
    rounding), and above it where a pipeline has a bubble (interleaved and zero-bubble schedules included)."""
    topology = load_topology("dgx-h100-x4")
    plans = [p for p in candidates(preset_plan("gpt-1.3b"), 32, SearchSpace(microbatches=(1, 4, 8, 16),
                                                                            sequence_parallel=(False, True)))
             if p.mesh.stage > 1]
    random.Random(2).shuffle(plans)
    checked, above, schedules = 0, 0, set()
    for plan in plans[:120]:
        memory = plan_memory(plan, topology)
        floor, played = step_floor(plan, topology), played_floor(plan, topology)
        assert played is not None and played >= floor * (1 - 1e-12)
        above += played > floor * (1 + 1e-6)
        if memory.fits:
            assert played <= estimate(plan, topology, memory).step_time_s
            checked += 1
            schedules.add(plan.schedule.name.value)
    assert checked >= 20 and above >= 20 and {"interleaved", "zb-h1", "1f1b"} <= schedules
    # At flagship scale: deep pipelines, interleaved over uneven stages, fsdp beside them.
    topology, flash = load_topology("llama3-h100-16k"), preset_plan("llama3-405b", 2048)
    flash = replace(flash, model=replace(flash.model, attention=type(flash.model.attention)("flash")))
    plans = [p for p in candidates(flash, 16_384, SearchSpace(zero=(1, 3), remat=("full",),
                                                             sequence_parallel=(True,))) if p.mesh.stage > 1]
    random.Random(3).shuffle(plans)
    for plan in plans[:12]:
        played = played_floor(plan, topology)
        assert step_floor(plan, topology) * (1 - 1e-12) <= played <= estimate(plan, topology).step_time_s


def test_best_first_tier_estimates_the_fastest_as_estimating_all_does() -> None:
    """The tier estimates in step-floor order and skips the rest once their floors pass the replay list: its
    fastest estimates are those of estimating every plan that fits, with fewer estimates (on 16 devices most plans
    are bounded)."""
    topology = load_topology("dgx-h100-x4@16")
    groups = list(candidate_groups(preset_plan("gpt-1.3b"), 16, SearchSpace(remat=("none", "full"),
                                                                          microbatches=(1, 4, 8))))
    plans = [p for g in groups for p in g.plans()]
    every = sorted(e.step_time_s for p in plans if (e := evaluate(p, topology)) is not None)
    keep, margin = 8, 0.02
    tier = _analytic_tier(groups, topology, 1.0, keep, margin, True, lambda plan, t: t, None)
    found = sorted(c.estimate.step_time_s for c in tier.shortlist)
    assert found[:keep] == every[:keep]
    assert [t for t in every if t <= every[0] * (1 + margin)] == [t for t in found if t <= found[0] * (1 + margin)]
    assert 0 < tier.bounded and len(found) + tier.bounded + tier.pruned == len(plans)
    assert all(floor > every[keep - 1] * (1 + margin) for floor, _ in tier.deferred)
