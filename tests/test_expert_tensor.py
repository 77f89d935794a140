"""MoE parallel folding (``mesh.expert_tensor``, Megatron-Core's ``--expert-tensor-parallel-size``) in the core.

The plan key and its field-naming errors, the one decision every reader takes (the degrees a routed expert's
weight is split at: testbed.model.param_spec.ParamSpec.degrees, testbed.plan.sharding.expert_axes), what
folding moves in the cost model (the same routed FLOPs per rank, whole experts, ``1 / tensor`` of the
dispatched tokens and all-to-all bytes), the task graph's all-to-alls and the analytic tier against the DES.
The runner's side (the layer and whole plans against the single-device reference, the folded map's traced
FLOPs) is in tests/test_moe_runner.py.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from testbed.cli.main import main
from testbed.errors import InputError
from testbed.explore.analytic import estimate
from testbed.model import costs, layout, moe
from testbed.model.gemm import chunk_gemms, gemm_flops
from testbed.model.memory import memory_breakdown
from testbed.plan.io import dump_plan, plan_from_dict
from testbed.plan.placement import place
from testbed.plan.presets import preset
from testbed.plan.sharding import expert_axes
from testbed.plan.spec import Axis, BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec
from testbed.sim.graph.engine import simulate
from testbed.sim.graph.program import build_program
from testbed.topology.io import load_topology

MODEL = {"layers": 2, "d_model": 32, "heads": 4, "d_ff": 64, "seq_len": 16, "vocab": 64, "experts": 8, "top_k": 2}


def _plan(mesh: dict, model: dict | None = None, batch: int = 8) -> Plan:
    return plan_from_dict({"model": {**MODEL, **(model or {})}, "batch": {"global_batch": batch}, "mesh": mesh})


def test_the_key_round_trips_and_defaults_to_the_tensor_degree() -> None:
    folded = _plan({"tensor": 2, "expert": 2, "expert_tensor": 1})
    assert folded.mesh.expert_tensor == 1 and folded.mesh.expert_parallel == 4
    assert plan_from_dict(yaml.safe_load(dump_plan(folded))) == folded
    plain = _plan({"tensor": 2, "expert": 2})
    assert plain.mesh.expert_tensor is None and plain.mesh.expert_tensor_degree == 2 and plain.mesh.expert_parallel == 2
    assert "expert_tensor" not in dump_plan(plain)
    assert _plan({"tensor": 2, "expert_tensor": 2}).mesh.expert_parallel == 1  # the default, written out
    assert expert_axes(folded) == (Axis.EXPERT, Axis.TENSOR) and expert_axes(plain) == (Axis.EXPERT,)
    assert expert_axes(_plan({"tensor": 2, "expert_tensor": 1})) == (Axis.TENSOR,)


@pytest.mark.parametrize("mesh, model, field", [
    ({"tensor": 4, "expert_tensor": 2}, {}, "mesh.expert_tensor"),             # neither 1 nor the tensor degree
    ({"tensor": 2, "expert_tensor": 0}, {}, "mesh.expert_tensor"),
    ({"tensor": 2, "expert_tensor": 1}, {"experts": 0}, "mesh.expert_tensor"),  # a dense model
    ({"tensor": 4, "expert": 4, "expert_tensor": 1}, {}, "mesh.expert_tensor"),  # 8 experts over 16 ranks
    ({"tensor": 4, "expert_tensor": 1}, {"expert_d_ff": 6, "shared_experts": 1}, "model.expert_d_ff"),
    ({"tensor": 2, "expert_tensor": True}, {}, "mesh.expert_tensor"),
])
def test_bad_values_name_their_field(mesh: dict, model: dict, field: str) -> None:
    with pytest.raises(InputError) as err:
        _plan(mesh, model)
    assert err.value.field == field


def test_a_bad_plan_file_exits_2(tmp_path: Path, capsys) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({"model": MODEL, "batch": {"global_batch": 8},
                                    "mesh": {"tensor": 4, "expert_tensor": 2}}))
    assert main(["plan", "check", str(path)]) == 2
    assert "mesh.expert_tensor" in capsys.readouterr().err


def test_folded_experts_are_whole_and_odd_widths_allowed() -> None:
    """With folding the experts' width needs no tensor split: an expert width the tensor degree does not divide
    is valid (each expert whole), and the routed weights are split on their experts dim by expert x tensor."""
    plan = _plan({"tensor": 4, "expert_tensor": 1}, {"expert_d_ff": 6})
    w1 = next(p for p in layout.layer_params(plan.model, 0) if p.path == ("moe", "w1"))
    assert w1.degrees(4, 1, 1) == (1, 4) and w1.splits(4, 1, 1) == ((0, 4, ("tensor",)),)
    assert w1.device_elements(4, 1, 1, 1) == 8 * 32 * 6 // 4
    assert w1.splits(4, 2, 1) == ((0, 8, ("expert", "tensor")),) and w1.splits(4, 2, None) == (
        (0, 2, ("expert",)), (2, 4, ("tensor",)))
    wq = next(p for p in layout.layer_params(plan.model, 0) if p.tensor_dim is not None)
    assert wq.degrees(4, 2, 1) == (4, 2)  # a dense parameter keeps the mesh's degrees


@pytest.mark.parametrize("mesh", [dict(tensor=2, expert=2), dict(tensor=4, data=2), dict(tensor=2, expert=2, stage=2)])
@pytest.mark.parametrize("shared", [0, 1])
def test_folding_moves_tokens_not_work(mesh: dict, shared: int) -> None:
    """Against the same mesh with the experts split like the dense MLP: every rank's FLOPs, parameters and
    optimizer state are the same; its routed GEMMs run ``E / (expert x tensor)`` whole experts on the same rows;
    the dispatched tokens, the all-to-all buffers and the MoE activations they make are ``1 / tensor``. (Without
    biases: the experts' output bias ``b2 [E, d]`` has no width to split, so folding divides it by the tensor
    degree too: :func:`test_folding_splits_the_output_bias_further`.)"""
    spec = ModelSpec(**{**MODEL, "layers": 4}, shared_experts=shared, bias=False)
    base = Plan(model=spec, batch=BatchSpec(global_batch=8, microbatches=2), mesh=MeshSpec(**mesh))
    folded = replace(base, mesh=replace(base.mesh, expert_tensor=1))
    t = base.mesh.tensor
    for s in range(base.mesh.stage):
        a, b = costs.chunk_cost(base, s), costs.chunk_cost(folded, s)
        assert (a.forward_flops, a.backward_flops, a.params) == (b.forward_flops, b.backward_flops, b.params)
        assert gemm_flops(chunk_gemms(folded, s).action("F", False)) == pytest.approx(b.forward_flops, rel=1e-12)
        assert costs.device_stage_params(base, s, experts_only=True) == \
            costs.device_stage_params(folded, s, experts_only=True)
    assert moe.expert_tokens(folded) == moe.expert_tokens(base)
    assert moe.dispatch_bytes(folded) * t == moe.dispatch_bytes(base)
    routed = [g for g in chunk_gemms(folded, 0).forward if g.batch > 1 and {g.n, g.k} == {spec.d_ff, spec.d_model}]
    assert routed
    assert {g.batch for g in routed} == {spec.experts // folded.mesh.expert_parallel}
    assert max(g.n for g in routed) == spec.d_ff  # whole experts: the width unsplit
    # The kept dispatched tokens and experts' outputs (2 rows d per layer) shrink by the tensor degree.
    kept = moe.activation_bytes_swap(base, t) - moe.activation_bytes_swap(folded, t)
    assert kept == 2 * (moe.routed_rows(base) - moe.routed_rows(folded)) * spec.d_model * 4 > 0
    host = load_topology("host-cpu-8")
    assert memory_breakdown(folded, host).per_stage[0].params == memory_breakdown(base, host).per_stage[0].params


def test_folding_splits_the_output_bias_further() -> None:
    base = _plan({"tensor": 2, "expert": 2})
    folded = replace(base, mesh=replace(base.mesh, expert_tensor=1))
    e, d, layers = base.model.experts, base.model.d_model, moe.moe_layers(base.model)
    assert costs.chunk_cost(base, 0).params - costs.chunk_cost(folded, 0).params == layers * (e * d // 2 - e * d // 4)


def test_the_task_graph_moves_a_tensor_share_over_the_expert_axis() -> None:
    """The dispatch and combine all-to-alls stay over the expert groups (the tensor ranks take their experts'
    slots from the tokens they hold), ``1 / tensor`` of the unfolded bytes each; with expert 1 folding alone
    needs no all-to-all."""
    host = load_topology("host-cpu-8")
    base = _plan({"tensor": 2, "expert": 2, "data": 2})
    folded = replace(base, mesh=replace(base.mesh, expert_tensor=1))
    a2a = lambda p: [t for t in build_program(p, place(p, host)).tasks if t.op == "all_to_all"]  # noqa: E731
    assert len(a2a(folded)) == len(a2a(base)) > 0
    assert {t.nbytes for t in a2a(folded)} == {moe.dispatch_bytes(base) / 2}
    assert not a2a(_plan({"tensor": 2, "data": 4, "expert_tensor": 1}))


@pytest.mark.parametrize("order", [("stage", "data", "fsdp", "context", "expert", "tensor"),
                                   ("stage", "expert", "fsdp", "context", "data", "tensor")])
def test_analytic_tier_follows_the_simulator_on_folded_plans(order: tuple[str, ...]) -> None:
    """A two-layer Mixtral on four DGX H100s with TP 2 and experts folded over expert x tensor (ETP 1): the
    search's fast tier within 15% of the DES step, and folding faster than splitting every expert over the
    tensor ranks in both tiers (half the all-to-all bytes, the same FLOPs)."""
    topo = load_topology("dgx-h100-x4")
    spec = replace(ModelSpec(**preset("mixtral-8x7b")), layers=2, seq_len=1024)
    base = Plan(model=spec, batch=BatchSpec(global_batch=32), schedule=ScheduleSpec(), precision="bf16-mixed",
                mesh=MeshSpec(data=4, expert=4, tensor=2, order=order), remat="full")
    folded = replace(base, mesh=replace(base.mesh, expert_tensor=1))
    times = {}
    for name, plan in (("base", base), ("folded", folded)):
        fast, des = estimate(plan, topo).step_time_s, simulate(plan, topo).report.step_time_s
        assert abs(fast - des) < 0.15 * des, (name, fast, des)
        times[name] = (fast, des)
    assert times["folded"][0] < times["base"][0] and times["folded"][1] < times["base"][1]
    assert math.isfinite(times["folded"][1])


def test_the_search_space_tries_folding_where_it_is_valid() -> None:
    """An MoE model on 8 devices: with a tensor axis both splits of the experts (folded where the expert and tensor
    ranks divide the experts), without one only the plain; ``fold_experts`` narrows it; dense models unchanged."""
    from testbed.explore.space import SearchSpace, candidates

    spec = ModelSpec(**MODEL, expert_d_ff=6)  # width 6: a tensor degree of 4 can only fold
    base = Plan(model=spec, batch=BatchSpec(global_batch=8), precision="fp32")
    space = SearchSpace(zero=(0,), remat=("none",), microbatches=(1,), schedules=("1f1b",))
    plans = list(candidates(base, 8, space))
    meshes = {(p.mesh.expert, p.mesh.tensor, p.mesh.expert_tensor) for p in plans}
    assert {(1, 2, None), (1, 2, 1), (2, 2, 1), (2, 4, 1), (1, 4, 1)} <= meshes
    assert (2, 4, None) not in meshes and (4, 4, 1) not in meshes  # 6 % 4; 8 experts over 16 ranks
    assert all(p.mesh.expert_tensor is None for p in plans if p.mesh.tensor == 1)
    narrowed = {p.mesh.expert_tensor for p in candidates(base, 8, replace(space, fold_experts=(False,)))}
    assert narrowed == {None}
    dense = replace(base, model=replace(spec, experts=0, expert_d_ff=None))
    assert {p.mesh.expert_tensor for p in candidates(dense, 8, space)} == {None}
    with pytest.raises(InputError) as err:
        SearchSpace(fold_experts=("yes",))
    assert err.value.field == "space.fold_experts"


def test_the_search_command_takes_fold_experts(tmp_path: Path, capsys) -> None:
    """``--fold-experts on`` keeps the folded MoE candidates where the mesh has a tensor axis (and the plain ones
    without one), ``off`` the unfolded ones; a bad value is exit 2 naming the flag."""
    import json

    argv = ["search", "--model", "mixtral-8x7b", "--topology", "dgx-h100-x4", "--schedules", "1f1b",
            "--microbatches", "1", "--remat", "full", "--zero", "1", "--replay", "2", "--json", "--global-batch", "64",
            "--seq", "1024", "--experts", "4"]
    assert main(argv + ["--fold-experts", "on"]) == 0, capsys.readouterr().err
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert ranked and all(r["expert_tensor"] == 1 for r in ranked) and any(r["tensor"] > 1 for r in ranked)
    assert main(argv + ["--fold-experts", "off"]) == 0, capsys.readouterr().err
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert ranked and all(r["expert_tensor"] == r["tensor"] for r in ranked) and any(r["tensor"] > 1 for r in ranked)
    assert main(argv + ["--fold-experts", "maybe"]) == 2
    assert "--fold-experts" in capsys.readouterr().err


def test_folded_experts_that_do_not_divide_say_how_to_write_megatron_s_expert_parallel_size():
    """EP 8 with TP 2 and ETP 1 in Megatron-Core is mesh.expert 4 here (the tensor ranks fold into expert ranks)."""
    import pytest as _pytest

    from testbed.errors import InputError as _InputError
    from testbed.plan.io import plan_from_dict as _plan_from_dict

    spec = {"name": "m", "model": {"layers": 4, "d_model": 2048, "heads": 16, "d_ff": 4096, "seq_len": 4096,
                                   "vocab": 32000, "experts": 8, "top_k": 2},
            "batch": {"global_batch": 32, "microbatches": 1}, "mesh": {"expert": 8, "tensor": 2, "expert_tensor": 1}}
    with _pytest.raises(_InputError, match="write mesh.expert 4"):
        _plan_from_dict(spec, default_name="m")
    assert _plan_from_dict({**spec, "mesh": {"expert": 4, "tensor": 2, "expert_tensor": 1}},
                           default_name="m").mesh.expert_parallel == 8
