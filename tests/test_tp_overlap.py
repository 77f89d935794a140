"""``runtime.tp_comm_overlap`` priced GEMM by GEMM (testbed.sim.step.tp_overlap): each block's tensor collectives beside
its own GEMMs, the first chunk exposed; work and bytes conserved; both tiers play the same timeline."""

from __future__ import annotations

import pytest

from testbed.explore.analytic import estimate
from testbed.model.gemm import gemm_flops
from testbed.plan.io import plan_from_dict
from testbed.plan.placement import place
from testbed.sim.graph.engine import simulate
from testbed.sim.step.facts import step_facts
from testbed.sim.graph.program import build_program
from testbed.sim.step.tp_overlap import exposed_share, overlap_end, slowed_overlap
from testbed.topology.io import load_topology

TOPOLOGY = "dgx-h100"


def _plan(overlap: bool, **over):
    spec = {"name": "o", "model": {"layers": 4, "d_model": 4096, "heads": 32, "d_ff": 16384, "seq_len": 2048,
                                   "vocab": 32000, "attention": "flash"},
            "batch": {"global_batch": 16, "microbatches": 2}, "mesh": {"data": 2, "tensor": 4},
            "precision": "bf16-mixed", "remat": "none", "zero": 1, "sequence_parallel": True,
            "runtime": {"tp_comm_overlap": overlap}}
    spec.update(over)
    return plan_from_dict(spec, default_name="o")


def test_each_block_keeps_its_work_and_bytes():
    """The blocks' GEMMs and the rest of the action add up to the action's FLOPs; the first and other chunks of
    the blocks' collectives, with those beside no GEMM, move the action's tensor bytes."""
    plan = _plan(True)
    facts = step_facts(plan, place(plan, load_topology(TOPOLOGY)).device_ids)
    for chunk in facts.chunks[0]:
        for work in chunk.actions:
            o = work.overlap
            if work.kind == "W" or not work.tensor:
                assert o is None
                continue
            assert [b.name for b in o.blocks] == ["attention", "mlp"]
            assert o.work[0] + sum(b.flops for b in o.blocks) == pytest.approx(work.work[0])
            assert gemm_flops(o.gemms) + sum(gemm_flops(b.gemms) for b in o.blocks) == \
                pytest.approx(gemm_flops(work.gemms))
            moved = sum(n * b for b_ in o.blocks for _, n, b in (*b_.first, *b_.rest)) + \
                sum(n * b for _, n, b in o.after)
            assert moved == pytest.approx(sum(n * b for _, n, b in work.tensor))
            for blk in o.blocks:  # each collective's exposed share first, the rest beside the GEMMs
                for (op, n, b), (_, m, r) in zip(blk.first, blk.rest):
                    assert n == m and b == pytest.approx((b + r) * exposed_share(op, work.kind, 4))


def test_a_block_gemm_waits_for_its_first_chunks():
    plan = _plan(True)
    tasks = build_program(plan, place(plan, load_topology(TOPOLOGY))).tasks
    gemms = [t for t in tasks if t.name.endswith("gemms")]
    assert gemms
    for g in gemms:
        assert any(tasks[d].stream == "tensor" for d in g.deps)


def test_exposed_shares_follow_userbuffers_methods():
    assert exposed_share("all_gather", "F", 8) == 1 / 8  # ring exchange: the first rank's share
    assert exposed_share("reduce_scatter", "F", 8) == 1 / 4  # pipelined in 4 splits: the last one's
    assert exposed_share("reduce_scatter", "B", 8) == 0.0  # bulk beside the weight gradient
    assert exposed_share("all_gather", "B", 8) == 1 / 16  # half ring exchange, half bulk


def test_overlap_end_hides_the_chunks_a_gemm_covers():
    # first chunks exposed; the rest hidden while shorter than the GEMMs, exposed where they outlast them
    assert overlap_end(((1.0, 10.0, 3.0),)) == 11.0
    assert overlap_end(((1.0, 2.0, 3.0),)) == 4.0
    # the MLP block's chunks follow the attention block's on the tensor stream
    assert overlap_end(((1.0, 2.0, 3.0), (1.0, 10.0, 3.0))) == 15.0


def test_a_gemm_beside_the_tensor_streams_chunks_is_slower_until_they_end():
    """device.comm_slowdown on the overlapped GEMMs: slowed while the tensor stream's chunks run, at full speed
    after (the engine's rule for a compute task beside its device's communication)."""
    blocks = ((1.0, 2.0, 3.0), (1.0, 10.0, 3.0))
    assert slowed_overlap(blocks, 0.0) == (overlap_end(blocks), 12.0)
    # chunks end at 8: the first GEMM 1-4 slowed whole, the second from 5: 3 s slowed (2 s of work), 8 s after
    assert slowed_overlap(blocks, 0.5) == (16.0, 14.0)
    assert slowed_overlap(((1.0, 10.0, 3.0),), 0.5) == (12.0, 11.0)


@pytest.mark.parametrize("over", [{}, {"sequence_parallel": False}, {"remat": "full"},
                                  {"mesh": {"data": 2, "stage": 2, "tensor": 2}},
                                  {"mesh": {"context": 2, "tensor": 4}}])
def test_both_tiers_play_it_alike_and_it_beats_no_overlap(over):
    """The task graph and the analytic tier agree, and the step is shorter than without overlap (a model whose
    tensor collectives outweigh the overlap's extra kernel launches)."""
    topology = load_topology(TOPOLOGY)
    plan, plain = _plan(True, **over), _plan(False, **over)
    des, analytic = simulate(plan, topology).report.step_time_s, estimate(plan, topology).step_time_s
    assert analytic == pytest.approx(des, rel=1e-3)
    assert des < simulate(plain, topology).report.step_time_s
    assert analytic < estimate(plain, topology).step_time_s
