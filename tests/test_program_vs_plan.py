"""testbed's own GPT step traced like a user's program and priced, against plan-driven simulation of the plan.

Issue 36's check: the runner's SPMD step (testbed.runner.program.plans.trace_plan) priced on a topology
(testbed.sim.traced) agrees with testbed.sim.engine.simulate. What holds (docs/program.md, "Against
plan-driven simulation"): collective bytes per mesh axis within 0.2% (the traced program also reduces
the loss and a few small replicated gradients the plan's model does not count) and, for data and
tensor parallelism, the step time within 5%. With fsdp the traced step gathers each layer's
parameters on its own where the plan's model gathers a whole chunk at once, and the NCCL model prices
many small gathers slower: the step time does not agree (a strict xfail, so agreement would show).
"""

from __future__ import annotations

import functools

import pytest

from testbed.plan.placement import place
from testbed.plan.spec import MESH_AXES, BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec
from testbed.runner.program.plans import trace_plan
from testbed.sim.engine import simulate
from testbed.sim.traced import collective_bytes, simulate_workload
from testbed.topology.io import load_topology

MODEL = ModelSpec(layers=4, d_model=1024, heads=16, d_ff=4096, seq_len=1024, vocab=32768)


def _plan(name: str, mesh: dict, batch: int, precision: str) -> Plan:
    return Plan(name=name, model=MODEL, batch=BatchSpec(global_batch=batch), mesh=MeshSpec(**mesh),
                schedule=ScheduleSpec(name="1f1b"), precision=precision, remat="none")


@functools.cache
def _fsdp():
    return _both(_plan("fsdp16", {"fsdp": 16}, 16, "fp32"), "tpu-v5e-4x4")


def _both(plan: Plan, topology_name: str):
    topology = load_topology(topology_name)
    traced = simulate_workload(trace_plan(plan), topology)
    planned = simulate(plan, topology)
    ids, names = place(plan, topology).device_ids, tuple(a.value for a in MESH_AXES)
    return traced, planned, collective_bytes(traced.program, ids, names), collective_bytes(planned.program, ids, names)


def _bytes_agree(traced: dict, planned: dict) -> None:
    assert set(traced) == set(planned)
    for axes, nbytes in planned.items():
        assert traced[axes] == pytest.approx(nbytes, rel=2e-3), axes


def test_data_x_tensor_on_a_superpod_agrees() -> None:
    plan = _plan("dp128-tp8", {"data": 128, "tensor": 8}, 128, "bf16-mixed")
    traced, planned, moved, expected = _both(plan, "dgx-h100-superpod")
    _bytes_agree(moved, expected)
    assert traced.report.step_time_s == pytest.approx(planned.report.step_time_s, rel=0.05)


def test_fsdp_on_a_tpu_slice_moves_the_plans_bytes() -> None:
    _, _, moved, expected = _fsdp()
    _bytes_agree(moved, expected)


@pytest.mark.xfail(strict=True, reason="per-layer fsdp gathers (traced) vs whole-chunk gathers (plan model)")
def test_fsdp_step_time_on_a_tpu_slice() -> None:
    traced, planned, _, _ = _fsdp()
    assert traced.report.step_time_s == pytest.approx(planned.report.step_time_s, rel=0.05)
