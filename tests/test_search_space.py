"""The search space covers the layouts practitioners run, and the search's bounds are lower bounds on samples.

Meta's Llama 3 405B layout (interleaved over 8 virtual stages on the balanced-ends split, 16 microbatches) is
a candidate; microbatch counts reach the batch per replica; save-dots, runtime knobs and mesh orders are
tried where they act. Random plans of the space (hypothesis) hold the bounds the search prunes by: the model
states' floor at most the exact memory, the step floor at most the played floor, which is at most the
analytic estimate and the DES step.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings, strategies as st

from testbed.explore.analytic import estimate, plan_memory
from testbed.explore.eta import REPLAY_PER_ESTIMATE, TimeLeft
from testbed.explore.floor import played_floor, step_floor
from testbed.explore.space import (SAVE_DOTS, SearchSpace, candidate_groups, candidates, count_candidates,
                                   preset_plan, virtual_stage_counts)
from testbed.model.memory import state_floor
from testbed.plan.spec import Remat
from testbed.sim.graph.engine import simulate
from testbed.topology.io import load_topology


def test_metas_405b_layout_is_a_candidate() -> None:
    """TP 8, PP 16, DP 128, interleaved x 8 over 7, 8 x 14, 7 layers, 16 microbatches: in the default space."""
    base = preset_plan("llama3-405b", 2048)
    space = SearchSpace(schedules=("interleaved",), zero=(2,), remat=("none",), microbatches=(16,),
                        sequence_parallel=(True,))
    found = [g.head for g in candidate_groups(base, 16_384, space)
             if (g.head.mesh.data, g.head.mesh.fsdp, g.head.mesh.tensor, g.head.mesh.stage) == (128, 1, 8, 16)]
    assert sorted(p.schedule.virtual_stages for p in found) == [2, 4, 8]
    assert all(p.stage_layers == (7,) + (8,) * 14 + (7,) for p in found)
    assert virtual_stage_counts(126, 16, found[0].layers_per_stage) == (2, 4, 8)
    assert virtual_stage_counts(128, 4, None) == (2, 4, 8, 16, 32)  # an even split: divisors of 32


def test_microbatches_reach_the_batch_per_replica_and_groups_count_their_plans() -> None:
    base = preset_plan("gpt-125m", 64)
    space = SearchSpace(schedules=("1f1b",), zero=(0,), remat=("none",))
    plans = list(candidates(base, 8, space))
    per_replica = {p.batch.global_batch // (p.mesh.data * p.mesh.fsdp) for p in plans if p.mesh.data == 1 == p.mesh.fsdp}
    assert max(p.batch.microbatches for p in plans if p.mesh.data * p.mesh.fsdp == 1) == max(per_replica) == 64
    assert count_candidates(base, 8, space) == len(plans) == len(set(plans))
    groups = list(candidate_groups(base, 8, space))
    assert [p for g in groups for p in g.plans()] == plans and all(next(g.plans()) == g.head for g in groups)


def test_save_dots_knobs_and_orders_where_they_act() -> None:
    base = preset_plan("gpt-125m", 16)
    space = SearchSpace(schedules=("1f1b",), zero=(0, 3), microbatches=(2,), remat=("selective", SAVE_DOTS),
                        grad_reduce_overlap=(False, True), tp_comm_overlap=(False, True), fsdp_prefetch=(0, 1),
                        grad_bucket_bytes=(0.0, 25e6),
                        mesh_orders=(("stage", "data", "fsdp", "expert", "context", "tensor"),
                                     ("stage", "fsdp", "data", "expert", "context", "tensor")))
    plans = list(candidates(base, 8, space))
    assert len(plans) == len(set(plans))
    dots = [p for p in plans if p.runtime.recompute == "save-dots"]
    assert dots and all(p.remat is Remat.SELECTIVE for p in dots)
    for p in plans:
        if p.mesh.tensor == 1:
            assert p.runtime.tp_comm_overlap == base.runtime.tp_comm_overlap
        if p.mesh.data == 1 or p.zero >= 2:
            assert p.runtime.grad_reduce_overlap == base.runtime.grad_reduce_overlap
    assert {p.runtime.tp_comm_overlap for p in plans if p.mesh.tensor > 1} == {False, True}
    assert {p.mesh.order[1].value for p in plans} == {"data", "fsdp"}
    megatron = replace(base, runtime=replace(base.runtime, framework="pytorch", recompute="block"))
    assert not any(p.runtime.recompute == "save-dots" for p in candidates(megatron, 8, space))


_TOPOLOGY = load_topology("dgx-h100")
_PLANS = [p for p in candidates(preset_plan("gpt-125m", 32), 8, SearchSpace(
    microbatches=(1, 2, 4, 8), sequence_parallel=(False, True), virtual_stages=(2, 3)))]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(min_value=0, max_value=len(_PLANS) - 1))
def test_bounds_are_lower_bounds_of_the_estimate_and_the_des(index: int) -> None:
    """For random plans of the space: state floor <= exact memory; step floor <= played floor <= the analytic
    estimate and <= the DES step (where the plan fits)."""
    plan = _PLANS[index]
    memory = plan_memory(plan, _TOPOLOGY)
    assert state_floor(plan) <= memory.total
    floor, played = step_floor(plan, _TOPOLOGY), played_floor(plan, _TOPOLOGY)
    if floor is None or not memory.fits:
        return
    assert floor <= played * (1 + 1e-12)
    assert played <= estimate(plan, _TOPOLOGY, memory).step_time_s
    assert played <= simulate(plan, _TOPOLOGY).report.step_time_s


def test_time_left_prices_each_phase_at_its_own_rate() -> None:
    now = [0.0]
    eta = TimeLeft(clock=lambda: now[0])
    eta.update("bounds", 0)
    assert eta.seconds("bounds", 10) is None  # no rate yet
    now[0] = 2.0
    eta.update("bounds", 100)
    assert eta.seconds("bounds", 50, replays=2) == 50 * 0.02 + 2 * REPLAY_PER_ESTIMATE * 0.02
    eta.update("analytic", 0)
    now[0] = 3.0
    eta.update("analytic", 4)
    assert eta.seconds("analytic", 8, replays=1) == 8 * 0.25 + REPLAY_PER_ESTIMATE * 0.25
    eta.update("replay", 0)
    now[0] = 5.0
    eta.update("replay", 1)
    assert eta.seconds("replay", 3) == 6.0


def test_a_vocabulary_the_tensor_degree_does_not_divide_is_searched_padded() -> None:
    """GPT-2's 50,257 tokens divide by no tensor degree; a plan pads them (Megatron's rule), so the space keeps
    the tensor-parallel layouts, each with a head its tensor ranks split."""
    base = preset_plan("gpt-125m")
    base = replace(base, model=replace(base.model, vocab=50257))
    tensors = {p.mesh.tensor for p in candidates(base, 8, SearchSpace(schedules=("1f1b",), microbatches=(1,)))}
    assert tensors == {1, 2, 4}  # (12 heads: no 8)
    for p in candidates(base, 8, SearchSpace(schedules=("1f1b",), microbatches=(1,))):
        assert p.model.padded_vocab % p.mesh.tensor == 0 and p.model.padded_vocab >= 50257
