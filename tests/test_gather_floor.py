"""The gather floor (testbed.explore.gather_floor): the fsdp/ZeRO-3 gathers a stage plays one after another, never
above either tier's step, and the analytic tier's own gather seconds."""

from __future__ import annotations

import random

import pytest

import testbed.explore.play as play
from testbed.explore.analytic import estimate, plan_memory
from testbed.explore.floor import played_floor, step_floor
from testbed.explore.gather_floor import gather_floor
from testbed.explore.space import SearchSpace, candidates, preset_plan
from testbed.sim.graph.engine import simulate
from testbed.topology.io import load_topology


@pytest.fixture
def played_gathers(monkeypatch) -> dict:
    """The last estimate's slowest stage's gather seconds, summed over its played actions' prices."""
    seen: dict = {}
    run = play.Play.run

    def recorded(self, *bar):
        out = run(self, *bar)
        per = [0.0] * self.facts.stages
        for s, action, _ in self.facts.order:
            per[s] += self.step.prices[(s, action.chunk, action.kind)].gather
        seen["gathers"] = max(per)
        return out

    monkeypatch.setattr(play.Play, "run", recorded)
    return seen


def _sharded(model: str, devices: int, space: SearchSpace, count: int, seed: int, global_batch: int | None = None):
    plans = [p for p in candidates(preset_plan(model, global_batch), devices, space) if p.mesh.fsdp > 1 or p.zero == 3]
    random.Random(seed).shuffle(plans)
    return plans[:count]


def test_gather_floor_is_the_analytic_tiers_gathers_and_below_its_step(played_gathers) -> None:
    """Fsdp and ZeRO-3 beside tensor and pipeline parallelism (interleaved too): the floor is the stage's gathers as
    the estimate prices them, below its step, and with the step and played floors still below it."""
    topology = load_topology("dgx-h100-x4")
    space = SearchSpace(zero=(0, 3), microbatches=(1, 4, 8), sequence_parallel=(False, True))
    checked, equal, kinds = 0, 0, set()
    for plan in _sharded("gpt-1.3b", 32, space, 60, 0):
        memory = plan_memory(plan, topology)
        if not memory.fits:
            continue
        est = estimate(plan, topology, memory).step_time_s
        gathers = gather_floor(plan, topology)
        assert 0 < gathers <= played_gathers["gathers"] * (1 + 1e-9) and gathers <= est
        equal += abs(gathers - played_gathers["gathers"]) <= 1e-9 * gathers
        assert max(gathers, step_floor(plan, topology), played_floor(plan, topology) or 0.0) <= est
        checked += 1
        kinds.add((plan.mesh.tensor > 1, plan.mesh.stage > 1, plan.schedule.virtual_stages > 1))
    assert checked >= 20 and equal >= checked // 2 and {(True, True, True), (False, True, False)} <= kinds


def test_gather_floor_at_flagship_scale_rules_out_what_the_step_floor_does_not(played_gathers) -> None:
    """Llama 3 405B on 16,384 GPUs: where ZeRO-3 gathers over thousands of ranks, the gathers alone are above the
    compute floor, and still below the estimate."""
    topology = load_topology("llama3-h100-16k")
    space = SearchSpace(zero=(1, 3), remat=("full",), sequence_parallel=(True,))
    above = 0
    for plan in _sharded("llama3-405b", 16_384, space, 8, 0, 2048):
        gathers, est = gather_floor(plan, topology), estimate(plan, topology).step_time_s
        assert gathers <= played_gathers["gathers"] * (1 + 1e-9) and gathers <= est
        above += gathers > step_floor(plan, topology)
    assert above >= 1


def test_gather_floor_is_below_the_task_graphs_step() -> None:
    """The task graph plays the same gathers on its gather stream: its step is never below the floor (fsdp and
    ZeRO-3, with tensor parallelism and interleaved pipelines)."""
    topology = load_topology("dgx-h100-x4")
    space = SearchSpace(zero=(0, 3), microbatches=(2, 4), remat=("full",), sequence_parallel=(True,))
    checked, kinds = 0, set()
    for plan in _sharded("gpt-1.3b", 32, space, 40, 1):
        if not plan_memory(plan, topology).fits or (plan.mesh.tensor > 1, plan.mesh.stage > 1) in kinds:
            continue
        kinds.add((plan.mesh.tensor > 1, plan.mesh.stage > 1))
        gathers = gather_floor(plan, topology)
        assert 0 < gathers <= simulate(plan, topology).report.step_time_s
        checked += 1
    assert checked >= 3


def test_gather_floor_bounds_moe_plans_and_leaves_unsharded_plans_alone() -> None:
    """MoE plans, an MoE chain's whole gathers (expert parallelism) and blocks (none) alike: the gather floor never
    above the estimate nor the DES; no bound where nothing shards the parameters."""
    topology = load_topology("dgx-h100-x4")
    plans = [p for p in candidates(preset_plan("deepseek-moe-16b", 64), 32, SearchSpace(zero=(3,), microbatches=(2,),
                                                                                        remat=("full",)))
             if p.mesh.context == 1 and p.mesh.stage <= 2]
    random.Random(3).shuffle(plans)
    experts = set()
    for plan in plans[:14]:
        gathers = gather_floor(plan, topology)
        if not gathers:  # nothing shards the parameters (data 1)
            continue
        assert gathers <= estimate(plan, topology).step_time_s and step_floor(plan, topology) > 0
        if (plan.mesh.expert > 1) not in experts:  # the DES once each
            assert gathers <= simulate(plan, topology).report.step_time_s
        experts.add(plan.mesh.expert > 1)
    assert experts == {False, True}
    dense = next(p for p in candidates(preset_plan("gpt-1.3b"), 32, SearchSpace(zero=(1,)))
                 if p.mesh.fsdp == 1)
    assert gather_floor(dense, topology) == 0.0
