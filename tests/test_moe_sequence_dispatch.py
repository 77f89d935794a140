"""``runtime.moe_sequence_dispatch``: with sequence and expert parallelism each tensor rank all-to-alls its own
sequence shard and the experts' tensor ranks gather what arrives (Megatron-Core's all-to-all dispatcher), in the
task graph and the analytic tier alike."""

from __future__ import annotations

from dataclasses import replace

import pytest

from testbed.explore.analytic import estimate
from testbed.model import moe
from testbed.plan.io import plan_from_dict
from testbed.sim.graph.engine import simulate
from testbed.topology.io import load_topology

TOPOLOGY = load_topology("dgx-h100-x4")


def _plan(shard: bool, sp: bool = True, expert_tensor=None):
    mesh = {"expert": 4, "tensor": 2, "data": 4, "order": ["expert", "data", "tensor"]}  # experts across the nodes
    if expert_tensor is not None:
        mesh["expert_tensor"] = expert_tensor
    return plan_from_dict({"name": "m", "precision": "bf16-mixed", "sequence_parallel": sp,
                           "runtime": {"moe_sequence_dispatch": shard},
                           "model": {"layers": 4, "d_model": 2048, "heads": 16, "d_ff": 4096, "seq_len": 4096,
                                     "vocab": 32000, "attention": "flash", "experts": 8, "top_k": 2},
                           "batch": {"global_batch": 32, "microbatches": 2}, "mesh": mesh}, default_name="m")


def _transfers(sim, op: str) -> list:
    return [t for t in sim.program.tasks if t.op == op and t.stream == "expert"]


def test_each_tensor_rank_sends_its_shard_and_the_tensor_group_gathers_it():
    whole, shard = simulate(_plan(False), TOPOLOGY), simulate(_plan(True), TOPOLOGY)
    full = moe.dispatch_bytes(_plan(True))
    assert {t.nbytes for t in _transfers(whole, "all_to_all")} == {full}
    assert {t.nbytes for t in _transfers(shard, "all_to_all")} == {full / 2}
    gathers = _transfers(shard, "all_gather")
    assert gathers and {t.nbytes for t in gathers} == {full} and len({len(t.group) for t in gathers}) == 1
    assert len(gathers[0].group) == 2  # the tensor group
    assert len(_transfers(shard, "reduce_scatter")) == len(gathers)
    assert not _transfers(whole, "all_gather")
    # the all-to-alls cross the nodes, the gathers stay on NVLink: the step gains
    assert shard.report.step_time_s < whole.report.step_time_s
    assert estimate(_plan(True), TOPOLOGY).step_time_s < estimate(_plan(False), TOPOLOGY).step_time_s


def test_only_sequence_parallel_unfolded_expert_parallelism_dispatches_by_shard():
    assert moe.sequence_dispatch(_plan(True))
    assert not moe.sequence_dispatch(_plan(True, sp=False))
    assert not moe.sequence_dispatch(_plan(True, expert_tensor=1))  # folded: already 1/t a rank
    assert not moe.sequence_dispatch(_plan(False))
    assert _plan(True).runtime.moe_sequence_dispatch and plan_from_dict(
        {**_as_dict(), "runtime": "megatron"}, default_name="m").runtime.moe_sequence_dispatch


def _as_dict() -> dict:
    return {"name": "m", "precision": "bf16-mixed", "sequence_parallel": True,
            "model": {"layers": 4, "d_model": 2048, "heads": 16, "d_ff": 4096, "seq_len": 4096, "vocab": 32000,
                      "attention": "flash", "experts": 8, "top_k": 2},
            "batch": {"global_batch": 32, "microbatches": 2}, "mesh": {"expert": 4, "tensor": 2, "data": 4}}
