"""The data-parallel gradient reduction runs once per step, not once per microbatch (ZeRO 0/1).

The plan and testbed's simulator reduce a stage's gradients after its last
backward. The MPMD pipeline's backward programs keep per-replica gradients
and the stage's update sums them; the SPMD step's microbatch loop does the
same and sums after the loop (testbed.runner.replicas). These tests check the
programs themselves (no gradient all-reduce in any backward or loop body,
one after) for unsplit, split (ZB) and interleaved schedules, fp32 and bf16,
with a tensor axis inside, and that the result still equals the
single-device reference.
"""

from __future__ import annotations

import math

import jax
import pytest

from testbed.runner import devices as dev
from testbed.runner.pipeline import engine
from testbed.runner.train import build_trainer, verify_plan
from testbed.runner.pipeline.memory import abstract_outputs
from testbed.runner.replicas import replicas
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec

MODEL = ModelSpec(layers=4, d_model=16, heads=4, d_ff=32, seq_len=8, vocab=32)


def _plan(data=2, tensor=1, stage=2, schedule="1f1b", virtual=1, zero=0, precision="fp32", fsdp=1) -> Plan:
    # test_runner's global batch: the single-device reference step compiles once for both files.
    return Plan(model=MODEL, batch=BatchSpec(global_batch=48, microbatches=4),
                mesh=MeshSpec(data=data, tensor=tensor, stage=stage, fsdp=fsdp),
                schedule=ScheduleSpec(name=schedule, virtual_stages=virtual), zero=zero, precision=precision,
                name="replicas")


def _count(text: str, op: str) -> int:
    return text.count(f" {op}(") + text.count(f" {op}-start(")


def _forwards(trainer, params):
    """Per model chunk ``g``: ``(g, stage, chunk, activation sharding, compiled forward, its abstract pullback,
    the output cotangent)`` as the engine runs them."""
    sch, last = trainer.schedule, trainer.schedule.chunks - 1
    x = jax.ShapeDtypeStruct(trainer.act_shape[:2], jax.numpy.int32, sharding=trainer.act_shardings[0])
    for g in range(sch.chunks):
        s, c = sch.locate(g)
        sh = trainer.act_shardings[s]
        h = x if g == 0 else jax.ShapeDtypeStruct(trainer.act_shape, trainer.act_dtype, sharding=sh)
        targets = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh) if g == last else None
        forward = engine._forward.lower(trainer.chunk_forward, trainer.loss_fn, trainer.prepare[s], s, c, g == 0,
                                          g == last, params[s][c], h, targets).compile()
        y, stored = abstract_outputs(forward)
        cot = y if g == last else jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=sh)
        yield g, s, c, sh, forward, stored, cot


def _backward_texts(trainer, state) -> list[str]:
    """Compiled text of every chunk's forward and backward program(s) as the engine runs them.

    The last chunk's forward computes the loss: per replica, so no program of
    a microbatch reduces anything over ``data`` (not even the scalar loss).
    """
    params, _ = state
    sch = trainer.schedule
    texts = []
    for g, s, c, _, forward, stored, cot in _forwards(trainer, params):
        texts.append(forward.as_text())
        programs = ([engine._pull_weight] + ([engine._pull_input] if g > 0 else [])
                    if sch.split_backward else [engine._pull])
        texts += [p.lower(trainer.prepare[s], stored, params[s][c], cot).compile().as_text() for p in programs]
    return texts


@pytest.mark.parametrize("kwargs", [
    dict(schedule="zb-h1", precision="bf16-mixed"),
    dict(schedule="interleaved", virtual=2, tensor=2),
    dict(zero=1, data=4),
], ids=["zb-h1-bf16", "interleaved-tp2", "1f1b-zero1"])
def test_backward_programs_leave_the_data_reduction_to_the_update(kwargs: dict) -> None:
    plan = _plan(**kwargs)
    trainer = build_trainer(plan, dev.select_devices(plan.mesh.size))
    assert trainer.replicas == plan.mesh.data > 1
    state = trainer.init()
    shape = tuple(plan.mesh.degree(a) for a in dev.STAGE_MESH_AXES)
    for text in _backward_texts(trainer, state):
        # Tensor-parallel all-reduces stay inside the chunk; none over data. With tensor 1 there are none at all.
        assert _data_reductions(text, shape) == (set(), 0)
        if plan.mesh.tensor == 1:
            assert _count(text, "all-reduce") == 0 and _count(text, "reduce-scatter") == 0
    params, states = state
    for s in range(plan.mesh.stage):
        update = trainer.update_programs[s].lower(params[s], states[s],
                                                  trainer.engine_grads_shape(params[s], s)).compile().as_text()
        assert _count(update, "all-reduce") + _count(update, "reduce-scatter") >= 1
        assert _data_reductions(update, shape)[0] & {"all-reduce", "reduce-scatter"}  # the update's, over data
    if plan.mesh.tensor > 1:  # the others' kinds are among test_runner's plans (6 devices, hypothesis)
        result = verify_plan(plan, dev.select_devices(plan.mesh.size), steps=2, check_hlo=False)
        assert result["ok"], result["errors"]


@pytest.mark.parametrize("kwargs", [dict(data=1, fsdp=2, tensor=2), dict(data=2, tensor=2, precision="bf16-mixed"),
                                    dict(data=2, schedule="zb-h1")], ids=["fsdp2-tp2", "dp2-tp2-bf16", "dp2-zb-h1"])
def test_engine_programs_leave_outputs_where_they_are_taken(kwargs: dict) -> None:
    """Activations leave a stage in the layout the next stage receives, gradients in the update's input
    layout: anything else makes ``jax.device_put`` copy through the host (a blocking round trip per transfer).

    Left to XLA, fsdp 2 x tensor 2 put the forward's output split over d_model and most gradients replicated.
    """
    plan = _plan(**kwargs)
    trainer = build_trainer(plan, dev.select_devices(plan.mesh.size))
    params, _ = trainer.init()
    sch, last = trainer.schedule, trainer.schedule.chunks - 1

    def same(value, want) -> bool:
        return value.sharding.is_equivalent_to(want, len(value.shape))

    for g, s, c, sh, forward, stored, cot in _forwards(trainer, params):
        assert g == last or same(abstract_outputs(forward)[0], sh)  # the output activation
        pull = engine._pull_weight if sch.split_backward else engine._pull
        out = abstract_outputs(pull.lower(trainer.prepare[s], stored, params[s][c], cot).compile())
        grads = out if sch.split_backward else out[0]
        want = jax.tree.leaves(trainer.engine_grad_shardings[s][c])
        assert all(same(a, w) for a, w in zip(jax.tree.leaves(grads), want, strict=True))
        if g > 0:
            dx = (abstract_outputs(engine._pull_input.lower(trainer.prepare[s], stored, params[s][c], cot).compile())
                  if sch.split_backward else out[1])
            assert same(dx, sh)


@pytest.mark.quick  # make test-quick's test of this module
def test_sharded_gradients_reduce_per_microbatch() -> None:
    """ZeRO-2/3 accumulate sharded gradients, so each microbatch's are reduce-scattered as they come."""
    assert replicas(_plan(zero=2)) == 1 and replicas(_plan(zero=3)) == 1
    assert replicas(_plan(data=1)) == 1 and replicas(_plan(data=2, fsdp=2, zero=1)) == 2


def _non_entry_gradient_reductions(text: str, scalars: bool = False) -> int:
    """All-reduces / reduce-scatters of more than a scalar (``scalars``: of anything) outside the entry
    computation (in loop bodies)."""
    count = 0
    for computation in text.split("\n\n"):
        if computation.lstrip().startswith("ENTRY"):
            continue
        for line in computation.splitlines():
            for op in ("all-reduce", "reduce-scatter"):
                if f" {op}(" in line or f" {op}-start(" in line:
                    count += scalars or not line.split("=", 1)[1].strip().startswith("f32[] ")
    return count


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_spmd_accumulation_reduces_once_unless_gradients_are_sharded(zero: int) -> None:
    """The SPMD step's microbatch loop keeps per-replica gradients (ZeRO 0/1); ZeRO-2 reduce-scatters each
    microbatch's in the loop, every leaf (testbed.runner.replicas.Scatter), and all-reduces none of them."""
    plan = Plan(model=MODEL, batch=BatchSpec(global_batch=48, microbatches=2), mesh=MeshSpec(data=4), zero=zero,
                name="accumulate")
    trainer = build_trainer(plan, dev.select_devices(4))
    (text,) = trainer.compiled_texts(trainer.init())
    loop = "\n\n".join(c for c in text.split("\n\n") if not c.lstrip().startswith("ENTRY"))
    leaves = len(jax.tree.leaves(trainer.param_shardings))
    assert (_count(loop, "all-reduce"), _count(loop, "reduce-scatter")) == ((0, leaves) if zero == 2 else (0, 0))
    if zero < 2:  # the loss too is kept per replica in the loop and reduced after it
        assert _non_entry_gradient_reductions(text, scalars=True) == 0
    assert _count(text, "all-reduce") + _count(text, "reduce-scatter") >= 1


def _data_reductions(text: str, shape: tuple[int, ...]) -> tuple[set[str], int]:
    """The kinds of a compiled stage program's collectives over ``data``, and the elements it all-reduces."""
    from testbed.runner import hlo

    kinds, elements = set(), 0
    for line, _, kind, _, axes in hlo._compiled_collectives(text, shape, dev.STAGE_MESH_AXES):
        if "data" in axes.split("+"):
            kinds.add(kind)
            if kind == "all-reduce":
                result = hlo._HLO_RESULT.search(line).group(1)
                elements += sum(math.prod(int(d) for d in dims.split(",") if d)
                                for _, dims in hlo._HLO_ARRAY.findall(result))
    return kinds, elements


def test_pipeline_zero2_reduce_scatters_each_microbatch_and_gathers_no_activations() -> None:
    """ZeRO-2 keeps data-sharded gradients: every backward program reduce-scatters its microbatch's gradients
    over ``data`` (testbed.runner.replicas.Scatter). It all-reduces only the leaves whose gradient layout is not
    split over ``data``, never the whole gradient, and gathers no activations over ``data`` (what XLA made of
    a constrained partial sum); the step equals the single-device reference (bf16, a tensor axis, the split
    backward's W programs)."""
    plan = _plan(zero=2, tensor=2, schedule="zb-h1", precision="bf16-mixed")
    devices = dev.select_devices(plan.mesh.size)
    trainer = build_trainer(plan, devices)
    assert trainer.replicas == 1 and all(p.reduce is not None for p in trainer.prepare)
    params, _ = trainer.init()
    shape = tuple(plan.mesh.degree(a) for a in dev.STAGE_MESH_AXES)
    assert trainer.schedule.split_backward
    for g, s, c, _, _, stored, cot in _forwards(trainer, params):
        layout = trainer.engine_grad_shardings[s][c]
        whole = sum(math.prod(sh.shard_shape(p.shape)) for p, sh in zip(jax.tree.leaves(params[s][c]),
                    jax.tree.leaves(layout)) if "data" not in jax.tree.leaves(tuple(sh.spec)))
        weight = engine._pull_weight.lower(trainer.prepare[s], stored, params[s][c], cot).compile().as_text()
        assert _data_reductions(weight, shape) == ({"reduce-scatter", "all-reduce"} if whole else
                                                   {"reduce-scatter"}, whole)
        if g > 0:
            inputs = engine._pull_input.lower(trainer.prepare[s], stored, params[s][c], cot).compile().as_text()
            assert _data_reductions(inputs, shape) == (set(), 0)
    result = verify_plan(plan, devices, steps=2, check_hlo=False)
    assert result["ok"], result["errors"]
