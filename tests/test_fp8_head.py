"""``runtime.fp8_head``: under fp8-mixed the LM head runs in bf16 unless the plan says otherwise (every stack's fp8
recipe leaves the output layer out), in both simulator tiers; other precisions are untouched."""

from __future__ import annotations

from dataclasses import replace

import pytest

from testbed.explore.analytic import estimate
from testbed.explore.space import resize_topology
from testbed.model.gemm import chunk_gemms, head_gemms
from testbed.plan.io import plan_from_dict
from testbed.sim.price.compute import gemms_seconds
from testbed.sim.graph.engine import simulate
from testbed.topology.io import load_topology

TOPOLOGY = resize_topology(load_topology("dgx-h100"), 1)


def _plan(precision: str = "fp8-mixed", fp8_head: bool = False):
    return plan_from_dict({"name": "p", "precision": precision, "runtime": {"fp8_head": fp8_head},
                           "model": {"layers": 2, "d_model": 2048, "heads": 16, "d_ff": 8192, "seq_len": 2048,
                                     "vocab": 128000, "attention": "flash"},
                           "batch": {"global_batch": 2, "microbatches": 2}, "mesh": {"data": 1}}, default_name="p")


def test_the_head_s_three_gemms_cost_their_bf16_time_under_fp8_mixed():
    plan = _plan()
    (head,) = head_gemms(plan.model, plan.microbatch_size)
    gemms = (head, head.input_grad(), head.weight_grad())
    slower = gemms_seconds(TOPOLOGY, "bf16", gemms) - gemms_seconds(TOPOLOGY, "fp8", gemms)
    assert slower > 0
    step = {x: simulate(_plan(fp8_head=x), TOPOLOGY).report.step_time_s for x in (False, True)}
    assert step[False] - step[True] == pytest.approx(plan.batch.microbatches * slower, rel=0.02)
    tier = {x: estimate(_plan(fp8_head=x), TOPOLOGY).step_time_s for x in (False, True)}
    assert tier[False] - tier[True] == pytest.approx(plan.batch.microbatches * slower, rel=0.02)


def test_only_fp8_plans_tag_the_head():
    tagged = [g for g in chunk_gemms(_plan(), 0).forward if g.high_precision]
    assert len(tagged) == 1 and tagged[0].n == 128000
    assert not any(g.high_precision for g in chunk_gemms(_plan(fp8_head=True), 0).forward)
    assert not any(g.high_precision for g in chunk_gemms(_plan("bf16-mixed"), 0).forward)
    bf16 = _plan("bf16-mixed")
    assert simulate(bf16, TOPOLOGY).report.step_time_s == simulate(
        replace(bf16, runtime=replace(bf16.runtime, fp8_head=True)), TOPOLOGY).report.step_time_s
