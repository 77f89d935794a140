"""An action's spans between blocking tensor collectives (testbed.model.spans) and their pricing.

Where the calibration has no elementwise passes (the TPU topologies) each span is a roofline of its own
(testbed.sim.price.compute.compute_seconds): an action's memory-bound work hides under its own span's matmuls only.
Invariants: without a tensor axis nothing changes; the spans carry the plan's bytes, plus the softmax's passes
and the loss's read of the logits, and all its matmuls; the span rule never prices an action below its one
roofline; a topology with elementwise passes ignores it; both tiers read it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from testbed.explore.analytic import estimate
from testbed.explore.floor import step_floor
from testbed.model.activations import LOSS_BYTES
from testbed.model.costs import chunk_cost
from testbed.model.spans import SOFTMAX_PASSES, action_spans, scaled_spans
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec
from testbed.sim.price.compute import compute_seconds
from testbed.sim.graph.engine import simulate
from testbed.sim.step import chunk_facts
from testbed.sim.step.action_work import action_work
from testbed.topology.io import load_topology


def _plan(tensor: int = 8, sp: bool = False, parallel: bool = False, stages: int = 1, **model) -> Plan:
    spec = ModelSpec(layers=2, d_model=1024, heads=16, d_ff=4096, seq_len=2048, vocab=32768,
                     parallel_block=parallel, **model)
    return Plan(name="spans", model=spec, batch=BatchSpec(global_batch=16 // tensor * 2, microbatches=2),
                mesh=MeshSpec(data=16 // tensor // stages, tensor=tensor, stage=stages),
                schedule=ScheduleSpec(name="1f1b"), precision="bf16-mixed", remat="none", sequence_parallel=sp)


def test_without_a_tensor_axis_an_action_is_one_span() -> None:
    plan = _plan(tensor=1)
    cost = chunk_cost(plan, 0)
    assert all(action_spans(plan, cost, kind, False) == () for kind in ("F", "B"))


@pytest.mark.parametrize(("sp", "parallel"), [(False, False), (True, False), (False, True), (True, True)])
def test_the_spans_carry_the_actions_matmuls_and_the_plans_bytes_with_the_softmax_and_the_loss(
        sp: bool, parallel: bool) -> None:
    """FLOPs shares sum to 1; the forward's bytes are the plan's forward bytes plus one more pass over each layer's
    scores (2 in all, the plan's kept probabilities 1) and the loss's read of the fp32 logits; the backward's the
    plan's (twice the forward's) plus three more passes over the scores (5 in all). One span per block between
    collectives (a parallel block one a layer), each norm one more with sequence parallelism, the lookup, the head,
    the loss."""
    plan = _plan(sp=sp, parallel=parallel)
    cost, spec, t = chunk_cost(plan, 0), plan.model, plan.mesh.tensor
    scores = 2 * plan.microbatch_size * spec.heads * spec.seq_len ** 2 / t
    logits = LOSS_BYTES * plan.microbatch_size * spec.seq_len * spec.padded_vocab / t
    forward, backward = (action_spans(plan, cost, kind, False) for kind in ("F", "B"))
    blocks = 1 if parallel else 2
    per_layer = blocks * (2 if sp else 1)
    assert len(forward) == 1 + spec.layers * per_layer + (2 if sp else 1) + 1
    assert len(backward) == len(forward) - 1
    for spans in (forward, backward):
        assert sum(f for f, _ in spans) == pytest.approx(1.0)
    _, hbm_f, _, _ = action_work(cost, "F", False, plan.remat)
    _, hbm_b, _, _ = action_work(cost, "B", False, plan.remat)
    extra_f = spec.layers * (SOFTMAX_PASSES["F"] - 1) * scores
    assert sum(b for _, b in forward) == pytest.approx(hbm_f + extra_f + logits)
    assert sum(b for _, b in backward) == pytest.approx(hbm_b + spec.layers * (SOFTMAX_PASSES["B"] - 2) * scores)


def test_a_later_stage_has_no_lookup_and_the_first_no_head() -> None:
    plan = _plan(stages=2, tensor=4)
    first, last = (action_spans(plan, chunk_cost(plan, s), "F", False) for s in (0, 1))
    assert len(first) == 1 + 2 * chunk_cost(plan, 0).layers
    assert len(last) == 2 * chunk_cost(plan, 1).layers + 2
    assert first[0][0] == 0.0 and last[-1][0] == 0.0  # the lookup and the loss's exp-sum: no matmul


def test_the_span_rule_never_prices_below_one_roofline_and_is_ignored_with_elementwise_passes() -> None:
    plan = _plan()
    cost = chunk_cost(plan, 0)
    tpu, gpu = load_topology("tpu-v5e-16x16"), load_topology("dgx-h100-superpod")
    assert tpu.calibration.elementwise is None and gpu.calibration.elementwise is not None
    for kind in ("F", "B"):
        flops, hbm, (rep, split), _ = action_work(cost, kind, False, plan.remat)
        spans = action_spans(plan, cost, kind, False)
        one = compute_seconds(tpu, "bf16", flops, hbm, 8, rep, split, cost.tensor_bytes)
        assert compute_seconds(tpu, "bf16", flops, hbm, 8, rep, split, cost.tensor_bytes, spans=spans) > one
        assert compute_seconds(gpu, "bf16", flops, hbm, 8, rep, split, cost.tensor_bytes, spans=spans) == \
            compute_seconds(gpu, "bf16", flops, hbm, 8, rep, split, cost.tensor_bytes)
        # One span of the action's own bytes is its one roofline; a piece's share is its share of the time.
        assert compute_seconds(tpu, "bf16", flops, hbm, 8, spans=((1.0, hbm),)) == \
            compute_seconds(tpu, "bf16", flops, hbm, 8)
        whole = compute_seconds(tpu, "bf16", flops, 0.0, 8, spans=spans)
        half = compute_seconds(tpu, "bf16", flops / 2, 0.0, 4, spans=scaled_spans(spans, 0.5))
        launch = tpu.calibration.compute.launch_overhead_s
        assert 2 * (half - launch) == pytest.approx(whole - launch)


def test_both_tiers_price_the_spans(monkeypatch) -> None:
    """The task graph and the analytic tier move together: with the spans, a tensor-parallel step on a TPU slice
    takes longer in both by the same compute; the search's floor stays under the estimate; GEMM by GEMM overlap
    (priced block by block) has none."""
    topology = load_topology("tpu-v5e-4x4")
    plan = replace(_plan(), batch=BatchSpec(global_batch=2), mesh=MeshSpec(data=2, tensor=8))
    overlapped = replace(plan, runtime=replace(plan.runtime, tp_comm_overlap=True))
    assert action_spans(overlapped, chunk_cost(overlapped, 0), "F", False) == ()
    with monkeypatch.context() as m:
        m.setattr(chunk_facts, "action_spans", lambda *args, **kwargs: ())
        graph_one, analytic_one = simulate(plan, topology).report.step_time_s, estimate(plan, topology).step_time_s
    graph, analytic = simulate(plan, topology).report.step_time_s, estimate(plan, topology).step_time_s
    assert graph > graph_one and analytic > analytic_one
    assert analytic - analytic_one == pytest.approx(graph - graph_one, rel=0.02)
    floor = step_floor(plan, topology)
    assert floor is not None and floor <= analytic


def test_with_the_heads_weight_gathered_the_loss_gradient_is_a_span_of_its_own() -> None:
    """fsdp x tensor: the head's input-gradient matmul reads the head's backward gather (a merge of its own), so
    the loss's gradient before it is a span without matmuls (the traced segments split there too,
    testbed.sim.graph.traced): the fp32 logits' share of the head's backward bytes, moved out of the head's span; the
    backward's bytes and FLOPs shares are unchanged."""
    data = _plan(tensor=4)
    fsdp = replace(data, mesh=MeshSpec(fsdp=data.mesh.data, tensor=4))
    spec, b = data.model, data.microbatch_size
    logits = LOSS_BYTES * b * spec.seq_len * (spec.padded_vocab // 4 + 1)
    for split in (False, True):
        plain, gathered = (action_spans(p, chunk_cost(p, 0), "B", split) for p in (data, fsdp))
        assert len(gathered) == len(plain) + 1
        assert gathered[0] == (0.0, (1 if split else 2) * logits)
        assert gathered[1] == (plain[0][0], pytest.approx(plain[0][1] - gathered[0][1]))
        assert gathered[2:] == plain[1:]


def test_a_plans_floor_does_not_take_the_spans_of_a_plan_sharing_its_chunk_costs() -> None:
    """Plans that differ only in ZeRO share their chunks' costs (testbed.sim.step.memo), but not their spans: ZeRO-3
    gathers the head's weight again for the backward, so its loss gradient is a span of its own. The search's floor
    memo (per topology) keys on that, so a plan's floor is the same whether or not a ZeRO-3 plan was floored first."""
    plain = replace(_plan(tensor=4), batch=BatchSpec(global_batch=4), mesh=MeshSpec(data=4, tensor=4))
    zero3 = replace(plain, zero=3)
    fresh = load_topology("tpu-v5e-4x4")
    alone = step_floor(plain, fresh)
    shared = load_topology("tpu-v5e-4x4")
    assert step_floor(zero3, shared) is not None
    assert step_floor(plain, shared) == alone
