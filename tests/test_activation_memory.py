"""Activation memory per layer against Korthikanti et al. (2022), and Megatron sequence parallelism (SP).

Source of the formulas: V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (MLSys 2023, arXiv:2205.05198), Table 2: bytes per layer with 16-bit activations and 1-byte
dropout masks, for ``s`` sequence, ``b`` microbatch, ``h`` hidden, ``a`` heads, ``t`` tensor degree.
Shapes: the paper's Table 3 models (22B, 175B (GPT-3), 530B, 1T; seq 2048, ``t`` 8).

testbed's memory model counts what XLA keeps for the runner; of that, Megatron's kernels do not keep
XLA's head-major copies of Q and K (``costs.xla_only_bytes_per_layer``), so the table is compared with
``costs.megatron_activation_bytes_per_layer`` (the model less those copies), never with fudge factors.
Then: SP never increases activation memory and splits a layer's activations ``1/t`` per rank; the
simulator's tensor all-reduces become all-gathers + reduce-scatters of equal bytes; the runner's SP steps
equal the single-device reference and its compiled programs reduce-scatter instead of all-reducing.
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings, strategies as st

from testbed.collectives.ops import BUS_FACTOR, parse_op
from testbed.collectives.timing import groups_time
from testbed.errors import InputError
from testbed.explore.analytic import estimate
from testbed.model import costs
from testbed.model.costs import chunk_cost
from testbed.model.memory import memory_breakdown
from testbed.plan.io import plan_from_dict, plan_to_dict
from testbed.plan.placement import place
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, Remat
from testbed.sim.step.facts import step_facts
from testbed.sim.graph.program import build_program
from testbed.topology.io import load_topology, topology_from_dict, topology_to_dict

KORTHIKANTI = "Korthikanti et al. 2022, arXiv:2205.05198, Table 2"

#: Table 3 of the paper: (name, heads a, hidden h); all with seq 2048 and tensor 8.
MODELS = [("22B", 64, 6144), ("175B", 96, 12288), ("530B", 128, 20480), ("1T", 160, 25600)]
SEQ, TENSOR, MICRO = 2048, 8, 1

#: Table 2 rows: (case, tensor parallel, sequence parallel, remat, bytes per layer / (s b h)).
CASES = [
    ("no parallelism", False, False, "none", lambda a, s, h, t: 34 + 5 * a * s / h),
    ("tensor", True, False, "none", lambda a, s, h, t: 10 + 24 / t + 5 * a * s / (h * t)),
    ("tensor + sequence", True, True, "none", lambda a, s, h, t: (34 + 5 * a * s / h) / t),
    ("tensor + selective", True, False, "selective", lambda a, s, h, t: 10 + 24 / t),
    ("tensor + sequence + selective", True, True, "selective", lambda a, s, h, t: 34 / t),
    ("full recompute", False, False, "full", lambda a, s, h, t: 2),
    ("tensor + full recompute", True, False, "full", lambda a, s, h, t: 2),
]


def _gpt(heads: int, hidden: int, **kw) -> ModelSpec:
    """A GPT-3-style layer as the paper counts it: MHA, LayerNorm, GELU MLP 4h, biases, dropout."""
    return ModelSpec(**{"layers": 1, "d_model": hidden, "heads": heads, "d_ff": 4 * hidden, "seq_len": SEQ,
                        "vocab": 51200, "dropout": 0.1, **kw})


@pytest.mark.parametrize("name,heads,hidden", MODELS)
@pytest.mark.parametrize("case,tp,sp,remat,formula", CASES, ids=[c[0] for c in CASES])
def test_korthikanti_table_within_two_percent(name, heads, hidden, case, tp, sp, remat, formula) -> None:
    spec, t = _gpt(heads, hidden), TENSOR if tp else 1
    predicted = costs.megatron_activation_bytes_per_layer(spec, MICRO, "bf16-mixed", remat, t, sp)
    published = SEQ * MICRO * hidden * formula(heads, SEQ, hidden, t)
    assert abs(predicted / published - 1) <= 0.02, (KORTHIKANTI, name, case, predicted, published)
    # What the memory model adds for XLA is only the head-major Q and K copies, kept without remat.
    extra = costs.activation_bytes_per_layer(spec, MICRO, "bf16-mixed", remat, t, sp) - predicted
    assert extra == (2 * 2 * SEQ * MICRO * hidden // t if remat == "none" else 0)


def test_dropout_adds_the_papers_mask_terms() -> None:
    """Dropout adds Table 2's terms: two 1-byte residual masks (``2 s b h``), the attention's 1-byte mask and
    its 16-bit dropped probabilities (``3 a s^2 b``)."""
    heads, hidden = 96, 12288
    wet = costs.megatron_activation_bytes_per_layer(_gpt(heads, hidden), MICRO, "bf16-mixed", "none")
    dry = costs.megatron_activation_bytes_per_layer(_gpt(heads, hidden, dropout=0.0), MICRO, "bf16-mixed", "none")
    n = SEQ * MICRO
    assert wet - dry == 2 * n * hidden + 3 * heads * SEQ * n


@st.composite
def _specs(draw) -> tuple[ModelSpec, int, int]:
    """A small model whose K/V heads the tensor degree splits, a tensor degree, a microbatch."""
    t = draw(st.sampled_from([2, 4, 8]))
    heads = t * draw(st.sampled_from([1, 2]))
    kv = draw(st.sampled_from([k for k in (heads, heads // 2) if k % t == 0] or [heads]))
    spec = ModelSpec(layers=2, d_model=heads * 2 * draw(st.integers(1, 4)), heads=heads, kv_heads=kv,
                     d_ff=t * draw(st.integers(1, 8)), seq_len=t * draw(st.integers(1, 4)), vocab=64,
                     mlp=draw(st.sampled_from(["gelu", "swiglu"])), norm=draw(st.sampled_from(["layernorm", "rmsnorm"])),
                     dropout=draw(st.sampled_from([0.0, 0.1])), attention=draw(st.sampled_from(["plain", "flash"])))
    return spec, t, draw(st.integers(1, 3))


@given(_specs(), st.sampled_from(list(Remat)), st.sampled_from(["fp32", "bf16-mixed"]))
def test_sequence_parallel_splits_every_activation(drawn, remat, precision) -> None:
    """SP never increases a layer's activations, and with SP the ranks together hold exactly one device's."""
    spec, t, micro = drawn
    plain = costs.activation_bytes_per_layer(spec, micro, precision, remat, t)
    split = costs.activation_bytes_per_layer(spec, micro, precision, remat, t, sequence_parallel=True)
    one = costs.activation_bytes_per_layer(spec, micro, precision, remat, 1)
    assert split <= plain and split * t == one
    replicated, _ = costs.layer_traffic_bytes(spec, micro, precision, t)
    assert costs.layer_traffic_bytes(spec, micro, precision, t, True)[0] * t == replicated


def _plan(sp: bool = True, **kw) -> Plan:
    mesh = MeshSpec(**{k: kw.pop(k) for k in ("data", "fsdp", "tensor", "stage") if k in kw})
    spec = ModelSpec(**{"layers": 4, "d_model": 32, "heads": 4, "d_ff": 64, "seq_len": 16, "vocab": 64,
                        **kw.pop("model", {})})
    batch = BatchSpec(global_batch=kw.pop("batch", 8), microbatches=kw.pop("mb", 1))
    return Plan(model=spec, batch=batch, mesh=mesh, sequence_parallel=sp, **kw)


def test_plan_key_and_errors() -> None:
    plan = _plan(tensor=2)
    assert plan_from_dict(plan_to_dict(plan)) == plan and plan_to_dict(plan)["sequence_parallel"] is True
    with pytest.raises(InputError) as one:
        _plan(tensor=1)
    assert one.value.field == "sequence_parallel" and "mesh.tensor" in one.value.message
    with pytest.raises(InputError) as seq:
        _plan(tensor=4, model={"seq_len": 6})
    assert seq.value.field == "model.seq_len"
    with pytest.raises(InputError) as kind:
        plan_from_dict({**plan_to_dict(plan), "sequence_parallel": "yes"})
    assert kind.value.field == "sequence_parallel"


def test_memory_with_sequence_parallelism() -> None:
    host = load_topology("host-cpu-8")
    for kw in ({"tensor": 4}, {"tensor": 2, "stage": 2, "mb": 4}, {"tensor": 2, "data": 2, "remat": "full"}):
        on, off = (memory_breakdown(_plan(sp, **dict(kw)), host) for sp in (True, False))
        assert on.activations < off.activations and on.total < off.total


def _tensor_tasks(plan: Plan) -> list:
    program = build_program(plan, place(plan, num_devices=plan.mesh.size))
    return [t for t in program.tasks if t.stream == "tensor"]


def _bus_bytes(tasks: list, n: int) -> float:
    return sum(t.count * t.nbytes * BUS_FACTOR[parse_op(t.op)](n) for t in tasks)


@pytest.mark.parametrize("kw", [{"tensor": 4}, {"tensor": 2, "remat": "selective", "mb": 2},
                                {"tensor": 2, "stage": 2, "mb": 2}])
def test_simulator_replaces_all_reduces_with_gathers_and_scatters(kw) -> None:
    """SP's gathers and scatters replace the all-reduces of the [tokens, d_model] activations, moving the same bus
    bytes; the vocab-parallel loss's small all-reduces are the same either way, and SP adds the learned position
    table's gradient gather (testbed.sim.step.action_work.tensor_transfers)."""
    plans = _plan(False, **dict(kw)), _plan(True, **dict(kw))
    buffer = chunk_cost(plans[0], 0).tensor_allreduce_bytes
    (plain, plain_rest), (sp, sp_rest) = ([[t for t in tasks if (t.nbytes == buffer) == keep] for keep in (True, False)]
                                          for tasks in map(_tensor_tasks, plans))
    position = chunk_cost(plans[1], 0).position_gather_bytes
    assert sorted((t.op, t.nbytes) for t in sp_rest if t.nbytes != position) == sorted(
        (t.op, t.nbytes) for t in plain_rest) and all(t.op == "all_reduce" for t in plain_rest)
    assert {t.op for t in plain} == {"all_reduce"} and {t.op for t in sp} == {"all_gather", "reduce_scatter"}
    gathers = sum(t.count for t in sp if t.op == "all_gather")
    assert gathers == sum(t.count for t in sp if t.op == "reduce_scatter") == sum(t.count for t in plain)
    assert {t.nbytes for t in sp} == {t.nbytes for t in plain}  # each over one [tokens, d_model] buffer
    t = kw["tensor"]
    assert math.isclose(_bus_bytes(sp, t), _bus_bytes(plain, t), rel_tol=1e-12)


def test_full_remat_redoes_two_gathers_and_a_scatter_per_layer() -> None:
    plan = _plan(tensor=2, remat="full")
    sp = _tensor_tasks(plan)
    per_op = {op: sum(t.count for t in sp if t.op == op) for op in ("all_gather", "reduce_scatter")}
    layers = plan.model.layers
    # Forward 2L + head, backward 2L + embedding, recompute 2L gathers, and the learned position table's gradient
    # gathered (testbed.sim.step.action_work.tensor_transfers); scatters 2L + 1 twice, plus L.
    assert plan.model.position.value == "learned"
    assert per_op == {"all_gather": 6 * layers + 3, "reduce_scatter": 5 * layers + 2}


def test_analytic_tier_prices_the_same_collectives() -> None:
    """On the host's ring collectives a reduce-scatter + an all-gather cost what the all-reduce does; SP saves
    activation memory (and elementwise traffic on the residual stream). Without the host's stragglers: SP's
    devices meet twice as often, and each meeting waits for the last of them (tests/test_barriers.py). RoPE: no
    learned position table, whose gradient SP gathers (an extra collective, tests above). SP adds one
    collective: the tensor-replicated parameters' gradients (norms, row-parallel biases), partial sums over the
    sequence shards, all-reduced over tensor (testbed.sim.step.grad_bytes.sequence_reduced)."""
    data = topology_to_dict(load_topology("host-cpu-8"))
    data["calibration"]["host"].pop("skew_s")
    host = topology_from_dict(data)
    plans = [_plan(on, tensor=8, batch=8, model={"d_model": 256, "heads": 8, "d_ff": 1024, "seq_len": 256,
                                                 "position": "rope"}) for on in (False, True)]
    plain, sp = (estimate(plan, host) for plan in plans)
    replicated = sum(c.sequence_bytes for c in step_facts(plans[1], place(plans[1], host).device_ids).chunks[0])
    assert replicated > 0 and step_facts(plans[0], place(plans[0], host).device_ids).reductions == ()
    extra = groups_time(host, "all_reduce", [tuple(range(8))], replicated).time_s
    assert math.isclose(sp.comm_s, plain.comm_s + extra, rel_tol=1e-9) and plain.comm_s > 0
    assert sp.memory_bytes < plain.memory_bytes and sp.compute_s < plain.compute_s


# -- the runner (jax, emulated devices) ---------------------------------------------------------------

def _activation_all_reduces(texts: list[str], shape: tuple[int, ...]) -> int:
    """All-reduce instructions over a whole ``[batch, seq, d_model]`` activation."""
    want = ",".join(map(str, shape))
    return sum(1 for text in texts for line in text.splitlines()
               if re.search(r"=\s*\w+\[" + want + r"\][^=]*\ball-reduce(-start)?\(", line))


TINY = {"layers": 2, "d_model": 16, "d_ff": 32, "seq_len": 8, "vocab": 40}


def test_runner_pipeline_with_sequence_parallelism_matches_reference() -> None:
    """8 devices (stage 2 x data 2 x tensor 2), Llama options with one K/V head (whole on each tensor rank),
    full remat: the MPMD engine passes sequence shards between stages; 1e-5 of the single-device fp32 run.
    (2 and 4 devices with drawn options: tests/test_llm.py's option mix.)"""
    from testbed.runner import devices as dev
    from testbed.runner.train import verify_plan

    plan = _plan(True, tensor=2, data=2, stage=2, mb=2, remat="full",
                 model={**TINY, "kv_heads": 1, "mlp": "swiglu", "norm": "rmsnorm", "position": "rope", "bias": False})
    result = verify_plan(plan, dev.select_devices(plan.mesh.size), steps=2, check_hlo=True)
    errors = result["errors"]
    assert max(errors["loss_rel"]) <= 1e-5 and max(errors["grad_rel"]) <= 1e-5 and result["ok"], errors
    assert result["collectives"]["found"]["reduce-scatter"] > 0 and not result["collectives"]["missing"]


def test_runner_reduce_scatters_instead_of_all_reducing() -> None:
    """On the tensor axis alone every all-reduce is over tensor: with SP none is over a whole activation (only
    the vocab-parallel loss's per-token sums remain), and the plain plan's are (so the check can fail)."""
    from testbed.runner import devices as dev
    from testbed.runner.hlo import count_collectives
    from testbed.runner.train import build_trainer

    texts = {}
    for sp in (False, True):
        trainer = build_trainer(_plan(sp, tensor=2, model=TINY), dev.select_devices(2))
        texts[sp] = trainer.compiled_texts(trainer.init())
    shape = (8, TINY["seq_len"], TINY["d_model"])  # [batch, seq, d_model]: the batch is not split
    assert _activation_all_reduces(texts[False], shape) > 0 and _activation_all_reduces(texts[True], shape) == 0
    found = count_collectives(texts[True])
    layers = TINY["layers"]
    # Forward: a reduce-scatter after the embedding and each row-parallel matmul, an all-gather before each
    # column-parallel one and the head; the backward transposes them. (XLA does not gather again in the
    # backward: it keeps the gathered norm outputs. The learned position table's gradient, computed per
    # sequence shard, is all-gathered once more.)
    assert found["reduce-scatter"] == 2 * (2 * layers + 1) and found["all-gather"] == found["reduce-scatter"] + 1


def test_runner_sp_in_16_bit_runs_on_cpu_with_data_replicas() -> None:
    """SP's maps are manual over the batch axes: XLA:CPU runs their 16-bit reduce-scatters with data replicas
    (with the batch axes automatic it aborted the process, and the runner refused the plan)."""
    import numpy as np

    from testbed.runner import devices as dev
    from testbed.runner.train import run_plan

    for data in (1, 2):
        plan = _plan(True, tensor=2, data=data, precision="bf16-mixed")
        assert np.isfinite(run_plan(plan, dev.select_devices(2 * data), steps=1).loss)
