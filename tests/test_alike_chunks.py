"""Chunks alike are worked out once: a step's facts and the analytic tier's prices of chunks alike in their layers
and ends (testbed.sim.step.facts.alike_key) are shared, and sharing them changes nothing.

Each check works the step out twice, once with every chunk its own (``alike_key`` made unique per chunk), and
compares: the facts chunk by chunk (their sends included) and the analytic estimate exactly.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import testbed.explore.prices as prices
import testbed.sim.step.facts as facts_module
from testbed.explore.analytic import estimate
from testbed.plan.io import load_plan
from testbed.plan.placement import place
from testbed.plan.spec import ScheduleName, ScheduleSpec
from testbed.sim.step.facts import step_facts
from testbed.topology.io import load_topology


def _plan(name: str, mesh: dict, virtual: int, microbatches: int, zero: int = 0, stage_layers=None,
          schedule: ScheduleName = ScheduleName.INTERLEAVED):
    plan = load_plan(name)
    plan = replace(plan, mesh=replace(plan.mesh, **mesh), schedule=ScheduleSpec(name=schedule, virtual_stages=virtual),
                   batch=replace(plan.batch, microbatches=microbatches), zero=zero)
    return replace(plan, layers_per_stage=stage_layers) if stage_layers is not None else plan


CASES = [
    # dense, interleaved over stages of equal layers, fsdp gathering block by block (ZeRO-3)
    (lambda: _plan("gpt-small-dgx", {"data": 1, "fsdp": 2, "tensor": 2, "stage": 2}, 3, 4, zero=3), "dgx-h100"),
    # dense, uneven stages (the ends lighter), ZeRO-1 over data
    (lambda: _plan("gpt-small-dgx", {"data": 2, "fsdp": 1, "tensor": 1, "stage": 4}, 2, 8, zero=1,
                   stage_layers=(5, 7, 7, 5)), "dgx-h100"),
    # zero bubble (a split backward), sends both ways
    (lambda: _plan("gpt-small-dgx", {"data": 2, "fsdp": 1, "tensor": 1, "stage": 4}, 1, 8,
                   schedule=ScheduleName.ZB_H1), "dgx-h100"),
    # MoE: chunks alike only where their layers' kinds are
    (lambda: _plan("mixtral-8x7b", {"data": 1, "fsdp": 2, "expert": 4, "stage": 4}, 2, 4), "dgx-h100-x4"),
]


def _unique(plan, stages, virtual, s, c, span):
    return ("own", s, c)


@pytest.mark.parametrize(("make", "topology_name"), CASES)
def test_alike_chunks_share_facts_and_prices_without_changing_them(make, topology_name, monkeypatch) -> None:
    plan, topology = make(), load_topology(topology_name)
    ids = place(plan, topology).device_ids
    combine = topology.calibration.collectives.combine_bytes
    shared, shared_estimate = step_facts(plan, ids, combine), estimate(plan, topology)
    keys = {facts_module.alike_key(plan, plan.mesh.stage, plan.schedule.virtual_stages, s, c, span)
            for s, row in enumerate(facts_module.chunk_layers(plan.model, plan.mesh.stage,
                                                              plan.schedule.virtual_stages, plan.stage_layers))
            for c, span in enumerate(row)}
    assert len(keys) < plan.mesh.stage * plan.schedule.virtual_stages  # some chunks are alike: the memo is used
    monkeypatch.setattr(facts_module, "alike_key", _unique)
    monkeypatch.setattr(prices, "alike_key", _unique)
    own = step_facts(plan, ids, combine)
    assert shared.chunks == own.chunks
    assert estimate(plan, topology) == shared_estimate
