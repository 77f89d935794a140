"""The ``runtime:`` fields priced: each moves both the task graph (DES) and the analytic tier the stated way,
and the default (the runner's behaviour) leaves every prediction as it was.

Plans are small GPTs on an 8-GPU H100 node (tensor, data and pipeline degrees as each mechanism needs);
testbed.plan.runtime documents the fields, testbed.model.gemm and testbed.sim.step.facts price them.
"""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from testbed.explore.analytic import estimate
from testbed.model import costs
from testbed.model.gemm import alternate_matmuls, chunk_gemms, gemm_flops
from testbed.model.leaves import norm_elements
from testbed.plan.io import plan_from_dict
from testbed.plan.placement import place
from testbed.plan.runtime import PROFILES, RECOMPUTE, RuntimeSpec
from testbed.sim.graph.engine import simulate
from testbed.sim.step.facts import BUCKETS, step_facts
from testbed.sim.graph.program import build_program
from testbed.sim.step.grad_bytes import summed_after_the_loop
from testbed.topology.io import load_topology

TOPOLOGY = "dgx-h100"


def _plan(runtime: dict | None = None, **over):
    spec = {"name": "r", "model": {"layers": 8, "d_model": 1024, "heads": 16, "d_ff": 4096, "seq_len": 1024,
                                   "vocab": 32000, "attention": "flash"},
            "batch": {"global_batch": 16, "microbatches": 2}, "mesh": {"data": 2, "tensor": 4},
            "precision": "bf16-mixed", "remat": "full", "zero": 0}
    spec.update(over)
    if runtime is not None:
        spec["runtime"] = runtime
    return plan_from_dict(spec, default_name="r")


def _both(plan) -> tuple[float, float]:
    """(DES step seconds, analytic step seconds)."""
    topology = load_topology(TOPOLOGY)
    return simulate(plan, topology).report.step_time_s, estimate(plan, topology).step_time_s


@pytest.mark.parametrize("over", [{}, {"remat": "selective"}, {"remat": "none", "zero": 1},
                                  {"mesh": {"fsdp": 2, "tensor": 4}}, {"mesh": {"data": 2, "stage": 2, "tensor": 2}}])
def test_the_default_and_every_field_at_its_default_change_nothing(over):
    """No ``runtime:``, the ``testbed`` and ``xla`` profiles and every field stated at its default: the same task
    graph, DES step and analytic step, bit for bit."""
    topology = load_topology(TOPOLOGY)
    base = _plan(**over)
    stated = {f.name: getattr(RuntimeSpec(), f.name) for f in fields(RuntimeSpec)}
    for runtime in ({"profile": "testbed"}, {"profile": "xla"}, stated):
        plan = _plan(runtime, **over)
        placement = place(plan, topology)
        assert build_program(plan, placement).tasks == build_program(base, placement).tasks
        assert _both(plan) == _both(base)


def test_block_recompute_reruns_the_out_projections_and_their_collectives():
    runner, block = _plan(), _plan({"recompute": "block"})
    c0, c1 = costs.chunk_cost(runner, 0, 0), costs.chunk_cost(block, 0, 0)
    d, f, n, t = 1024, 4096, runner.microbatch_size * 1024, 4
    assert c1.recompute_flops - c0.recompute_flops == 8 * 2 * n * d * f // t  # one down projection per layer
    (_, ar0), = c0.tensor_collectives("B", "full")
    (_, ar1), = c1.tensor_collectives("B", "full")
    assert ar1 - ar0 == 8  # its all-reduce, once per layer
    (d0, a0), (d1, a1) = _both(runner), _both(block)
    assert d1 > d0 and a1 > a0


def test_op_recompute_reruns_every_other_matmul():
    """torchtitan's per-op policy under selective remat: the 2nd, 4th, ... of Q, K, V, out, MLP in, MLP out."""
    plan = _plan({"recompute": "op"}, remat="selective")
    g = chunk_gemms(plan, 0, 0)
    alt = alternate_matmuls(plan.model, plan.microbatch_size * 1024, 4)
    # Of Q, K, V, out, MLP in, MLP out (tensor 4): K, the out projection and the MLP out projection.
    assert [(x.n, x.k) for x in alt] == [(1024 // 4, 1024), (1024, 1024 // 4), (1024, 4096 // 4)]
    assert gemm_flops(g.recompute) == pytest.approx(costs.chunk_cost(plan, 0, 0).recompute_flops)
    none, selective = _both(_plan(remat="selective"))
    op = _both(plan)
    full = _both(_plan({"recompute": "block"}))
    assert none < op[0] < full[0] and selective < op[1] < full[1]


@pytest.mark.parametrize("mesh", [{"data": 2, "tensor": 4}, {"fsdp": 8}])
def test_save_policies_rerun_fewer_projections_than_full_remat(mesh):
    """MaxText's save_qkv_proj and save_dot_except_mlpwi as ``runtime.recompute``: the backward reruns the
    runner's full remat less the Q/K/V projections (and the out projection), so the step is faster, and slower
    than no remat; selective remat is unchanged."""
    d, n = 1024, _plan(mesh=mesh).microbatch_size * 1024
    t = mesh.get("tensor", 1)
    runner = costs.chunk_cost(_plan(mesh=mesh), 0, 0).recompute_flops
    qkv = costs.chunk_cost(_plan({"recompute": "save-qkv"}, mesh=mesh), 0, 0).recompute_flops
    dots = costs.chunk_cost(_plan({"recompute": "save-attention-dots"}, mesh=mesh), 0, 0).recompute_flops
    assert runner - qkv == 8 * 2 * n * d * 3 * d // t  # Q, K and V (no grouped heads here), 8 layers
    assert qkv - dots == 8 * 2 * n * d * d // t  # and the out projection
    steps = [_both(_plan(runtime, mesh=mesh)) for runtime in (None, {"recompute": "save-qkv"},
                                                                {"recompute": "save-attention-dots"})]
    none = _both(_plan(mesh=mesh, remat="none"))
    for i in range(2):  # DES and analytic alike
        assert steps[0][i] > steps[1][i] > steps[2][i] > none[i]
    assert _both(_plan({"recompute": "save-qkv"}, mesh=mesh, remat="selective")) == _both(
        _plan(mesh=mesh, remat="selective"))


def test_save_dots_recomputes_selectives_flops_and_the_elementwise_passes():
    """MaxText's ``minimal`` (``save-dots``) under selective remat: selective's recompute FLOPs and the flash
    attention's forward (the weight matmuls' outputs are kept; the kernel's output is no dot, so its forward
    reruns: testbed.model.gemm.dots_rerun_attention); the norms and the activation function are rerun, so the
    recompute's elementwise traffic grows and the step is no faster than selective's. Under full remat it is the
    runner's, bit for bit."""
    for mesh in ({"data": 2, "tensor": 4}, {"fsdp": 8}):
        plan, dots = _plan(mesh=mesh, remat="selective"), _plan({"recompute": "save-dots"}, mesh=mesh, remat="selective")
        a, b = costs.chunk_cost(plan, 0, 0), costs.chunk_cost(dots, 0, 0)
        spec, t = plan.model, plan.mesh.tensor
        attention_forward = spec.layers * 2 * 2 * plan.microbatch_size * spec.seq_len ** 2 * spec.q_dim // t
        assert b.recompute_flops == a.recompute_flops + attention_forward
        assert b.recompute_traffic[0] > a.recompute_traffic[0] and b.recompute_traffic[1] > a.recompute_traffic[1]
        assert all(x >= y for x, y in zip(_both(dots), _both(plan)))
        assert _both(_plan({"recompute": "save-dots"}, mesh=mesh)) == _both(_plan(mesh=mesh))


@pytest.mark.parametrize("over", [{"remat": "full"}, {"remat": "selective"}, {"remat": "none"}])
@pytest.mark.parametrize("policy", RECOMPUTE)
def test_recompute_gemms_equal_the_cost_model(policy, over):
    for model in ({}, {"kv_heads": 4, "mlp": "swiglu", "norm": "rmsnorm", "position": "rope"},
                  {"attention": "plain"}):
        plan = _plan({"recompute": policy}, **over, model={"layers": 4, "d_model": 256, "heads": 8, "d_ff": 1024,
                                                           "seq_len": 128, "vocab": 512, **model})
        cost, g = costs.chunk_cost(plan, 0, 0), chunk_gemms(plan, 0, 0)
        assert gemm_flops(g.recompute) == pytest.approx(cost.recompute_flops)


def test_recompute_gemms_equal_the_cost_model_with_moe_layers():
    model = {"layers": 4, "d_model": 256, "heads": 8, "d_ff": 1024, "seq_len": 128, "vocab": 512, "experts": 4,
             "top_k": 2, "moe_every": 2}
    for policy in RECOMPUTE:
        for remat in ("full", "selective"):
            plan = _plan({"recompute": policy}, model=model, remat=remat, mesh={"data": 2, "expert": 2, "tensor": 2})
            cost, g = costs.chunk_cost(plan, 0, 0), chunk_gemms(plan, 0, 0)
            assert gemm_flops(g.recompute) == pytest.approx(cost.recompute_flops)


def test_tp_comm_overlap_hides_tensor_collectives_behind_the_compute():
    plan = _plan(remat="none", zero=1)
    overlapped = _plan({"tp_comm_overlap": True}, remat="none", zero=1)
    (d0, a0), (d1, a1) = _both(plan), _both(overlapped)
    assert d1 < d0 and a1 < a0
    # Without tensor parallelism there is nothing to hide.
    solo = {"mesh": {"data": 8}}
    assert _both(_plan({"tp_comm_overlap": True}, **solo)) == _both(_plan(**solo))


def test_grad_reduce_overlap_reduces_replicated_buckets_during_the_backward():
    plan, overlapped = _plan(zero=0), _plan({"grad_reduce_overlap": True}, zero=0)
    topology = load_topology(TOPOLOGY)
    ids = place(plan, topology).device_ids
    assert not step_facts(plan, ids).reduce_in_backward and step_facts(overlapped, ids).reduce_in_backward
    assert step_facts(overlapped, ids).chunks[0][0].buckets == min(BUCKETS, 8)
    (d0, a0), (d1, a1) = _both(plan), _both(overlapped)
    assert d1 < d0 and a1 < a0
    # Sharded gradients reduce during the backward already: the field changes nothing there.
    fsdp = {"mesh": {"fsdp": 2, "tensor": 4}}
    assert _both(_plan({"grad_reduce_overlap": True}, **fsdp)) == _both(_plan(**fsdp))


def test_grad_bucket_bytes_sets_the_bucket_count():
    topology = load_topology(TOPOLOGY)
    ids = place(_plan(), topology).device_ids

    def buckets(size: float) -> int:
        return step_facts(_plan({"grad_reduce_overlap": True, "grad_bucket_bytes": size}), ids).chunks[0][0].buckets

    grads = step_facts(_plan(), ids).chunks[0][0].moved[2] * 2  # bf16 gradients of the chunk on a device
    assert buckets(grads * 2) == 1
    assert buckets(grads / 3) == 3
    assert buckets(1.0) == 8  # at most one per layer
    assert buckets(0.0) == BUCKETS


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_profile_prices(profile):
    """Each named profile builds and simulates (both tiers) on a plan with tensor, data and pipeline axes."""
    plan = _plan({"profile": profile}, mesh={"data": 2, "stage": 2, "tensor": 2})
    des, analytic = _both(plan)
    assert des > 0 and analytic > 0


def test_bad_fields_name_the_field():
    from testbed.errors import InputError
    for runtime, field in (({"recompute": "everything"}, "runtime.recompute"),
                           ({"grad_bucket_bytes": -1}, "runtime.grad_bucket_bytes"),
                           ({"tp_comm_overlap": "yes"}, "runtime.tp_comm_overlap"),
                           ({"pipeline_blocking_sends": 1}, "runtime.pipeline_blocking_sends"),
                           ({"grad_all_reduce": "no"}, "runtime.grad_all_reduce"),
                           ({"grad_accumulate_fp32": 1}, "runtime.grad_accumulate_fp32")):
        with pytest.raises(InputError) as err:
            _plan(runtime)
        assert field in str(err.value)


def test_runner_profile_of_a_plan_is_unchanged_by_replace():
    plan = _plan({"profile": "nemo"})
    assert replace(plan, runtime=RuntimeSpec()) == _plan()


@pytest.mark.parametrize("microbatches", [1, 2])
def test_fp32_gradient_reduction_moves_twice_the_bytes(microbatches):
    topology = load_topology(TOPOLOGY)
    batch = {"global_batch": 16, "microbatches": microbatches}
    plan, fp32 = _plan(zero=1, batch=batch), _plan({"grad_reduce_dtype": "fp32"}, zero=1, batch=batch)
    placement = place(plan, topology)

    def reduced(p) -> float:
        return sum(t.nbytes * t.count for t in build_program(p, placement).tasks
                   if t.stream == "grad" and t.op in ("all_reduce", "reduce_scatter"))

    # One microbatch: the norms' gradients reduce in fp32 already (testbed.sim.step.grad_bytes.reduced_bytes), 4 bytes
    # each either way; accumulated over a loop, the replicas are summed after it in the gradients' dtype.
    norms = sum(norm_elements(plan, s, c) for s in range(plan.mesh.stage) for c in range(plan.schedule.virtual_stages))
    fp32_norms = 0 if summed_after_the_loop(plan) else norms
    assert norms > 0 and reduced(fp32) == pytest.approx(2 * reduced(plan) - 4 * fp32_norms, rel=1e-12)
    (d0, a0), (d1, a1) = _both(plan), _both(fp32)
    assert d1 > d0 and a1 > a0


def test_pipeline_scatter_gather_splits_sends_over_the_tensor_ranks():
    """Stages on different nodes: each tensor rank sends 1/t of the activation over the network and the receivers
    all-gather it over NVLink, faster than every rank sending the whole tensor (both tiers)."""
    topology = load_topology("dgx-h100-x4")
    over = {"mesh": {"data": 2, "stage": 2, "tensor": 8}, "batch": {"global_batch": 16, "microbatches": 8},
            "remat": "none", "zero": 1}
    plan, split = _plan(**over), _plan({"pipeline_scatter_gather": True}, **over)
    placement = place(plan, topology)
    whole = [t for t in build_program(plan, placement).tasks if t.stream == "pipe"]
    parts = build_program(split, placement).tasks
    sends = [t for t in parts if t.stream == "pipe"]
    gathers = [t for t in parts if t.stream in ("recv", "recv-grad")]
    assert len(sends) == len(whole) == len(gathers)
    assert all(a.nbytes == pytest.approx(b.nbytes / 8) for a, b in zip(sends, whole))
    assert all(g.op == "all_gather" and g.nbytes == b.nbytes for g, b in zip(gathers, whole))
    des = [simulate(p, topology).report.step_time_s for p in (plan, split)]
    analytic = [estimate(p, topology).step_time_s for p in (plan, split)]
    assert des[1] < des[0] and analytic[1] < analytic[0]
    # With sequence parallelism the sends are split already: nothing changes.
    sp = {**over, "sequence_parallel": True}
    assert build_program(_plan({"pipeline_scatter_gather": True}, **sp), placement).tasks == \
        build_program(_plan(**sp), placement).tasks


def test_pipeline_blocking_sends_hold_the_sender_until_its_send_arrives():
    """Stages on different nodes: with blocking sends a stage's next action waits for its send (task graph), and
    both tiers' steps grow by the sends the stage can no longer hide behind its compute; without stages or
    sends there is nothing to block."""
    topology = load_topology("dgx-h100-x4")
    over = {"mesh": {"data": 2, "stage": 2, "tensor": 8}, "batch": {"global_batch": 16, "microbatches": 8},
            "remat": "none", "zero": 1}
    plan, blocking = _plan(**over), _plan({"pipeline_blocking_sends": True}, **over)
    placement = place(plan, topology)

    def own_sends_waited(p) -> int:  # a sender's compute waiting for its own send
        tasks = build_program(p, placement).tasks
        return sum(1 for t in tasks if t.stream == "compute" for d in t.deps
                   if tasks[d].stream == "pipe" and tasks[d].device == t.device)

    assert own_sends_waited(blocking) > 0 and own_sends_waited(plan) == 0
    des = [simulate(p, topology).report.step_time_s for p in (plan, blocking)]
    analytic = [estimate(p, topology).step_time_s for p in (plan, blocking)]
    assert des[1] > des[0] and analytic[1] > analytic[0]
    flat = {"mesh": {"data": 2, "tensor": 4}}
    assert _both(_plan({"pipeline_blocking_sends": True}, **flat)) == _both(_plan(**flat))


@pytest.mark.parametrize("runtime, field", [({"pipeline_blocking_sends": "yes"}, "runtime.pipeline_blocking_sends"),
                                            ({"tp_comm_overlap": 2}, "runtime.tp_comm_overlap"),
                                            ({"profile": "llama4"}, "runtime.profile")])
def test_a_bad_runtime_value_exits_2_naming_the_field(runtime, field, tmp_path, capsys):
    import yaml

    from testbed.cli.main import main
    spec = {"name": "r", "model": {"layers": 2, "d_model": 32, "heads": 4, "d_ff": 64, "seq_len": 16, "vocab": 128},
            "batch": {"global_batch": 8, "microbatches": 1}, "mesh": {"data": 8}, "runtime": runtime}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(spec))
    code = main(["simulate", "--plan", str(tmp_path / "p.yaml"), "--topology", "host-cpu-8"])
    err = capsys.readouterr().err
    assert code == 2 and field in err and "Traceback" not in err, err


def test_grad_all_reduce_all_reduces_zero1_gradients_over_data():
    """ZeRO-1 with ``grad_all_reduce``: every bucket an all-reduce of the whole gradients over data instead of a
    reduce-scatter (twice the bus bytes), slower in both tiers; sharded gradients (ZeRO-2) are unchanged."""
    topology = load_topology(TOPOLOGY)
    plan, whole = _plan(zero=1), _plan({"grad_all_reduce": True}, zero=1)
    placement = place(plan, topology)

    def reductions(p) -> dict:
        ops: dict = {}
        for t in build_program(p, placement).tasks:
            if t.stream == "grad" and t.op in ("all_reduce", "reduce_scatter"):
                ops[t.op] = ops.get(t.op, 0.0) + t.nbytes * t.count
        return ops

    assert set(reductions(plan)) == {"reduce_scatter"} and set(reductions(whole)) == {"all_reduce"}
    assert reductions(whole)["all_reduce"] == pytest.approx(reductions(plan)["reduce_scatter"])
    (d0, a0), (d1, a1) = _both(plan), _both(whole)
    assert d1 > d0 and a1 > a0
    assert _both(_plan({"grad_all_reduce": True}, zero=2)) == _both(_plan(zero=2))


@pytest.mark.parametrize("microbatches", [1, 2])
def test_grad_accumulate_fp32_casts_and_adds_every_microbatch_in_fp32(microbatches):
    """DeepSpeed's BF16_Optimizer: each microbatch's bf16 gradients are copied to fp32 and added into the fp32
    accumulator (18 bytes a parameter), the first microbatch's too, kernels of their own, where the runner's
    bf16 adds are the backward's own bytes; both tiers slower; a full-precision plan has no compute-dtype gradients to cast."""
    from testbed.sim.step.facts import FP32_ACCUMULATE_BYTES
    topology = load_topology(TOPOLOGY)
    over = {"batch": {"global_batch": 16, "microbatches": microbatches}, "zero": 1}
    plan, fp32 = _plan(**over), _plan({"grad_accumulate_fp32": True}, **over)
    placement = place(plan, topology)

    def adds(p) -> list:
        rep = build_program(p, placement).representatives[0]
        return [t.hbm_bytes for t in build_program(p, placement).tasks
                if t.device == rep and t.name.startswith("accumulate ")]

    params = costs.chunk_cost(plan, 0, 0).params
    assert adds(fp32) == pytest.approx([FP32_ACCUMULATE_BYTES * params] * microbatches)
    assert adds(plan) == []  # the bf16 add is the backward's own (testbed.sim.step.grad_bytes.accumulated_in_the_backward)
    (d0, a0), (d1, a1) = _both(plan), _both(fp32)
    assert d1 > d0 and a1 > a0
    full = {**over, "precision": "fp32"}
    assert _both(_plan({"grad_accumulate_fp32": True}, **full)) == _both(_plan(**full))
    # Memory: BF16_Optimizer's fp32 gradient buffer beside the bf16 gradients (4 more bytes a parameter).
    from testbed.model.memory import memory_breakdown
    grads = [memory_breakdown(p, topology).per_stage[0].grads for p in (plan, fp32)]
    assert grads[1] - grads[0] == 4 * costs.device_stage_params(plan, 0)
