"""Runner: the fsdp axis (and ZeRO-3 over data) is FSDP, not a second tensor axis.

The compiled step of a small GPT on the emulated CPU devices: over ``fsdp``
(and over ``data`` at ZeRO 3) the weights are all-gathered for use and their
gradients reduce-scattered, once per sharded leaf, with the bytes of the
leaf's tensor-rank shard, and no activation crosses those axes (the batch
stays split over them), as testbed.sim.graph.program and testbed.model.memory
model FSDP; check-sharding's abstract lowering finds the same axes and kinds.
Without testbed.runner.param_shards.ParamShards XLA's propagation split the weights'
d_model (contracting) dim over fsdp and all-reduced activations there in
every layer.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import jax
import numpy as np
import pytest

from testbed.runner import devices as dev, model, reshards
from testbed.runner.check_sharding import check_sharding
from testbed.runner.step import SpmdTrainer
from testbed.runner.train import verify_plan
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan
from testbed.model import layout

MODEL = ModelSpec(layers=2, d_model=32, heads=4, d_ff=64, seq_len=8, vocab=64)
_SHAPE = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")


def _plan(microbatches: int = 1, zero: int = 0, **mesh: int) -> Plan:
    replicas = mesh.get("data", 1) * mesh.get("fsdp", 1)
    return Plan(name="fsdp", model=MODEL, zero=zero, mesh=MeshSpec(**mesh),
                batch=BatchSpec(global_batch=2 * replicas * microbatches, microbatches=microbatches))


def _compiled(plan: Plan) -> tuple[SpmdTrainer, list[tuple[str, str, int]], list[tuple[str, int]]]:
    """The trainer, its compiled step's collectives but the backward's parameter gathers: (axes, kind, elements
    of the result) per instruction, and those backward gathers: (axes, elements) (testbed.runner.parallel's
    pieces gather their weights again in the backward)."""
    shape = (1, plan.mesh.data, plan.mesh.fsdp, plan.mesh.tensor)
    devices = np.asarray(jax.devices()[:math.prod(shape)]).reshape(shape)
    mesh = jax.sharding.Mesh(devices, ("stage", "data", "fsdp", "tensor"))
    trainer = SpmdTrainer(plan, mesh)
    params = jax.eval_shape(lambda: model.init_params(plan.model, plan.seed))
    held = jax.eval_shape(trainer.optimizer.held, params)

    def sds(tree: object, shardings: object) -> object:
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)

    m = plan.batch.microbatches
    tokens = jax.ShapeDtypeStruct((m, plan.batch.global_batch // m, MODEL.seq_len), np.int32,
                                  sharding=trainer.batch_sharding)
    text = trainer._step.lower(sds(held, trainer.param_shardings),
                               sds(jax.eval_shape(trainer.optimizer.init, params), trainer.opt_shardings),
                               tokens, tokens).compile().as_text()
    found, regathered = [], []
    for line in text.splitlines():
        axes = reshards.compiled_axes(line, shape, mesh.axis_names)
        if not axes:
            continue
        (label, kind), = axes
        result = line.split("=", 1)[1].split(kind)[0]  # the result type(s), before the op name
        elements = sum(math.prod(int(n) for n in dims.split(",") if n) for _, dims in _SHAPE.findall(result))
        if kind == "all-gather" and "transpose(" in line:
            regathered.append((label, elements))
        else:
            found.append((label, kind, elements))
    return trainer, found, regathered


def _leaves(trainer: SpmdTrainer, axes: set[str]) -> tuple[list[int], list[int]]:
    """Elements on one device of the held parameter leaves sharded over ``axes`` once gathered (their tensor
    shard; a padded leaf's flat form, testbed.runner.padding, its padding included), and of the others."""
    params = jax.eval_shape(trainer.optimizer.held, jax.eval_shape(lambda: model.init_params(MODEL, 0)))
    sharded, whole = [], []
    for leaf, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(trainer.param_shardings)):
        names = {a for entry in sharding.spec if entry for a in (entry if isinstance(entry, tuple) else (entry,))}
        shard = math.prod(sharding.shard_shape(leaf.shape))
        if axes <= names:
            sharded.append(shard * math.prod(sharding.mesh.shape[a] for a in axes))
        else:
            whole.append(shard)
    return sharded, whole


def _activation(plan: Plan) -> int:
    """Elements of one device's activations ``[batch rows, seq, d_model]``."""
    rows = plan.batch.global_batch // plan.batch.microbatches // (plan.mesh.data * plan.mesh.fsdp)
    return rows * MODEL.seq_len * MODEL.d_model


@pytest.mark.parametrize("degrees", [dict(data=2, fsdp=2, tensor=2), dict(data=2, fsdp=2, zero=3, microbatches=2)],
                         ids=["data2-fsdp2-tensor2", "data2-fsdp2-zero3"])
def test_fsdp_gathers_weights_and_reduce_scatters_gradients(degrees: dict) -> None:
    plan = _plan(**degrees)
    trainer, found, regathered = _compiled(plan)
    shard_axes = {"fsdp", "data"} if plan.zero == 3 else {"fsdp"}
    label = "+".join(a for a in ("data", "fsdp") if a in shard_axes)
    leaves, whole = _leaves(trainer, shard_axes)
    gathers = sorted(n for axes, kind, n in found if axes == label and kind == "all-gather")
    scatters = [n for axes, kind, n in found if axes == label and kind == "reduce-scatter"]
    # Every sharded leaf is gathered once for its forward with the bytes of its tensor-rank shard (and those the
    # backward reads once more there), and its gradient is reduce-scattered once into the shards. A leaf the one
    # rule pads (no free dim divides: the tensor-split biases here) is held flat and padded (testbed.runner.padding):
    # gathered and reduce-scattered as the padded flat form of its tensor-rank block, nothing gathered after the update.
    ways = math.prod(plan.mesh.degree(a) for a in shard_axes)
    padded = [p.gathered_elements(plan.mesh.tensor, ways) for p, n in layout.chunk_params(MODEL, 0, 0, 1)
              for _ in range(n) if p.padded(plan.mesh.tensor, ways)]
    assert not Counter(padded) - Counter(leaves), (padded, leaves)
    # (Which of a leaf's two gathers XLA names the backward's is its choice where it merged them: the head's.)
    gathers = Counter(gathers + [n for axes, n in regathered if axes == label])
    again = gathers - Counter(leaves)
    assert not Counter(leaves) - gathers, (gathers, sorted(leaves))
    assert again and not again - Counter(leaves), (again, leaves)
    assert sorted(n * ways for n in scatters) == sorted(leaves)
    # No activation crosses the batch axes: what is all-reduced over a group spanning fsdp is the loss and
    # the gradients of the leaves left whole (none here: every leaf is sharded, padded or not).
    over_fsdp = Counter(kind for axes, kind, _ in found if "fsdp" in axes.split("+"))
    assert set(over_fsdp) <= {"all-gather", "reduce-scatter", "all-reduce"}, over_fsdp
    reduced = [n for axes, kind, n in found if "fsdp" in axes.split("+") and kind == "all-reduce"]
    assert sum(reduced) <= sum(whole) + 1 and all(n < _activation(plan) for n in reduced), (reduced, whole)
    if plan.mesh.tensor > 1:  # Megatron's all-reduces carry the device's own batch rows (the whole batch: 2x)
        tensor = [n for axes, kind, n in found if axes == "tensor" and kind == "all-reduce"]
        assert _activation(plan) in tensor and max(tensor) < 2 * _activation(plan), tensor
    # check-sharding (Shardy's partitioning on abstract devices) finds the same axes and kinds as XLA compiled.
    checked = check_sharding(plan)
    assert checked.ok, checked.error
    assert {(r["axes"], r["kind"]) for r in checked.per_axis()} == {(axes, kind) for axes, kind, _ in found}


def test_fsdp_spread_replicas_sequence_parallel_bf16_plan_matches_reference() -> None:
    """Data replicas kept apart (2 microbatches, ZeRO 0), Megatron SP nested in the FSDP maps, bf16 shards.

    test_runner's model: on this file's (d_model 32, 2 layers) bf16-mixed parameters drift 1.6-1.7 optimizer
    steps from the reference after 2 steps with or without ParamShards, past verify's 1.5.
    """
    spec = ModelSpec(layers=4, d_model=16, heads=4, d_ff=32, seq_len=8, vocab=32)
    plan = Plan(name="fsdp", model=spec, batch=BatchSpec(global_batch=48, microbatches=2),
                mesh=MeshSpec(data=2, fsdp=2, tensor=2), sequence_parallel=True, precision="bf16-mixed")
    result = verify_plan(plan, dev.select_devices(8), steps=2, check_hlo=True)
    assert result.ok, (result.errors, result.thresholds, result.collectives)


def test_compiled_collectives_are_the_rule_count() -> None:
    """The simulator's count of a chunk's parameter collectives (testbed.model.leaves.parameter_collectives
    at combine_bytes 0, the host's: XLA:CPU combines none) is what the compiled step runs: one all-gather per
    sharded leaf and one reduce-scatter of its gradient. The rule shards every leaf (padded where no free dim
    divides: the tensor-split biases here), and so does the runner (testbed.runner.padding: a padded leaf held
    flat, its flat shards gathered and its gradient reduce-scattered like any other; runner_whole_params names
    none)."""
    from testbed.model.leaves import gathered_leaves, parameter_collectives, regathered_in_backward, runner_whole_params

    plan = _plan(fsdp=2, tensor=2)
    _, found, regathered = _compiled(plan)
    kinds = Counter(kind for axes, kind, _ in found if axes == "fsdp")
    rule = parameter_collectives(plan, 0, 0, combine_bytes=0)
    assert rule == len(gathered_leaves(plan, 0, 0))
    assert runner_whole_params(plan) == {}
    padded = sum(n for p, n in layout.chunk_params(MODEL, 0, 0, 1, tied_copy=False) if p.padded(plan.mesh.tensor, 2))
    assert padded > 0  # some leaves are padded at tensor 2: the runner's count includes them
    assert kinds["reduce-scatter"] == rule, (kinds, rule)
    # The backward gathers again the leaves it reads (weights and norm scales, not biases).
    again = kinds["all-gather"] + len([n for axes, n in regathered if axes == "fsdp"]) - rule
    reread = sum(n for p, n in layout.chunk_params(MODEL, 0, 0, 1, tied_copy=False)
                 if p.part is not layout.Part.EMBEDDING and regathered_in_backward(p))
    assert again == reread, (kinds, rule, again)  # the rule plan-driven simulation counts


def test_compiled_zero1_regathers_are_the_rule_count() -> None:
    """ZeRO-1's all-gather of the updated parameters over data after the optimizer (XLA's partitioner) is one
    collective per leaf sharded with the optimizer state on XLA:CPU, the rule's count at combine_bytes 0."""
    from testbed.model.leaves import parameter_collectives

    plan = _plan(data=2, zero=1)
    _, found, _ = _compiled(plan)
    gathers = sum(1 for axes, kind, _ in found if axes == "data" and kind == "all-gather")
    assert gathers == parameter_collectives(plan, 0, None, combine_bytes=0, which="optimizer") > 1


def test_compiled_gradient_all_reduces_are_combined_into_one() -> None:
    """The runner sums the replicated gradient tree leaf by leaf (``testbed check-sharding``, which reads the
    partitioned program before XLA's passes, counts 2 + 12 x layers + 3 all-reduces), but XLA:CPU's all-reduce
    combiner merges them: the compiled step runs one all-reduce over data, as the task graph prices one
    reduction per bucket (its gathers and reduce-scatters, which no pass merges, are counted leaf by leaf)."""
    from testbed.plan.placement import place
    from testbed.sim.graph.program import build_program

    for plan in (_plan(data=2), _plan(data=2, tensor=2), _plan(data=2, zero=1)):
        _, found, _ = _compiled(plan)
        reduces = [elements for axes, kind, elements in found if axes == "data" and kind == "all-reduce"]
        assert len(reduces) == 1, (plan.mesh, plan.zero, reduces)
        program = build_program(plan, place(plan, num_devices=plan.mesh.size), combine_bytes=0.0)
        rep = program.representatives[0]
        tasks = [t for t in program.tasks if t.device == rep and t.op in ("all_reduce", "reduce_scatter")
                 and t.stream == "grad"]
        assert tasks and all(t.count == 1 for t in tasks), [(t.name, t.count) for t in tasks]
