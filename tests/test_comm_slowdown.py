"""Compute beside communication: ``device.comm_slowdown`` lengthens the compute its device's collectives and sends
overlap (NCCL kernels hold SMs and HBM bandwidth), in both tiers, and nothing else.

Lee et al. 2025 (arXiv:2507.03114) measure an average 18.9% computational slowdown when compute and
communication overlap (A100, H100, MI250, MI210; GPT and Llama training), against the same compute alone.
testbed.sim.graph.engine slows a compute task while one of its device's transfers is in flight; testbed.explore.analytic
lengthens an action by the slowdown times the communication that runs beside it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from testbed.cli import main
from testbed.errors import InputError
from testbed.explore.analytic import estimate
from testbed.plan.io import plan_from_dict
from testbed.sim.graph.engine import simulate
from testbed.topology.io import load_topology, topology_from_dict, topology_to_dict

SOURCED = 0.189  # Lee et al. 2025's average (topologies/dgx-h100-superpod.yaml states it with its source)


def _slowed(slowdown: float, name: str = "dgx-h100"):
    topology = load_topology(name)
    return replace(topology, device=replace(topology.device, comm_slowdown=slowdown))


def _plan(mesh: dict | None = None, microbatches: int = 2, global_batch: int = 16):
    return plan_from_dict({"name": "p", "model": {"layers": 4, "d_model": 1024, "heads": 16, "d_ff": 4096,
                                                  "seq_len": 1024, "vocab": 32000, "attention": "flash"},
                           "batch": {"global_batch": global_batch, "microbatches": microbatches},
                           "mesh": mesh or {"fsdp": 8}, "precision": "bf16-mixed"}, default_name="p")


def _both(plan, topology) -> tuple[float, float]:
    return simulate(plan, topology).report.step_time_s, estimate(plan, topology).step_time_s


@pytest.mark.parametrize("microbatches", [1, 2])
def test_slower_compute_beside_communication_slows_both_tiers_monotonically(microbatches: int):
    """FSDP's prefetched gathers and reduce-scatters run beside the compute: each tier's step grows with the
    slowdown, by less than the slowdown of the whole compute (only the overlapped part is slowed). The analytic
    tier prices the overlap without link sharing (its transfers are shorter), so the two tiers' increases agree
    within a factor of two, not exactly."""
    plan = _plan(microbatches=microbatches)
    steps = [_both(plan, _slowed(s)) for s in (0.0, 0.1, SOURCED, 0.4)]
    for tier in (0, 1):
        times = [step[tier] for step in steps]
        assert times == sorted(times) and times[-1] > times[0]
        assert times[2] < times[0] * (1 + SOURCED)
    des, analytic = (steps[2][tier] / steps[0][tier] - 1 for tier in (0, 1))
    assert 0.5 < analytic / des < 2.0


def test_no_communication_beside_the_compute_costs_nothing():
    """One device: no collective runs, so the slowdown changes nothing in either tier."""
    plan = _plan({"data": 1}, microbatches=1)
    topology = load_topology("dgx-h100")
    from testbed.explore.space import resize_topology
    one, slowed_one = resize_topology(topology, 1), resize_topology(_slowed(0.4), 1)
    assert _both(plan, slowed_one) == _both(plan, one)


def test_the_default_leaves_every_bundled_topology_and_the_step_unchanged():
    """Without the field a device prices exactly as before; 0 is the default."""
    assert load_topology("dgx-h100").device.comm_slowdown == 0.0
    assert load_topology("dgx-h100-x4").device.comm_slowdown == 0.0
    plan = _plan()
    assert _both(plan, _slowed(0.0)) == _both(plan, load_topology("dgx-h100"))


def test_the_published_runs_topologies_state_the_sourced_slowdown():
    for name in ("dgx-h100-superpod", "dgx-a100-superpod", "llama3-h100-16k"):
        assert load_topology(name).device.comm_slowdown == SOURCED
    for name in ("tpu-v5p-2x4x4", "host-cpu-8"):  # no NCCL kernels on these devices' cores: not stated
        assert load_topology(name).device.comm_slowdown == 0.0


def test_comm_slowdown_round_trips_through_yaml():
    slowed = _slowed(SOURCED)
    assert topology_from_dict(topology_to_dict(slowed)).device == slowed.device


@pytest.mark.parametrize("value,message", [(-0.1, "fraction from 0 to 1"), (1.5, "fraction from 0 to 1"),
                                           ("lots", "fraction from 0 to 1"), (True, "fraction from 0 to 1")])
def test_a_bad_comm_slowdown_names_the_field(value, message):
    data = topology_to_dict(load_topology("dgx-h100"))
    data["device"]["comm_slowdown"] = value
    with pytest.raises(InputError) as info:
        topology_from_dict(data)
    assert info.value.field == "device.comm_slowdown" and message in info.value.message


def test_a_bad_comm_slowdown_in_a_topology_file_exits_2_naming_the_field(tmp_path: Path, capsys):
    data = topology_to_dict(load_topology("dgx-h100"))
    data["device"]["comm_slowdown"] = "lots"
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["topology", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert "device.comm_slowdown" in err and "Traceback" not in err


@pytest.mark.parametrize("mesh,microbatches,name", [
    ({"fsdp": 8}, 4, "dgx-h100"), ({"fsdp": 4, "tensor": 2}, 2, "dgx-h100"),
    ({"data": 4, "tensor": 4, "stage": 2}, 8, "dgx-h100-x4")])
def test_the_tiers_slow_alike_beside_gathers_reductions_and_sends(mesh: dict, microbatches: int, name: str):
    """Each tier's step grows with the slowdown by amounts within a factor of two of each other: the analytic
    tier's reductions leave after the slowed compute that precedes them (each block's, where the blocks play
    their own gathers), as the task graph's wait for their compute tasks."""
    plan = _plan(mesh, microbatches, global_batch=64)
    before, after = _both(plan, load_topology(name)), _both(plan, _slowed(SOURCED, name))
    des, analytic = (after[tier] / before[tier] - 1 for tier in (0, 1))
    assert des > 0 and 0.5 < analytic / des < 2.0


def test_replicas_summing_after_the_backward_slow_no_compute():
    """Data-parallel replicas that sum their gradients once, after the backward (no ``grad_reduce_overlap``),
    run no reduction beside the compute: neither tier's step grows by as much as 1%."""
    plan = _plan({"data": 8})
    before, after = _both(plan, load_topology("dgx-h100")), _both(plan, _slowed(SOURCED))
    assert all(before[tier] <= after[tier] < 1.01 * before[tier] for tier in (0, 1))


def test_only_the_reductions_an_action_starts_slow_its_compute():
    """Of a chunk's many microbatches only the last releases its gradient buckets (testbed.sim.step.step_rules.gradients):
    the earlier ones' backward is not slowed by buckets that do not leave (an MoE pipeline with the buckets
    reduced in the backward, 32 microbatches, where counting them on every microbatch put the analytic tier 10%
    over the DES), and a tp_comm_overlap GEMM is slowed beside its chunks as the engine slows it."""
    from testbed.explore.prices import StepPrices
    from testbed.explore.play_floor import beside_compute
    from testbed.plan.placement import place
    from testbed.sim.step.facts import step_facts, topology_rules
    from testbed.sim.step.step_rules import gradients

    topology = _slowed(SOURCED, "dgx-h100-x4")
    plan = plan_from_dict({"name": "moe", "model": {"layers": 8, "d_model": 1024, "heads": 16, "kv_heads": 4,
                                                    "d_ff": 2048, "seq_len": 2048, "vocab": 32000, "mlp": "swiglu",
                                                    "attention": "flash", "experts": 8, "top_k": 2},
                           "batch": {"global_batch": 128, "microbatches": 16},
                           "mesh": {"data": 2, "expert": 4, "tensor": 2, "stage": 2, "expert_tensor": 1},
                           "schedule": {"name": "interleaved", "virtual_stages": 2}, "sequence_parallel": True,
                           "precision": "bf16-mixed", "zero": 1,
                           "runtime": {"profile": "megatron", "grad_reduce_overlap": True, "tp_comm_overlap": True,
                                       "pipeline_blocking_sends": False}}, default_name="moe")
    ids = place(plan, topology).device_ids
    step = StepPrices(step_facts(plan, ids, **topology_rules(topology)), topology, ids)
    p = step.prices[(0, 0, "B")]
    last, earlier = (gradients(step.facts, "B", p.chain, left) for left in (0, 1))
    assert p.bucket > 0 and beside_compute(step, p, earlier) == pytest.approx(
        beside_compute(step, p, last) - p.bucket * p.pieces)
    des, analytic = _both(plan, topology)
    assert analytic == pytest.approx(des, rel=0.03)
