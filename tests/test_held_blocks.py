"""Held reductions beside the gathers: on XLA:TPU each gradient all-reduce holds the compute
(testbed.sim.step.step_rules.held_stream) while the next blocks' gathers run, and the two share the torus's links.
The task graph's engine shares them max-min fairly (testbed.sim.price.contention); the analytic tier plays the
blocks with the same share (testbed.explore.held_blocks, testbed.sim.price.contention.shared_factor), and so the
gathers the compiler holds (v5p's all-gathers, a slice's gathers lowered as all-reduces)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from testbed.explore.analytic import estimate
from testbed.explore.held_blocks import held_blocks
from testbed.plan.io import load_plan
from testbed.plan.placement import place
from testbed.plan.spec import Axis
from testbed.explore.stage_collectives import StageCollectives
from testbed.sim.graph.engine import simulate
from testbed.sim.price.contention import Flow, fair_rates, shared_factor
from testbed.topology.io import load_topology

AR, AG = ("all_reduce", (Axis.FSDP,), 1.0), ("all_gather", (Axis.FSDP,), 1.0)


def test_two_transfers_filling_one_link_run_at_the_engines_share() -> None:
    """Each alone at its standalone speed; together both at the max-min share (fair_rates) of the link they fill."""
    bandwidth = {"l": 1.0, "m": 1.0}
    a, b = Flow(1.0, {"l": 1.0}), Flow(0.5, {"l": 1.2})  # using all of the link, and 60% of it
    assert shared_factor(a, b, bandwidth) == pytest.approx(1 / 1.6)
    assert shared_factor(a, b, bandwidth) * a.cap == pytest.approx(fair_rates([a, b], bandwidth)[0])
    assert shared_factor(a, Flow(1.0, {"m": 1.0}), bandwidth) == 1.0  # apart
    assert shared_factor(Flow(1.0, {"l": 0.3}), Flow(1.0, {"l": 0.5}), bandwidth) == 1.0  # room for both


def _play(factor: float, gathers=(((1.0, AG),), ((1.0, AG),), ((1.0, AG),)), held=(((2.0, AR),),) * 3):
    return held_blocks(gathers, (3.0, 3.0, 3.0), held, 0.0, 0.0, [], 1,
                       lambda a, b: factor if {a[0], b[0]} == {"all_reduce", "all_gather"} else 1.0)


def test_held_reductions_hold_the_compute_and_alone_take_their_own_time() -> None:
    """Block i computes once its gather and block i - 1's held reductions are done; with the links to itself each
    held reduction takes its standalone seconds."""
    played = _play(1.0)
    assert played.held == [2.0, 2.0, 2.0]
    assert played.ends == [4.0, 9.0, 14.0]  # gather 1 s, then 3 s compute + 2 s held per block
    assert played.flying == [(0.0, 1.0), (1.0, 2.0), (4.0, 5.0)]  # block 2's once block 0 has computed (prefetch 1)


def test_a_held_reduction_beside_a_gather_is_slower_by_what_the_gather_takes_of_the_links() -> None:
    """At half speed each, block 0's held reduction (2 s) and block 2's gather (1 s) start together: the gather ends
    after 2 s, the reduction after 3 s (1 s of its work alone); the next block's compute waits for it."""
    played = _play(0.5)
    assert played.flying[2] == pytest.approx((4.0, 6.0))
    assert played.held == pytest.approx([3.0, 2.0, 2.0])
    assert played.ends == pytest.approx([4.0, 10.0, 15.0])


def test_held_gathers_hold_the_compute_after_the_previous_blocks_held_reductions() -> None:
    """All of a block's gathers held (v5p's all-gathers): none on the gather stream, each block's on the compute
    stream after block i - 1's held reductions and before its own compute, as the task graph plays them."""
    played = held_blocks(((),) * 3, (3.0, 3.0, 3.0), (((2.0, AR),),) * 3, 0.0, 0.0, [], 1,
                         lambda a, b: 0.5, (((1.0, AG),),) * 3)
    assert played.ends == [4.0, 10.0, 16.0]  # held gather 1 s, compute 3 s, held reduction 2 s per block
    assert played.held == [2.0, 2.0, 2.0]


def test_a_held_gather_beside_a_gather_on_its_stream_is_slower_by_the_engines_share() -> None:
    """A block's lowered gathers held (an all-reduce) and its all-gathers on their stream run apart, both at the
    share of their speed the engine gives the two (here half): block 0's two start together and end at 2 s, block
    1's held one beside block 2's all-gather, once block 0 has computed (prefetch 1), from 5 s to 7 s."""
    played = held_blocks((((1.0, AG),),) * 3, (3.0, 3.0, 3.0), ((),) * 3, 0.0, 0.0, [], 1,
                         lambda a, b: 0.5 if {a[0], b[0]} == {"all_reduce", "all_gather"} else 1.0,
                         (((1.0, AR),),) * 3)
    assert played.ends == pytest.approx([5.0, 10.0, 14.0])
    assert [t for flying in played.flying for t in flying] == pytest.approx([0.0, 2.0, 2.0, 3.0, 5.0, 7.0])


def test_a_held_reduction_and_a_latency_bound_gather_beside_it_do_not_slow_each_other() -> None:
    topology = load_topology("tpu-v5e-4x4")
    plan = load_plan("plans/fsdp-tpu.yaml")
    coll = StageCollectives(topology, place(plan, topology).device_ids)
    big, small = ("all_reduce", (Axis.FSDP,), 1e8), ("all_gather", (Axis.FSDP,), 4096.0)
    assert coll.factor(0, big, small) == 1.0
    assert 0.5 < coll.factor(0, big, ("all_gather", (Axis.FSDP,), 3.3e7)) < 0.55  # both near the links' bandwidth


def test_the_tiers_agree_on_fsdp_over_a_tpu_slice() -> None:
    """plans/fsdp-tpu.yaml: each block's held gradient all-reduce beside the gathers two blocks ahead (0.906 when
    the analytic tier gave each its standalone seconds)."""
    plan = load_plan("plans/fsdp-tpu.yaml")
    topology = load_topology(plan.topology)
    des = simulate(plan, topology).report.step_time_s
    assert estimate(plan, topology).step_time_s == pytest.approx(des, rel=0.01)


def test_the_tiers_agree_where_an_earlier_microbatchs_held_reduce_scatters_run_beside_the_gathers() -> None:
    """Two microbatches: the first's gradients reduce-scattered into the accumulator bucket by bucket, as whole-slice
    all-reduces held with the compute (testbed.sim.xla.xla_tpu), beside the gathers as the last's are (0.925 when
    the analytic tier gave each its standalone seconds)."""
    plan = load_plan("plans/fsdp-tpu.yaml")
    plan = replace(plan, batch=replace(plan.batch, microbatches=2))
    topology = load_topology(plan.topology)
    des = simulate(plan, topology).report.step_time_s
    assert estimate(plan, topology).step_time_s == pytest.approx(des, rel=0.01)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_the_tiers_agree_where_the_compiler_holds_the_gathers_with_the_compute(microbatches: int) -> None:
    """plans/fsdp-tpu.yaml over a v5p slice, whose all-gathers XLA:TPU runs blocking (DeviceSpec.blocking_collectives):
    each block's gathers on the compute stream between the blocks, in both tiers (0.78 and 0.80 of the DES when the
    analytic tier left them on their own stream beside the compute)."""
    plan = load_plan("plans/fsdp-tpu.yaml")
    topology = load_topology("tpu-v5p-2x4x4")
    assert "all_gather" in topology.device.held_collectives()
    plan = replace(plan, topology=None, mesh=replace(plan.mesh, fsdp=topology.num_devices),
                   batch=replace(plan.batch, microbatches=microbatches))
    des = simulate(plan, topology).report.step_time_s
    assert estimate(plan, topology).step_time_s == pytest.approx(des, rel=0.01)
