"""`testbed check-sharding`: the runner's step lowered on abstract devices, its shardings and collectives per axis.

The collectives come from Shardy's partitioning of the lowered program
(testbed.runner.reshards); for a small plan they are compared with the replica
groups of XLA's compiled program on real (emulated) devices.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from dataclasses import replace

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from testbed.runner import reshards
from testbed.runner.check_sharding import abstract_mesh, check_sharding
from testbed.cli import main
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan

MODEL = ModelSpec(layers=1, d_model=32, heads=4, d_ff=64, seq_len=8, vocab=64)


def _plan(microbatches: int = 2, **mesh: int) -> Plan:
    replicas = mesh.get("data", 1) * mesh.get("fsdp", 1)
    return Plan(name="small", model=MODEL, batch=BatchSpec(global_batch=2 * replicas * microbatches,
                                                           microbatches=microbatches), mesh=MeshSpec(**mesh))


@pytest.fixture(scope="module")
def data_tensor():
    """data 2 x tensor 2 (4 devices), two microbatches: the check and the plan."""
    plan = _plan(data=2, tensor=2)
    return plan, check_sharding(plan)


def test_data_tensor_plan_reduces_over_tensor_per_layer_and_over_data_once(data_tensor):
    plan, result = data_tensor
    assert result.ok and result.devices == 4 and [g.name for g in result.programs] == ["train_step"]
    rows = {(r["axes"], r["kind"]): r for r in result.per_axis()}
    assert set(rows) == {("data", "all-reduce"), ("tensor", "all-reduce")}
    # Megatron: an all-reduce after attention and after the MLP in the forward, and their mirrors in the
    # backward, in every layer and microbatch.
    assert rows[("tensor", "all-reduce")]["count"] >= 4 * MODEL.layers * plan.batch.microbatches
    assert rows[("tensor", "all-reduce")]["group"] == 2 and rows[("data", "all-reduce")]["group"] == 2
    # Data: each gradient is reduced once per step (testbed.runner.replicas), not once per microbatch: the bytes
    # are the gradients' shards (fp32 here) plus the step's loss.
    grads = sum(math.prod(p.shard_shape) * 4 for p in result.params)
    assert rows[("data", "all-reduce")]["bytes"] == grads + 4


def test_parameter_specs_are_the_runners_on_a_real_mesh(data_tensor):
    from testbed.runner.step import SpmdTrainer

    plan, result = data_tensor
    devices = np.asarray(jax.devices()[:4]).reshape(1, 2, 1, 2)
    mesh = jax.sharding.Mesh(devices, ("stage", "data", "fsdp", "tensor"))
    trainer = SpmdTrainer(plan, mesh)
    flat = jax.tree_util.tree_flatten_with_path(trainer.param_shardings)[0]
    assert len(flat) == len(result.params)
    for (path, sharding), param in zip(flat, result.params):
        spec = P(*[tuple(e) if isinstance(e, list) else e for e in param.spec])
        assert sharding.spec == spec or tuple(sharding.spec) + (None,) * (len(spec) - len(sharding.spec)) == spec
        assert sharding.shard_shape(param.shape) == param.shard_shape
    wo = next(p for p in result.params if p.path.endswith("attn.wo"))
    assert wo.spec == ["tensor", None] and wo.shard_shape == (MODEL.d_model // 2, MODEL.d_model)


def test_axes_agree_with_xlas_compiled_program():
    """The axes Shardy's partitioning communicates over are those of XLA's compiled step on 4 real devices."""
    from testbed.runner.check_sharding import compiled_spmd

    plan = _plan(microbatches=1, data=2, tensor=2)  # one microbatch: the smallest program to compile
    result = check_sharding(plan)
    mesh, text = compiled_spmd(plan)
    compiled = reshards.compiled_axes(text, mesh.devices.shape, mesh.axis_names)
    assert set(compiled) == {(r["axes"], r["kind"]) for r in result.per_axis()} == {
        ("data", "all-reduce"), ("tensor", "all-reduce")}


def test_sequence_parallel_shard_map_collectives_are_read_on_the_tensor_axis():
    """The explicit all-gathers and reduce-scatters of a shard_map body (Megatron sequence parallelism)."""
    from dataclasses import replace

    result = check_sharding(replace(_plan(microbatches=1, data=2, tensor=2), sequence_parallel=True))
    assert result.ok, result.error
    kinds = {r["kind"]: r for r in result.per_axis() if r["axes"] == "tensor"}
    assert {"all-gather", "reduce-scatter"} <= set(kinds)
    # Before the column-parallel matmuls (qkv, mlp up) of every layer, forward and backward.
    assert kinds["all-gather"]["count"] >= 2 * MODEL.layers and kinds["all-gather"]["group"] == 2


def test_replica_group_forms_map_to_mesh_axes():
    shape, names = (1, 2, 1, 2), ("stage", "data", "fsdp", "tensor")
    lines = {
        "tensor": "%ar = f32[4] all-reduce(%x), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add",
        "data": "%ar = f32[4] all-reduce(%x), channel_id=1, replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add",
        "data+tensor": "%ag = f32[4] all-gather(%x), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}",
    }
    for axes, line in lines.items():
        assert reshards.compiled_axes(line, shape, names) == {(axes, line.split()[3].split("(")[0]): 1}
    mesh_form = ("%ar = f32[4] all-reduce-start(%x), replica_groups=mesh['axis_0'=2,'axis_1'=2], "
                 "device_ids=([2,2]T(1,0)) {'axis_0'}, use_global_device_ids=true")
    # devices [[0,2],[1,3]]: groups along axis_0 are {0,1} and {2,3}, the tensor pairs.
    assert reshards.compiled_axes(mesh_form, shape, names) == {("tensor", "all-reduce"): 1}


def test_abstract_mesh_has_the_plans_axes_and_no_devices():
    mesh = abstract_mesh(_plan(data=64, fsdp=8, tensor=4))
    assert dict(zip(mesh.axis_names, mesh.axis_sizes)) == {"stage": 1, "data": 64, "fsdp": 8, "expert": 1, "context": 1,
                                                           "tensor": 4}
    with pytest.raises(ValueError):
        mesh.devices  # noqa: B018 (abstract: nothing to allocate on)


def test_sharding_error_is_a_failure_with_jaxs_message(monkeypatch, tmp_path, capsys):
    """A layout that splits a dim the axis size does not divide: reported (ok False), not raised."""
    from testbed.runner import parallel

    real = parallel.leaf_spec

    def bad(param, **kwargs):
        spec = real(param, **kwargs)
        # the fused Q/K/V weight [d, 3, width]: fsdp over its dim of 3 (a leaf the one rule shards, not one it
        # holds flat and padded, whose spec the layout replaces by its flat form's)
        return P(None, "fsdp", *spec[2:]) if len(param.shape) == 3 and param.shape[1] == 3 else spec

    monkeypatch.setattr(parallel, "leaf_spec", bad)
    result = check_sharding(_plan(fsdp=2, tensor=2))
    assert not result.ok and "divisible" in result.error and "Traceback" not in result.error, result.error
    plan, topo = _files(tmp_path, PIPELINE.replace("stage: 2", "fsdp: 2"))
    assert main(["check-sharding", "--plan", plan, "--topology", topo]) == 1
    out = capsys.readouterr().out
    assert "sharding error" in out and "divisible" in out and "Traceback" not in out
    assert main(["check-sharding", "--plan", plan, "--topology", topo, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and "divisible" in data["error"]


TOPO = textwrap.dedent("""\
    device: {name: x, flops: {fp32: 1TFLOP/s}, memory: 16GB, memory_bandwidth: 1TB/s}
    levels:
      - {name: node, size: 4, bandwidth: 100GB/s, latency: 1us, kind: nvswitch}
    """)
PIPELINE = textwrap.dedent("""\
    model: {layers: 2, d_model: 32, heads: 4, d_ff: 64, seq_len: 8, vocab: 64}
    batch: {global_batch: 4, microbatches: 2}
    mesh: {tensor: 2, stage: 2}
    schedule: 1f1b
    """)


def _files(tmp_path, plan: str) -> tuple[str, str]:
    (tmp_path / "p.yaml").write_text(plan)
    (tmp_path / "t.yaml").write_text(TOPO)
    return str(tmp_path / "p.yaml"), str(tmp_path / "t.yaml")


def test_cli_json_of_a_pipeline_plan_lists_stage_programs_and_transfers(tmp_path, capsys):
    plan, topo = _files(tmp_path, PIPELINE)
    assert main(["check-sharding", "--plan", plan, "--topology", topo, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["devices"] == 4 and data["topology"] == "t"
    assert [g["name"] for g in data["programs"]] == ["stage0.chunk0.F", "stage0.chunk0.B", "stage0.update",
                                                     "stage1.chunk0.F", "stage1.chunk0.B", "stage1.update"]
    assert {g["runs_per_step"] for g in data["programs"] if not g["name"].endswith("update")} == {2}
    axes = {(r["stages"], r["axes"], r["kind"]) for r in data["per_axis"]}
    assert {("0", "tensor", "all-reduce"), ("1", "tensor", "all-reduce")} <= axes
    assert not any(r["axes"] == "data" for r in data["per_axis"])  # data 1: nothing to reduce
    # 1F1B over 2 stages and 2 microbatches: each microbatch's activation forward, its gradient back.
    assert data["transfers"]["count"] == 4
    assert {p["stage"] for p in data["params"]} == {0, 1}


def test_cli_table_and_bad_inputs(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # the table at 80 columns: every parameter path whole on its line
    plan, topo = _files(tmp_path, PIPELINE.replace("layers: 2", "layers: 1").replace("stage: 2", "stage: 1")
                        .replace("tensor: 2", "tensor: 4"))
    assert main(["check-sharding", "--plan", plan, "--topology", topo]) == 0
    out = capsys.readouterr().out
    assert "collectives per mesh axis" in out and "layers.*.attn.wqkv" in out and "tensor" in out
    assert all(len(line) <= 80 for line in out.splitlines())
    paths = {"embed.tokens", "embed.positions", "layers.*.attn.wqkv", "layers.*.mlp.w1", "head.norm.scale", "head.w"}
    assert all(any(line.split()[:1] == [path] for line in out.splitlines()) for path in paths)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(PIPELINE.replace("stage: 2", "stage: 2, data: 2"))
    assert main(["check-sharding", "--plan", str(wrong), "--topology", topo]) == 2
    err = capsys.readouterr().err
    assert "wrong.yaml" in err and "`mesh`" in err and "Traceback" not in err
    assert main(["check-sharding", "--plan", str(tmp_path / "missing.yaml"), "--topology", topo]) == 2
    assert main(["check-sharding", "--plan", plan]) == 2  # no topology anywhere
    assert "topology" in capsys.readouterr().err


# -- bytes per device: the compiled program's, and a hand count of llama3-405b -----------------------

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _looped_collectives(text: str) -> int:
    """Collectives in the bodies of the compiled program's while loops (each would run once per iteration). A loop
    without one runs no collective more than once: XLA:CPU's IR fusion emitters (tests/conftest.py) expand the
    embedding gradient's scatter into a loop of its own."""
    bodies = set(re.findall(r"\bbody=%?([\w.\-]+)", text))
    count = 0
    for computation in text.split("\n\n"):
        name = computation.lstrip().split(" ", 1)[0].lstrip("%")
        if name in bodies:
            count += sum(computation.count(f" {op}(") + computation.count(f" {op}-start(") for op in _COLLECTIVES)
    return count


def _per_axis_bytes(rows) -> dict[str, int]:
    """Bytes per device of the collectives spanning each mesh axis (one over data+tensor counts on both: XLA may
    reduce over the two axes one after the other)."""
    out: dict[str, int] = {}
    for axes, nbytes in rows:
        for axis in axes.split("+"):
            out[axis] = out.get(axis, 0) + nbytes
    return out


SPMD_KINDS = {
    "data x zero-1": dict(mesh=dict(data=8), zero=1),
    "data x tensor, zero-3": dict(mesh=dict(data=4, tensor=2), zero=3),
    "sequence parallel, data 2": dict(mesh=dict(data=2, tensor=4), sequence_parallel=True),
    "fsdp x data x sequence parallel": dict(mesh=dict(data=2, fsdp=2, tensor=2), sequence_parallel=True),
    # The ring backward re-sends K/V with their dK/dV (testbed.model.ring): stacked, so XLA cannot merge those
    # sends with the forward's (testbed.runner.ring_attention._shift_packed).
    "context x data x tensor": dict(mesh=dict(data=2, context=2, tensor=2)),
    # The expert map is manual over the rows' batch axes too, its router's top-k as well (testbed.runner.moe).
    "expert x data x tensor": dict(mesh=dict(data=2, expert=2, tensor=2), model=replace(MODEL, experts=4)),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(SPMD_KINDS))
def test_bytes_per_device_equal_the_compiled_programs(kind: str) -> None:
    """On 8 emulated devices XLA's compiled step moves, per device and mesh axis, the bytes check-sharding
    reports, less the gathers a checkpoint recomputes (XLA:CPU reuses the forward's gathered sequence)."""
    from testbed.runner.check_sharding import compiled_spmd

    spec = dict(SPMD_KINDS[kind])
    mesh_spec = MeshSpec(**spec.pop("mesh"))
    replicas = mesh_spec.data * mesh_spec.fsdp
    plan = Plan(name="k", model=spec.pop("model", MODEL), mesh=mesh_spec, **spec,
                batch=BatchSpec(global_batch=2 * replicas * mesh_spec.expert, microbatches=1))
    result = check_sharding(plan)
    assert result.ok, result.error
    mesh, text = compiled_spmd(plan)
    assert "while" not in text or _looped_collectives(text) == 0  # one microbatch: every collective runs once
    compiled = _per_axis_bytes((axes, b) for (axes, _), b in reshards.compiled_bytes(
        text, mesh.devices.shape, mesh.axis_names).items())
    reported = _per_axis_bytes((r["axes"], r["bytes"] - r["recomputed_bytes"]) for r in result.per_axis())
    assert reported == compiled
    if plan.sequence_parallel:  # each device gathers its own rows: the operand is one replica's microbatch
        rows = plan.batch.global_batch // replicas
        shapes = {tuple(c.shape) for g in result.programs for c in g.collectives
                  if c.axes == ("tensor",) and c.kind == "reduce-scatter"}
        assert shapes == {(rows, MODEL.seq_len, MODEL.d_model)}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_pipeline_gradient_reductions_run_as_often_as_the_plan_says(zero: int) -> None:
    """Per stage and device, the gradients' reductions over ``data`` move the stage's gradient bytes once per
    microbatch where testbed.plan.sharding.gradient_reduction accumulates them sharded (ZeRO-2/3: reduce-scatters
    in the backward programs), once per step otherwise (the update's); no backward gathers anything over
    ``data`` but ZeRO-3's parameters, again per block. A per-microbatch all-reduce of replicated gradients (or ZeRO-2's whole-gradient all-reduce with
    the activations gathered over ``data``, which XLA made of a constrained partial sum) fails it."""
    from testbed.plan.sharding import gradient_reduction

    m = 2
    plan = Plan(name="pp", model=ModelSpec(layers=2, d_model=32, heads=4, d_ff=64, seq_len=8, vocab=64),
                batch=BatchSpec(global_batch=4 * m, microbatches=m), mesh=MeshSpec(data=2, stage=2), zero=zero)
    result = check_sharding(plan)
    assert result.ok, result.error
    per_microbatch = "data" in gradient_reduction(plan)[0]
    assert per_microbatch == (zero >= 2)
    for stage in range(2):
        grads = sum(math.prod(p.shape) * np.dtype(p.dtype).itemsize for p in result.params if p.stage == stage)
        reduced, backward = 0, set()
        for program in (g for g in result.programs if g.stages == str(stage)):
            for c in (c for c in program.collectives if c.axes == ("data",) and c.shape):
                reduced += c.bytes * c.times * program.runs if c.kind in ("all-reduce", "reduce-scatter") else 0
                backward |= {c.kind} if program.name.endswith(".B") else set()
        assert reduced == (m if per_microbatch else 1) * grads, (stage, reduced, grads)
        # ZeRO-3 shards the parameters over data too: each block's are gathered again in the backward
        # (testbed.plan.sharding.gathers_parameters); no other zero gathers anything there.
        expected = ({"reduce-scatter"} if per_microbatch else set()) | ({"all-gather"} if zero == 3 else set())
        assert backward == expected, (stage, backward)


@pytest.fixture(scope="module")
def llama3_405b():
    from dataclasses import replace

    from testbed.plan.io import load_plan
    from testbed.plan.spec import ScheduleName, ScheduleSpec

    # The bundled plan's mesh, layer shapes and batch under 1F1B, which the hand count below is written for (the
    # plan's interleaved schedule sends each microbatch over 8 chunks a stage: 51 programs to lower instead of 9),
    # with 30 of its 126 layers: balanced-ends still gives the ends one layer fewer (1, 2 x 14, 1), and the count
    # is per layer, so the property is the same with a quarter of the layers to lower.
    bundled = load_plan("llama3-405b")
    plan = replace(bundled, model=replace(bundled.model, layers=30),
                   schedule=ScheduleSpec(name=ScheduleName.ONE_F_ONE_B))
    return plan, check_sharding(plan)


@pytest.mark.slow
def test_llama3_405b_bytes_per_device_agree_with_a_hand_count(llama3_405b) -> None:
    """16,384 devices (tensor 8 x stage 16 x data 128, sequence parallel, ZeRO-2, bf16), the 405B's layers (30 of
    them): per stage and device,
    Megatron SP's gathers and scatters of one replica's microbatch [1, 8192, 16384] over tensor, ZeRO-2's gather
    of the stage's bf16 parameters over data and its gradients' reduce-scatter per microbatch, and the activations between stages, within 1% of a hand count."""
    plan, result = llama3_405b
    assert result.ok, result.error
    m = plan.batch.microbatches
    t, d, s = plan.mesh.tensor, plan.model.d_model, plan.model.seq_len
    rows = plan.batch.global_batch // m // plan.replicas  # one sequence per replica and microbatch
    act = rows * s * d * 2  # bf16: 256 MiB
    layers = plan.stage_layers
    groups = {"0": layers[0], "1..14": layers[1], "15": layers[-1]}
    assert set(layers[1:-1]) == {layers[1]}
    rows_of = {(r["stages"], r["axes"], r["kind"]): r for r in result.per_axis()}
    # Per layer: forward 2 gathers + 2 scatters; backward their transposes (2 scatters + 2 gathers) and
    # Megatron's second gather of each column-parallel input (recomputed). The first stage adds the embedding's
    # scatter and its transposed gather; the last the head's gather (and its recomputation) and scatter.
    for stage, n in groups.items():
        gathers = m * (6 * n + (1 if stage == "0" else 2 if stage == "15" else 0))
        scatters = m * (4 * n + (1 if stage in ("0", "15") else 0))
        for kind, count in (("all-gather", gathers), ("reduce-scatter", scatters)):
            reported = rows_of[(stage, "tensor", kind)]["bytes"]
            assert abs(reported - count * act) <= 0.01 * count * act, (stage, kind, reported, count * act)
    # ZeRO-2: the updated bf16 parameters, sharded over data, gathered once per step (each tensor rank its part).
    heads, kv, ff = plan.model.heads, plan.model.num_kv_heads, plan.model.d_ff
    per_layer = (2 * d * d + 2 * d * (kv * d // heads) + 3 * d * ff) // t * 2 + 2 * d * 2
    # And its bf16 gradients reduce-scattered over data by every microbatch's backward (ZeRO-2 accumulates
    # sharded, testbed.plan.sharding.gradient_reduction); nothing else of the layers' goes over data.
    for stage in ("1..14",):
        for kind, count in (("all-gather", 1), ("reduce-scatter", m)):
            reported = rows_of[(stage, "data", kind)]["bytes"]
            expected = count * groups[stage] * per_layer
            assert abs(reported - expected) <= 0.01 * expected, (stage, kind, reported, expected)
    # 1F1B: each microbatch's activation forward and its gradient back over the 15 stage boundaries.
    sends = rows_of[("all", "stage", "cross-mesh-transfer")]
    assert sends["count"] == 2 * m * (plan.mesh.stage - 1) and sends["bytes"] == sends["count"] * act // t
