"""Context parallelism in the simulator: the ring's table, its costs, tasks, overlap, memory, placement and search."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from testbed.collectives.timing import send_time
from testbed.explore.analytic import estimate
from testbed.explore.space import LONG_SEQUENCE, SearchSpace, candidates, context_degrees
from testbed.model import costs, gemm, ring
from testbed.model.memory import memory_breakdown
from testbed.plan.context import DIAGONAL, EMPTY, FULL, context_chunks, ring_step_pairs, ring_step_units
from testbed.plan.io import bundled_plan_names, load_plan, plan_from_dict
from testbed.plan.placement import place
from testbed.sim.graph.engine import simulate
from testbed.sim.graph.program import build_program
from testbed.sim.graph.ring import RING_STREAM, exposed_ring_s, ring_tasks
from testbed.topology.io import load_topology


def make_plan(*, context=1, tensor=1, data=1, stage=1, seq=32, attention="flash", remat="none", layers=2,
              kv_heads=None, microbatches=2, order=None, precision="fp32", d_model=64, heads=4, **model):
    mesh = {"data": data, "context": context, "tensor": tensor, "stage": stage}
    if order:
        mesh["order"] = order
    spec = {"layers": layers, "d_model": d_model, "heads": heads, "d_ff": 4 * d_model, "seq_len": seq, "vocab": 256,
            "attention": attention, **model}
    if kv_heads:
        spec["kv_heads"] = kv_heads
    return plan_from_dict({"name": "cp", "model": spec, "mesh": mesh, "precision": precision, "remat": remat,
                           "batch": {"global_batch": data * microbatches * 2, "microbatches": microbatches}})


# -- the ring's table (testbed.plan.context) ---------------------------------------------------------------


@given(st.integers(1, 9))
def test_ring_table_computes_every_causal_pair_once_with_equal_work_per_rank(c):
    seen: dict[tuple[int, int], int] = {}
    useful = []
    for rank in range(c):
        assert tuple(len(ring_step_pairs(c, rank, k)) for k in range(c)) == ring_step_units(c)
        work = Fraction(0)
        for step in range(c):
            for q, k, kind in ring_step_pairs(c, rank, step):
                assert q in context_chunks(2 * c, c)[rank]  # a rank computes only its own query chunks
                assert kind == (FULL if k < q else DIAGONAL if k == q else EMPTY)
                assert kind != EMPTY or step == 0  # masked-out pairs only inside the rank's own block
                seen[(q, k)] = seen.get((q, k), 0) + 1
                work += {FULL: 1, DIAGONAL: Fraction(1, 2), EMPTY: 0}[kind]
        useful.append(work)
    causal = {(q, k) for q in range(2 * c) for k in range(q + 1)}
    assert {p for p, n in seen.items() if p[1] <= p[0]} == causal and all(seen[p] == 1 for p in causal)
    assert len(set(useful)) == 1 and sum(useful) == Fraction((2 * c) ** 2, 2)  # balanced, the causal half
    assert ring_step_units(c) == (4,) + (2,) * (c - 1)


# -- costs ----------------------------------------------------------------------------------------------------


def test_context_one_is_the_model_itself_for_every_bundled_plan():
    for name in bundled_plan_names():
        plan = load_plan(name)
        if plan.mesh.context == 1:
            assert ring.rank_spec(plan) is plan.model
            assert ring.ring_phases(plan, "F") == ring.ring_phases(plan, "B") == ()
            assert ring.ring_bytes_per_layer(plan) == (0, 0) and ring.ring_workspace(plan) == 0


def test_llama3_405b_plan_has_no_ring():
    plan = load_plan("plans/llama3-405b.yaml")
    assert plan.mesh.context == 1 and ring.rank_spec(plan) is plan.model
    layers = costs.chunk_cost(plan, 1).layers
    for kind in ("F", "B"):  # the task graph plays its actions as one compute task each, as before
        assert ring_tasks(plan, kind, kind, layers, 1.0, (1.0, 0.0, 0.0, 0.0), (), 1) == []


@pytest.mark.parametrize("c", [1, 2, 4])
def test_attention_flops_per_rank_follow_the_ring_table(c):
    plan = make_plan(context=c, seq=64, layers=3)
    spec, b = plan.model, plan.microbatch_size
    tokens = b * spec.seq_len // c
    dense = 2 * tokens * (spec.d_model * 3 * spec.d_model + spec.d_model ** 2 + 2 * spec.d_model * spec.d_ff)
    head = 2 * tokens * spec.d_model * spec.padded_vocab
    pair = 2 * 2 * b * (spec.seq_len // (2 * c)) ** 2 * spec.d_model  # scores and values of one chunk pair
    cost = costs.chunk_cost(plan, 0)
    per_rank = [sum(len(ring_step_pairs(c, r, k)) for k in range(c)) * pair for r in range(c)]
    assert len(set(per_rank)) == 1
    assert cost.forward_flops == spec.layers * (dense + per_rank[0]) + head
    # Together the ranks compute the causal half of the dense s x s attention, plus the masked parts of the
    # rank's own block (the whole dense attention at c = 1).
    dense_attention = 2 * 2 * b * spec.seq_len ** 2 * spec.d_model
    assert c * per_rank[0] == dense_attention // 2 + c * 2 * pair
    assert (c * per_rank[0] == dense_attention) == (c == 1)


@given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from(["plain", "flash"]),
       st.sampled_from(["none", "selective", "full"]), st.sampled_from([None, 2, 1]))
def test_gemms_equal_the_flop_counts_and_the_ring_bytes_follow_the_formula(c, t, attention, remat, kv_heads):
    plan = make_plan(context=c, tensor=t, attention=attention, remat=remat, kv_heads=kv_heads)
    cost, shapes = costs.chunk_cost(plan, 0), gemm.chunk_gemms(plan, 0)
    assert gemm.gemm_flops(shapes.forward) == cost.forward_flops
    assert gemm.gemm_flops(shapes.backward_input) == cost.backward_input_flops
    assert gemm.gemm_flops(shapes.recompute) == cost.recompute_flops
    spec = plan.model
    width = spec.kv_dim // t if spec.num_kv_heads % t == 0 else spec.kv_dim  # K or V per token on a tensor rank
    kv = 2 * plan.microbatch_size * spec.seq_len // c * width * plan.precision.compute_bytes
    grad = 2 * plan.microbatch_size * spec.seq_len // c * width * 4
    assert ring.ring_bytes_per_layer(plan) == ((c - 1) * kv, (c - 1) * (kv + grad) + grad if c > 1 else 0)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_program_sends_the_ring_bytes_and_keeps_the_action_work(remat):
    plan = make_plan(context=4, data=2, layers=3, microbatches=2, remat=remat)
    program = build_program(plan, place(plan))
    rep = program.tasks[0].device
    fwd, bwd = ring.ring_bytes_per_layer(plan)
    if remat == "full":
        bwd += fwd  # the backward reruns the block's forward, ring included
    sent = {"F": 0.0, "B": 0.0}
    for t in program.tasks:
        if t.stream == RING_STREAM and t.device == rep:
            sent[t.name.split()[-1][0]] += t.nbytes * t.count  # by the action (F1, B0/2, ..) it belongs to
            assert t.group[1] == (t.group[0] + 1) % 4 + 4 * (t.group[0] // 4)  # the next rank of its ring
    m = plan.batch.microbatches
    assert sent["F"] == pytest.approx(m * plan.model.layers * ring.ring_bytes_per_layer(plan)[0])
    assert sent["B"] == pytest.approx(m * plan.model.layers * bwd)
    # The action's work is conserved: its compute tasks add up to the chunk's FLOPs.
    cost = costs.chunk_cost(plan, 0)
    total = sum(t.flops for t in program.tasks if t.stream == "compute" and t.name != "optimizer")
    assert total == pytest.approx(m * cost.total_flops)


# -- overlap, placement, analytic tier -----------------------------------------------------------------------


def _sim(plan, topology):
    sim = simulate(plan, topology)
    return sim, exposed_ring_s(sim.timeline)


def test_ring_across_nodes_is_slower_by_the_topology_and_more_exposed():
    topo = load_topology("dgx-h100-x4")  # NVSwitch inside a node, one 400 Gb/s NIC per GPU across
    # Sequences of 8192: a step's two ppermutes (testbed.model.ring.STEP_MESSAGES) are large enough that the links'
    # bandwidths, not their latencies, set the ratio below.
    inside = make_plan(context=4, data=8, seq=8192, d_model=512, heads=8, precision="bf16-mixed")
    across = make_plan(context=4, data=8, seq=8192, d_model=512, heads=8, precision="bf16-mixed",
                       order=["stage", "context", "data", "fsdp", "expert", "tensor"])
    (sim_in, exposed_in), (sim_out, exposed_out) = _sim(inside, topo), _sim(across, topo)
    durations = []
    for sim in (sim_in, sim_out):
        task = next(t for t in sim.program.tasks if t.stream == RING_STREAM)
        assert len({len(topo.route(*pair)) for pair in task.instances}) == 1  # every ring pair alike
        span = next(s for s in sim.timeline.spans(task.device) if s.label == task.name)
        durations.append((span.end - span.start, send_time(topo, *task.group, task.nbytes) * task.count))
    # Each ring step's sends take what the topology's route gives them (no link shared between pairs) ...
    for measured, alone in durations:
        assert measured == pytest.approx(alone, rel=1e-9)
    assert durations[1][1] / durations[0][1] > 5  # 50 GB/s NICs against 450 GB/s NVSwitch ports
    # ... and the ring inside a node hides more behind the attention.
    assert 0 < exposed_in < exposed_out
    assert sim_in.report.step_time_s < sim_out.report.step_time_s


def test_analytic_tier_prices_the_ring_like_the_task_graph():
    topo = load_topology("dgx-h100-x4")
    for order in (None, ["stage", "context", "data", "fsdp", "expert", "tensor"]):
        plan = make_plan(context=4, data=8, seq=4096, d_model=512, heads=8, precision="bf16-mixed", order=order,
                         layers=4)
        des, est = simulate(plan, topo).report.step_time_s, estimate(plan, topo).step_time_s
        assert est == pytest.approx(des, rel=0.02)


def test_default_placement_keeps_context_just_outside_tensor():
    plan = make_plan(context=4, tensor=2, data=4)
    topo = load_topology("dgx-h100-x4")
    placement = place(plan, topo)
    ring_group = placement.groups("context")[0]
    assert ring_group == (0, 2, 4, 6)  # stride tensor: one node holds the whole ring with its tensor ranks
    assert len({topo.coords(d)[1] for d in ring_group}) == 1


# -- memory ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("c", [2, 4])
def test_flash_activations_divide_by_context_and_the_ring_adds_its_blocks(c):
    topo = load_topology("dgx-h100")
    one, cp = make_plan(context=1, seq=64), make_plan(context=c, seq=64)
    layer = costs.activation_bytes_per_layer
    assert c * layer(ring.rank_spec(cp), cp.microbatch_size, cp.precision, cp.remat) == \
        layer(one.model, one.microbatch_size, one.precision, one.remat)
    m1, mc = memory_breakdown(one, topo), memory_breakdown(cp, topo)
    assert (m1.params, m1.grads, m1.optimizer) == (mc.params, mc.grads, mc.optimizer)  # replicated over context
    assert mc.activations < m1.activations
    assert ring.ring_workspace(cp) == 2 * (ring.kv_bytes(cp) + ring.grad_bytes(cp))


def test_plain_attention_under_context_keeps_no_score_matrix():
    topo = load_topology("dgx-h100")
    plain, flash = make_plan(context=2, seq=64, attention="plain"), make_plan(context=2, seq=64, attention="flash")
    assert memory_breakdown(plain, topo).activations == memory_breakdown(flash, topo).activations


@pytest.mark.parametrize("attention", ["plain", "flash"])
def test_a_ring_step_is_priced_as_a_loop_step_even_over_one_block(attention):
    """The ring carries fp32 dq, dK and dV across its steps whatever the block: a rank holding one K/V block (plain
    attention's whole ``s_l``, or flash's ``s_l <= block``) is priced as the flash loop, not as the single-device
    one-block program's four fp32 tiles (memory_vs_xla's plain ``long-b4-cp2``)."""
    from testbed.model.workspace import attention_workspace as _attention_workspace
    plan = make_plan(context=2, seq=64, attention=attention, microbatches=1)
    b, heads, s_l, d = plan.microbatch_size, 4, 32, 64
    tile = b * heads * s_l * s_l                                # one s_l x s_l block, every query head
    loop = tile * (2 * 4 + 4) + 4 * b * s_l * d + 2 * 4 * b * s_l * d  # 2 fp32 tiles, the score gradient, the carry
    assert _attention_workspace(plan) == loop != 4 * 4 * tile


@pytest.mark.parametrize("context", [2, 4])
def test_the_rings_messages_ride_beside_a_later_steps_half_tiles(context):
    """Step 0 attends to the rank's own K/V (no message in flight); with one K/V block a ring step, each later step
    computes half a block (testbed.plan.context's units: 4, then 2), so the messages add only what they exceed
    half the tiles by. A blockwise step keeps its whole tiles beside them."""
    from testbed.model.workspace import attention_workspace as _attention_workspace
    from testbed.model.workspace import sublayer_workspace as _sublayer_workspace
    plan = make_plan(context=context, seq=64 * context, attention="plain", microbatches=1)
    b, heads, s_l = plan.microbatch_size, 4, 64
    tiles = b * heads * s_l * s_l * (2 * 4 + 4)  # two fp32 tiles and the score gradient
    attention, messages = _attention_workspace(plan), ring.ring_workspace(plan)
    assert ring.ring_attention_workspace(plan, attention, tiles) == max(attention, attention - tiles // 2 + messages)
    assert attention <= _sublayer_workspace(plan) < attention + messages
    blockwise = make_plan(context=context, seq=512 * context, attention="flash", microbatches=1)
    spec = ring.rank_spec(blockwise)
    assert spec.flash_block < spec.seq_len
    assert ring.ring_attention_workspace(blockwise, attention, tiles) == attention + ring.ring_workspace(blockwise)


# -- the bundled long-context plan and the search -------------------------------------------------------------


def test_long_context_plan_simulates_in_seconds_and_shows_the_ring():
    plan = load_plan("plans/llama3-8b-128k.yaml")
    topo = load_topology(plan.topology)
    start = time.perf_counter()
    sim = simulate(plan, topo)
    assert time.perf_counter() - start < 10
    assert sim.report.memory["fits"]
    assert 0 < exposed_ring_s(sim.timeline) <= sim.report.exposed_comm_s
    assert any(t.stream == RING_STREAM for t in sim.program.tasks)


def test_search_space_adds_context_for_long_sequences_only():
    short, long = make_plan(seq=64), make_plan(seq=LONG_SEQUENCE)
    assert context_degrees(short, 8, SearchSpace()) == (1,)
    assert context_degrees(long, 8, SearchSpace()) == (1, 2, 4, 8)
    assert context_degrees(short, 8, SearchSpace(contexts=(1, 2))) == (1, 2)
    assert context_degrees(make_plan(seq=20), 8, SearchSpace(contexts=(1, 2, 4))) == (1, 2)  # 20 % 8 != 0
    found = {p.mesh.context for p in candidates(long, 8, SearchSpace(schedules=("1f1b",), remat=("none",), zero=(0,)))}
    assert found == {1, 2, 4, 8}


def test_gradients_are_summed_over_context():
    plan = make_plan(context=4, data=2, layers=2)
    placement = place(plan)
    reduced = [t for t in build_program(plan, placement).tasks if t.stream == "grad"]
    assert reduced and all(t.op == "all_reduce" for t in reduced)
    replicas = {tuple(sorted(g)) for g in placement.groups("context")}
    for t in reduced:  # one all-reduce over data x context: each group joins two context rings
        assert len(t.group) == 8 and sum(tuple(sorted(set(t.group) & set(g))) in replicas for g in replicas) == 2


# -- runtime.context_all_gather (Llama 3's all-gather context parallelism) --------------------------------------


def _gathering(plan):
    from dataclasses import replace
    return replace(plan, runtime=replace(plan.runtime, context_all_gather=True))


@pytest.mark.parametrize("remat", ["none", "full"])
def test_all_gather_context_sends_its_bytes_before_the_attention_and_keeps_the_work(remat):
    """K/V gathered (c - 1 messages of kv) before any attention step, dK/dV reduce-scattered (c - 1 of grad) after
    the last; the backward regathers only to rerun the forward under full remat; the action's FLOPs unchanged."""
    plan = _gathering(make_plan(context=4, data=2, layers=3, microbatches=2, remat=remat))
    program = build_program(plan, place(plan))
    rep, (fwd, bwd) = program.tasks[0].device, ring.ring_bytes_per_layer(plan)
    kv, grad = ring.kv_bytes(plan), ring.grad_bytes(plan)
    assert (fwd, bwd) == (3 * kv, 3 * grad + (3 * kv if remat == "full" else 0))
    if remat == "full":
        bwd += fwd - 3 * kv  # bytes_per_layer counts the rerun's gather already
    sent = {"F": 0.0, "B": 0.0}
    for t in program.tasks:
        if t.stream == RING_STREAM and t.device == rep:
            sent[t.name.split()[-1][0]] += t.nbytes * t.count
    m, layers = plan.batch.microbatches, plan.model.layers
    assert sent == pytest.approx({"F": m * layers * fwd, "B": m * layers * bwd})
    cost = costs.chunk_cost(plan, 0)
    total = sum(t.flops for t in program.tasks if t.stream == "compute" and t.name != "optimizer")
    assert total == pytest.approx(m * cost.total_flops)
    # Every forward attention step (a rerun one too) waits for its action's gather: nothing of the ring beside it.
    steps = [t for t in program.tasks if t.device == rep and " attention F " in t.name]
    assert steps and all(any(program.tasks[d].name.startswith("all-gather K/V ") for d in t.deps) for t in steps)


def test_all_gather_context_exposes_what_the_ring_hides_in_both_tiers():
    """Across nodes the ring hides its sends behind the attention steps; the all-gather waits for them: slower in
    the task graph and the analytic tier (which agree), more ring time exposed; no context axis: no change."""
    topo = load_topology("dgx-h100-x4")
    order = ["stage", "context", "data", "fsdp", "expert", "tensor"]
    ring_plan = make_plan(context=4, data=8, seq=65536, d_model=512, heads=4, precision="bf16-mixed", order=order)
    gathered = _gathering(ring_plan)
    (sim_r, exposed_r), (sim_g, exposed_g) = _sim(ring_plan, topo), _sim(gathered, topo)
    assert exposed_g > exposed_r and sim_g.report.step_time_s > sim_r.report.step_time_s
    est_r, est_g = estimate(ring_plan, topo).step_time_s, estimate(gathered, topo).step_time_s
    assert est_g > est_r and est_g == pytest.approx(sim_g.report.step_time_s, rel=0.02)
    flat = make_plan(data=8, seq=4096, d_model=512, heads=8, precision="bf16-mixed")
    assert build_program(_gathering(flat), place(flat)).tasks == build_program(flat, place(flat)).tasks


# -- runtime.context_merge_fp32 (PyTorch context_parallel's eager fp32 merges) ------------------------------------


@pytest.mark.parametrize("remat", ["none", "full"])
def test_fp32_merges_add_their_bytes_as_one_task_per_ring_action_in_both_tiers(remat):
    """Each F/B action of the ring gets one memory task with the merges of its steps (forward: step 0's casts and
    c - 1 merges per layer; backward: c accumulations, plus the rerun forward's under full remat); no FLOPs change;
    both tiers slower by about the same; no context axis: nothing."""
    from dataclasses import replace
    base = make_plan(context=4, data=2, layers=3, microbatches=2, remat=remat, seq=4096, d_model=512, heads=8,
                     precision="bf16-mixed")
    plan = replace(base, runtime=replace(base.runtime, context_merge_fp32=True))
    program, rep = build_program(plan, place(plan)), None
    rep = program.tasks[0].device
    merges = [t for t in program.tasks if t.device == rep and t.name.endswith("ring merges")]
    c, layers, m = 4, plan.model.layers, plan.batch.microbatches
    forward = layers * (ring.merge_bytes(plan, "F", True) + (c - 1) * ring.merge_bytes(plan, "F", False))
    backward = layers * c * ring.merge_bytes(plan, "B", False) + (forward if remat == "full" else 0)
    assert sorted(t.hbm_bytes for t in merges) == pytest.approx(sorted([forward] * m + [backward] * m))
    assert all(t.flops == 0 for t in merges)
    assert ring.merge_bytes(base, "F", False) == 0  # the field off: nothing
    flops = [sum(t.flops for t in build_program(p, place(p)).tasks) for p in (base, plan)]
    assert flops[0] == pytest.approx(flops[1])
    topo = load_topology("dgx-h100")
    des = [simulate(p, topo).report.step_time_s for p in (base, plan)]
    est = [estimate(p, topo).step_time_s for p in (base, plan)]
    assert des[1] > des[0] and est[1] > est[0]
    assert (est[1] - est[0]) == pytest.approx(des[1] - des[0], rel=0.1)
    flat = make_plan(data=8, seq=4096, d_model=512, heads=8, precision="bf16-mixed")
    flat_merged = replace(flat, runtime=replace(flat.runtime, context_merge_fp32=True))
    assert build_program(flat_merged, place(flat)).tasks == build_program(flat, place(flat)).tasks
