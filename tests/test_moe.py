"""Mixture of experts in the model and the simulator: presets, layout rows, costs, memory, task graph.

The presets' total and active parameter counts are the published ones, exactly:

- Mixtral 8x7B: Jiang et al. 2024, "Mixtral of Experts", Table 1 (shapes), and the released
  ``mistralai/Mixtral-8x7B-v0.1`` checkpoint: 46,702,792,704 parameters, 12,879,925,248 active
  (the paper's "47B" / "13B active").
- DeepSeekMoE 16B: Dai et al. 2024, "DeepSeekMoE", Sec. 5.1, and the ``deepseek-moe-16b-base``
  ``config.json``: 16,375,728,128 / 2,828,650,496 from the config (the paper's "16.4B" / "2.8B").
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from testbed.explore.analytic import estimate
from testbed.model import costs, layout, memory, moe, workspace
from testbed.model.gemm import chunk_gemms, gemm_flops
from testbed.model.memory import memory_breakdown
from testbed.plan.presets import PUBLISHED_ACTIVE_PARAMS, PUBLISHED_PARAMS, preset
from testbed.plan.runtime import RuntimeSpec
from testbed.plan.placement import place
from testbed.plan.sharding import reduction_axes
from testbed.plan.spec import Axis, BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec
from testbed.sim.graph.engine import simulate
from testbed.sim.step.moe import A2A_STREAM
from testbed.sim.graph.program import TaskKind, axis_groups, build_program
from testbed.topology.io import load_topology

HOST = load_topology("host-cpu-8")


@pytest.mark.parametrize("name,total,active", [
    ("mixtral-8x7b", 46_702_792_704, 12_879_925_248),
    ("deepseek-moe-16b", 16_375_728_128, 2_828_650_496),
])
def test_presets_reproduce_published_counts(name, total, active):
    spec = ModelSpec(**preset(name))
    assert costs.param_count(spec) == PUBLISHED_PARAMS[name] == total
    assert moe.active_param_count(spec) == PUBLISHED_ACTIVE_PARAMS[name] == active


def test_dense_active_count_is_the_total():
    spec = ModelSpec(**preset("llama3-8b"))
    assert moe.active_param_count(spec) == costs.param_count(spec)


def test_layout_rows_of_moe_layers():
    spec = ModelSpec(**preset("deepseek-moe-16b"))
    dense, sparse = layout.layer_params(spec, 0), layout.layer_params(spec, 1)
    names0, names1 = {p.path for p in dense}, {p.path for p in sparse}
    assert ("mlp", "w1") in names0 and not any(p[0] == "moe" for p in names0)
    assert ("moe", "router") in names1 and ("mlp", "w1") not in names1
    rows = {p.path: p for p in sparse}
    assert rows[("moe", "router")].shape == (2048, 64) and rows[("moe", "router")].expert_dim is None
    w1, w2 = rows[("moe", "w1")], rows[("moe", "w2")]
    assert w1.shape == (64, 2048, 1408) and (w1.expert_dim, w1.tensor_dim) == (0, 2)
    assert w2.shape == (64, 1408, 2048) and (w2.expert_dim, w2.tensor_dim) == (0, 1)
    assert rows[("moe", "shared_w1")].shape == (2048, 2 * 1408) and not rows[("moe", "shared_w1")].is_expert
    with pytest.raises(ValueError):
        layout.layer_params(spec)  # layers differ: the index is needed
    assert layout.param_at(spec, ["layers", "moe", "w3"]) == rows[("moe", "w3")]
    # The default GPT's keys and leaves do not move; an MoE layer draws more keys.
    assert layout.layer_keys(spec) > layout.LAYER_KEYS


@st.composite
def moe_plans(draw) -> Plan:
    """Small MoE plans on 8 devices: expert, data, tensor and stage degrees, SwiGLU or GELU, shared experts."""
    expert = draw(st.sampled_from([1, 2, 4]))
    tensor = draw(st.sampled_from([1, 2]))
    stage = draw(st.sampled_from([1, 2] if expert * tensor < 8 else [1]))
    data = 8 // (expert * tensor * stage)  # the host's 8 devices
    experts = expert * draw(st.sampled_from([1, 2]))
    layers = stage * draw(st.integers(1, 2))
    spec = ModelSpec(layers=layers, d_model=32, heads=4, d_ff=64, seq_len=16, vocab=64, experts=experts,
                     top_k=min(2, experts), expert_d_ff=draw(st.sampled_from([None, 32])),
                     shared_experts=draw(st.integers(0, 1)), mlp=draw(st.sampled_from(["gelu", "swiglu"])),
                     first_dense_layers=draw(st.integers(0, 1)) if layers > 1 else 0,
                     capacity_factor=draw(st.sampled_from([None, 1.25])))
    micro = draw(st.sampled_from([1, 2]))
    return Plan(model=spec, batch=BatchSpec(global_batch=data * expert * micro * 2, microbatches=micro),
                mesh=MeshSpec(data=data, expert=expert, tensor=tensor, stage=stage),
                schedule=ScheduleSpec(name="1f1b"), precision="fp32", remat=draw(st.sampled_from(["none", "full"])),
                zero=draw(st.sampled_from([0, 1])), expert_imbalance=draw(st.sampled_from([1.0, 1.5])))


@given(moe_plans())
def test_expert_params_divide_by_the_expert_degree(plan):
    """Routed experts' weights (params, grads, optimizer state) split over the expert axis; the rest does not."""
    one = replace(plan, mesh=replace(plan.mesh, expert=1, data=plan.mesh.data * plan.mesh.expert))
    for s in range(plan.mesh.stage):
        ep = plan.mesh.expert
        assert costs.device_stage_params(plan, s, experts_only=True) * ep == \
            costs.device_stage_params(one, s, experts_only=True)
        assert costs.device_stage_params(plan, s, experts_only=False) == \
            costs.device_stage_params(one, s, experts_only=False)
    mem, mem1 = memory_breakdown(plan, HOST), memory_breakdown(one, HOST)
    assert mem.params_count == mem1.params_count == costs.param_count(plan.model)
    if plan.mesh.expert > 1:  # some stage holds an MoE layer
        assert sum(m.params for m in mem.per_stage) < sum(m.params for m in mem1.per_stage)


@given(moe_plans())
def test_chunk_flops_equal_the_gemms(plan):
    """The cost model's FLOPs of every action equal its GEMMs' (MoE blocks included)."""
    split = False
    for s in range(plan.mesh.stage):
        cost, shapes = costs.chunk_cost(plan, s), chunk_gemms(plan, s)
        assert math.isclose(gemm_flops(shapes.action("F", split)), cost.forward_flops, rel_tol=1e-9)
        assert math.isclose(gemm_flops(shapes.action("B", split)), cost.backward_flops + cost.recompute_flops,
                            rel_tol=1e-9)


def test_model_flops_count_active_experts():
    """MFU's FLOPs: Mixtral's MoE layers do ``top_k`` experts' MLPs per token, not ``experts``."""
    spec = ModelSpec(**preset("mixtral-8x7b"))
    plan = Plan(model=spec, batch=BatchSpec(global_batch=8), mesh=MeshSpec(data=8), schedule=ScheduleSpec(),
                precision="bf16-mixed")
    dense = replace(spec, experts=0, d_ff=spec.top_k * spec.d_ff)  # top-2 of 14336: a 28672-wide dense MLP
    router = 2 * 8 * spec.seq_len * spec.d_model * spec.experts * spec.layers * 3
    assert math.isclose(costs.model_flops_per_step(plan), costs.model_flops_per_step(replace(plan, model=dense))
                        + router, rel_tol=1e-12)


@given(moe_plans())
def test_program_all_to_alls_and_reductions(plan):
    """Two all-to-alls per MoE layer per F and B over the expert groups (four in B under full remat), none
    without expert parallelism; dense gradients are reduced over expert, routed experts' are not."""
    placement = place(plan, HOST)
    program = build_program(plan, placement)
    a2a = [t for t in program.tasks if t.op == "all_to_all"]
    per_step = plan.batch.microbatches * moe.moe_layers(plan.model) * (2 + (4 if plan.remat == "full" else 2))
    assert sum(t.count for t in a2a) == (per_step if plan.mesh.expert > 1 else 0)
    groups = axis_groups(placement, [Axis.EXPERT])
    for t in a2a:
        assert t.stream == A2A_STREAM and t.kind is TaskKind.COLLECTIVE and t.group in groups[0] + groups.get(1, ())
        assert t.nbytes == moe.dispatch_bytes(plan)
    grads = [t for t in program.tasks if t.stream == "grad" and "accumulate" not in t.name and t.op != "all_gather"]
    for t in grads:
        axes = reduction_axes(plan, t.name.endswith("experts"))
        assert len(t.group) <= math.prod(plan.mesh.degree(a) for a in axes)
        if t.name.endswith("experts"):
            assert not set(t.group) & (set(_expert_peers(placement, t.device)) - {t.device})


def _expert_peers(placement, device):
    return next(g for gs in axis_groups(placement, [Axis.EXPERT]).values() for g in gs if device in g)


def test_reduction_axes_by_kind():
    plan = Plan(model=ModelSpec(layers=2, d_model=32, heads=4, d_ff=64, seq_len=16, vocab=64, experts=4),
                batch=BatchSpec(global_batch=8), mesh=MeshSpec(data=2, expert=2, tensor=2), schedule=ScheduleSpec())
    assert reduction_axes(plan) == (Axis.DATA, Axis.EXPERT)
    assert reduction_axes(plan, expert=True) == (Axis.DATA,)


def test_imbalance_and_capacity_scale_expert_work():
    """The busiest expert rank's load paces the routed experts (a dropless grouped GEMM); a capacity factor pads
    them, and so does the runner's dropless routing (every expert ``seq_len`` slots: ``experts / top_k``)."""
    spec = ModelSpec(layers=2, d_model=32, heads=4, d_ff=64, seq_len=16, vocab=64, experts=4, top_k=2)
    runner = Plan(model=spec, batch=BatchSpec(global_batch=4), mesh=MeshSpec(expert=4), schedule=ScheduleSpec())
    plan = replace(runner, runtime=RuntimeSpec(moe_padded_dropless=False))
    base = moe.expert_tokens(plan)
    assert base == 4 * 16 * 2 // 4  # ep N top_k / E
    assert moe.expert_tokens(runner) == 4 * 16 == base * spec.experts // spec.top_k
    assert moe.expert_tokens(replace(runner, expert_imbalance=1.5)) == moe.expert_tokens(runner)
    assert moe.expert_tokens(replace(plan, expert_imbalance=1.5)) == 1.5 * base
    padded = replace(plan, model=replace(spec, capacity_factor=1.25), expert_imbalance=2.0)
    assert moe.expert_tokens(padded) == 1.25 * base
    assert moe.dispatch_bytes(plan) == 16 * 2 * 32 * 4  # N top_k d, fp32
    assert costs.chunk_cost(replace(plan, expert_imbalance=1.5), 0).forward_flops > costs.chunk_cost(plan, 0).forward_flops


def test_analytic_tier_follows_the_simulator_on_moe_plans():
    """The search's fast tier prices the MoE all-to-alls as the task graph plays them: on a two-layer Mixtral
    on four DGX H100s, with the expert axis inside a node or across nodes, it is within 15% of the DES step
    and ranks the two placements as the DES does."""
    topo = load_topology("dgx-h100-x4")
    spec = replace(ModelSpec(**preset("mixtral-8x7b")), layers=2, seq_len=1024)
    out = []
    for order in (("stage", "fsdp", "context", "tensor", "data", "expert"),
                  ("stage", "expert", "fsdp", "context", "tensor", "data")):
        plan = Plan(model=spec, batch=BatchSpec(global_batch=32), schedule=ScheduleSpec(), precision="bf16-mixed",
                    mesh=MeshSpec(data=8, expert=4, order=order), remat="full")
        fast, des = estimate(plan, topo).step_time_s, simulate(plan, topo).report.step_time_s
        assert abs(fast - des) < 0.15 * des
        out.append((fast, des))
    assert (out[0][0] < out[1][0]) == (out[0][1] < out[1][1])


def test_search_space_has_the_expert_axis():
    """MoE models get expert degrees dividing the experts and the devices; dense ones only 1."""
    from testbed.explore.space import SearchSpace, candidates

    spec = ModelSpec(layers=2, d_model=32, heads=4, d_ff=64, seq_len=16, vocab=64, experts=4)
    base = Plan(model=spec, batch=BatchSpec(global_batch=8), schedule=ScheduleSpec(), precision="fp32")
    space = SearchSpace(zero=(0,), remat=("none",), microbatches=(1,))
    plans = list(candidates(base, 8, space))
    assert {p.mesh.expert for p in plans} == {1, 2, 4}
    assert all(p.mesh.size == 8 for p in plans)
    dense = replace(base, model=replace(spec, experts=0))
    assert {p.mesh.expert for p in candidates(dense, 8, space)} == {1}
    assert {p.mesh.expert for p in candidates(base, 8, replace(space, experts=(2,)))} == {2}
    best = min((p for p in plans if p.mesh.expert == 4), key=lambda p: p.mesh.data)
    assert estimate(best, HOST).step_time_s > 0


def test_context_and_expert_parallelism_compose():
    """With both axes an MoE action runs its ring attention (sends on the ring stream) and then its MoE chain:
    every all-to-all and every ring send of the two alone is there."""
    spec = ModelSpec(layers=2, d_model=32, heads=4, d_ff=64, seq_len=32, vocab=64, experts=4, attention="flash")
    plan = Plan(model=spec, batch=BatchSpec(global_batch=4), mesh=MeshSpec(context=2, expert=2, data=2),
                schedule=ScheduleSpec(), precision="fp32")
    program = build_program(plan, place(plan, HOST))
    only_ring = build_program(replace(plan, mesh=MeshSpec(context=2, data=4)), place(
        replace(plan, mesh=MeshSpec(context=2, data=4)), HOST))
    sends = lambda p: sum(t.count for t in p.tasks if t.kind is TaskKind.SEND)  # noqa: E731
    assert sends(program) == sends(only_ring) > 0
    assert sum(t.count for t in program.tasks if t.op == "all_to_all") == 2 * (2 + 2)
    report = simulate(plan, HOST).report
    assert report.step_time_s > 0
    # The analytic tier plays the same composition (the search ranks such plans by it).
    assert abs(estimate(plan, HOST).step_time_s - report.step_time_s) < 0.15 * report.step_time_s


def test_capacity_padding_grows_buffers_not_state():
    """A capacity factor pads the dispatched tokens: activations, dispatch workspace and the all-to-all bytes
    grow with it over a dropless grouped GEMM's routed tokens; parameters, gradients and optimizer state do not."""
    spec = ModelSpec(layers=2, d_model=32, heads=4, d_ff=64, seq_len=16, vocab=64, experts=4, top_k=2)
    plan = Plan(model=spec, batch=BatchSpec(global_batch=8), mesh=MeshSpec(expert=4, data=2),
                schedule=ScheduleSpec(), precision="fp32", runtime=RuntimeSpec(moe_padded_dropless=False))
    padded = replace(plan, model=replace(spec, capacity_factor=2.0))
    a, b = memory_breakdown(plan, HOST).per_stage[0], memory_breakdown(padded, HOST).per_stage[0]
    # Gradients live at the peak instant: none at a layer's backward, where XLA defers them (kept.weight_grads_deferred).
    assert (a.params, a.optimizer) == (b.params, b.optimizer) and b.grads <= a.grads
    # The peak instants differ (the padded plan's is a layer's backward): compare the terms themselves.
    assert moe.activation_bytes_swap(padded, 1) > moe.activation_bytes_swap(plan, 1) and b.total > a.total
    assert workspace.layer_workspace(padded) - workspace.layer_workspace(plan) >= 2 * moe.dispatch_bytes(plan)
    assert moe.dispatch_bytes(padded) == 2 * moe.dispatch_bytes(plan) == 2 * 16 * 2 * 32 * 4
