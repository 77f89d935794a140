"""The live-range estimate of a traced program's memory (testbed.runner.program.memory): which values it keeps."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from testbed.runner.program import abstract_mesh, trace

sd = jax.ShapeDtypeStruct
N, D = 64, 128
ARRAY = N * D * 4  # one n x d fp32 activation


def _total(fn, *shapes) -> float:
    return trace(fn, *(sd(s, jnp.float32) for s in shapes), mesh={"data": 1}).memory["total"]


def _args(*shapes) -> int:
    return sum(4 * a * b for a, b in shapes)


def _across(activation):
    """``activation(x)`` is computed first and read only after two matmuls (as a forward's GELU by its backward)."""
    def fn(x, w1, w2):
        t = activation(x)
        return (x @ w1) @ w2 + t
    return fn


def test_an_expensive_result_read_across_a_matmul_stays_and_a_cheap_one_is_recomputed() -> None:
    """tanh(x) is kept from where it is computed to the add after the matmuls (XLA does not duplicate an expensive
    producer into a later kernel); x * 2 is recomputed from x by the add, never in memory."""
    shapes = ((N, D), (D, D), (D, D))
    expensive, cheap = _total(_across(jnp.tanh), *shapes), _total(_across(lambda x: x * 2), *shapes)
    # at the second matmul: x @ w1 and its result live, and tanh(x) too where it is kept
    assert cheap == _args(*shapes) + 2 * ARRAY
    assert expensive == cheap + ARRAY


def test_a_value_a_matmul_reads_through_a_reshape_is_in_memory() -> None:
    def fn(x, w):
        return jnp.tanh(x).reshape(N // 2, 2 * D) @ w

    shapes = ((N, D), (2 * D, D))
    assert _total(fn, *shapes) == _args(*shapes) + ARRAY + (N // 2) * D * 4


def test_a_shard_map_body_is_counted_as_the_same_program_unwrapped() -> None:
    """XLA's partitioner leaves no region: the body's values and results are the program's own, counted once."""
    def body(x, w1, w2):
        return jnp.tanh(jnp.tanh(x @ w1) @ w2)

    mesh = abstract_mesh({"data": 1})
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(),) * 3, out_specs=P())
    shapes = ((N, D), (D, D), (D, D))
    assert _total(mapped, *shapes) == _total(body, *shapes)


def _psums(combine: bool):
    """Three weight-gradient-like products, each summed over ``data``; with ``combine`` the three psums are
    independent (XLA's combiner merges them into one), without it each next product reads the previous sum."""
    def body(x, w):
        outs, y = [], x
        for _ in range(3):
            g = jax.lax.psum(jnp.tanh(y.T @ y), "data")
            outs.append(g)
            y = x if combine else y + g[:1]
        return outs[0] + outs[1] + outs[2] + w

    return body


def test_all_reduces_xla_combines_keep_their_operands_and_results_live_together() -> None:
    """Independent all-reduces of one key run as one merged all-reduce (xla/service/collective_combiner_utils.h):
    the three D x D products stay live until it runs, then the three sums are written at once (XLA:CPU's compiled
    ppermute pipeline: one tuple all-reduce of 14 weight gradients). Chained ones run one by one."""
    mesh = abstract_mesh({"data": 2})
    totals = {}
    for combine in (True, False):
        fn = jax.shard_map(_psums(combine), mesh=mesh, in_specs=(P(), P()), out_specs=P())
        totals[combine] = trace(fn, sd((N, D), jnp.float32), sd((D, D), jnp.float32), mesh=mesh).memory["total"]
    square = D * D * 4
    assert totals[True] - totals[False] >= 2 * square


def test_a_collective_over_one_device_is_its_operand() -> None:
    """XLA removes a collective whose group is one device (AllReduceSimplifier; the pipeline's 16 all-reduces and 6
    collective-permutes on a one-device mesh are gone from XLA:TPU's compile): the merged all-reduce of three
    products over ``data`` of size 1 holds no results of its own, as the same body without the psums; on two
    devices it does (the test above)."""
    def plain(x, w):
        outs = [jnp.tanh(x.T @ x) for _ in range(3)]
        return outs[0] + outs[1] + outs[2] + w

    mesh = abstract_mesh({"data": 1})
    shapes = (sd((N, D), jnp.float32), sd((D, D), jnp.float32))
    alone = jax.shard_map(_psums(combine=True), mesh=mesh, in_specs=(P(), P()), out_specs=P())
    unsummed = jax.shard_map(plain, mesh=mesh, in_specs=(P(), P()), out_specs=P())
    assert trace(alone, *shapes, mesh=mesh).memory["total"] == trace(unsummed, *shapes, mesh=mesh).memory["total"]


def test_xla_cpu_holds_an_f32_copy_of_each_bf16_matmul_operand() -> None:
    """XLA:CPU computes a bf16 dot in f32 between converts (``device.bf16_matmuls: fp32``): each operand's f32 copy
    is in memory while the dot runs (a ViT's compiled step: 60 ``wrapped_convert`` fusions, its memory analysis
    within 0.1% of the estimate with them). The host's report counts them, a GPU's does not, fp32 programs alike."""
    from testbed.sim.graph.traced import device_memory
    from testbed.topology.io import load_topology

    def fn(x, w):
        return x @ w

    host, gpu = load_topology("host-cpu-8", devices=1), load_topology("dgx-h100", devices=1)
    half = trace(fn, sd((N, D), jnp.bfloat16), sd((D, D), jnp.bfloat16), mesh={"data": 1})
    args = 2 * (N * D + D * D)
    assert half.memory["total"] == args + 2 * N * D
    assert device_memory(half, gpu)["total"] == half.memory["total"]
    assert device_memory(half, host)["total"] == half.memory["total"] + 2 * args  # f32: twice the bf16 operands
    full = trace(fn, sd((N, D), jnp.float32), sd((D, D), jnp.float32), mesh={"data": 1})
    assert device_memory(full, host)["total"] == full.memory["total"]


def _on_chip(fn, *shapes) -> tuple[float, float]:
    """(the estimate as XLA:TPU's fusion keeps it, on ``tpu-v5e-1``; as it is, XLA:CPU's buffers)."""
    from testbed.sim.graph.traced import device_memory
    from testbed.topology.io import load_topology

    workload = trace(fn, *(sd(s, jnp.float32) for s in shapes), mesh={"data": 1})
    return device_memory(workload, load_topology("tpu-v5e-1"))["total"], workload.memory["total"]


def test_xla_tpu_keeps_no_matmul_result_that_only_its_fused_consumers_read() -> None:
    """XLA:TPU fuses ``relu`` into a matmul's kernel (testbed.sim.xla.matmul_fusion): of an MLP's n x 4d hidden
    values only the product is in HBM, read by the second matmul through the ReLU (the chip's cnn step: one buffer
    per activation, none for a convolution's result beside its ReLU), where XLA:CPU holds the product and its ReLU
    both; ``jax.nn.relu``'s call is inlined as XLA's CallInliner does."""
    shapes = ((N, D), (D, 4 * D), (4 * D, D))
    mlp = lambda x, w1, w2: jnp.maximum(x @ w1, 0.0) @ w2  # noqa: E731
    workload = trace(mlp, *(sd(s, jnp.float32) for s in shapes), mesh={"data": 1})
    chip, unfused = _on_chip(mlp, *shapes)
    assert unfused == _args(*shapes) + 9 * ARRAY  # product and ReLU at the ReLU, and the output
    assert workload.memory["total_fused_matmuls"] == _args(*shapes) + 5 * ARRAY  # product at the 2nd matmul, output
    # tpu-v5e-1 also rounds the fp32 matmul's inputs (fp32_matmuls: bf16): the ReLU's bf16 copy, not the product
    assert chip == _args(*shapes) + 3 * ARRAY
    assert _on_chip(lambda x, w1, w2: jax.nn.relu(x @ w1) @ w2, *shapes)[0] == chip


def _fused(fn, dtype=jnp.float32) -> dict:
    """The fusing estimates of ``fn(x, w1, w2, w3)`` (x n x d, each w d x d) above its arguments, in n x d fp32s."""
    n = jnp.dtype(dtype).itemsize
    memory = trace(fn, sd((N, D), dtype), *[sd((D, D), dtype)] * 3, mesh={"data": 1}).memory
    return {k: (memory[k] - memory["arguments"]) / ARRAY * 4 / n
            for k in ("total_fused_matmuls", "total_fused_bf16_matmuls")}


def test_xla_tpu_keeps_a_relu_mask_as_a_predicate() -> None:
    """A comparison read by a later span (a ReLU's mask, read by its backward's select) is kept as its predicate,
    one byte an element, on a fusing compiler; its f32 operand is not kept for it (the chip's CNN: ``pred`` buffers
    beside no f32 pre-activation). Without the mask the same program holds a quarter of an activation less."""
    def masked(x, w1, w2, w3):
        h = x @ w1
        mask = h > 0
        return jnp.where(mask, (jnp.maximum(h, 0.0) @ w2) @ w3, 0.0)

    def plain(x, w1, w2, w3):
        return (jnp.maximum(x @ w1, 0.0) @ w2) @ w3

    with_mask, without = _fused(masked), _fused(plain)
    assert with_mask["total_fused_matmuls"] == without["total_fused_matmuls"] + 0.25
    assert with_mask["total_fused_bf16_matmuls"] == without["total_fused_bf16_matmuls"] + 0.25


def test_xla_tpu_keeps_the_bf16_copy_of_a_value_only_default_precision_matmuls_read() -> None:
    """On a device that rounds an fp32 matmul's inputs to bf16 (fp32_matmuls: bf16) a matmul result only the next
    matmul reads is held as its bf16 copy: at the third matmul half an activation and the output. A matmul at
    ``precision="highest"`` reads the f32; a bf16 program has nothing to round; and an elementwise input the matmul
    can compute again from values kept anyway (``h`` read at the end) is computed in its kernel, no copy kept."""
    def chain(x, w1, w2, w3):
        return ((x @ w1) @ w2) @ w3

    def highest(x, w1, w2, w3):
        dot = functools.partial(jnp.matmul, precision="highest")
        return dot(dot(dot(x, w1), w2), w3)

    def recomputed(x, w1, w2, w3):
        h = x @ w1
        return ((jnp.tanh(h) * h) @ w2) @ w3 * h

    assert _fused(chain) == {"total_fused_matmuls": 2.0, "total_fused_bf16_matmuls": 1.5}
    assert _fused(highest) == {"total_fused_matmuls": 2.0, "total_fused_bf16_matmuls": 2.0}
    assert _fused(chain, jnp.bfloat16) == {"total_fused_matmuls": 2.0, "total_fused_bf16_matmuls": 2.0}
    assert _fused(recomputed) == {"total_fused_matmuls": 2.0, "total_fused_bf16_matmuls": 2.0}


def test_xla_tpu_recomputes_an_expensive_result_read_across_a_matmul() -> None:
    """On XLA:TPU an elementwise function of kept values is recomputed inside its later reader's fusion, a
    transcendental too (testbed.model.xla_tpu: the GELU's output is not kept for the backward): tanh(x) read after
    two matmuls costs what x * 2 does there, where XLA:CPU keeps it."""
    shapes = ((N, D), (D, D), (D, D))
    (expensive, kept), (cheap, _) = _on_chip(_across(jnp.tanh), *shapes), _on_chip(_across(lambda x: x * 2), *shapes)
    assert expensive == cheap < kept


def test_the_host_estimates_are_the_recorded_held_out_ones() -> None:
    """On ``host-cpu-8`` (XLA:CPU: no fusion into matmuls, fp32 matmuls in fp32) the rules of a fusing, rounding
    compiler take nothing: each held-out program's estimate is the one benchmarks/results/program_heldout.json
    recorded, byte for byte."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    import pytest

    from testbed.cli.program import local_mesh
    from testbed.sim.graph.traced import device_memory
    from testbed.topology.io import load_topology

    if len(jax.devices("cpu")) < 8:
        pytest.skip("needs 8 emulated CPU devices (TESTBED_TEST_DEVICES)")
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "benchmarks"))
    spec = importlib.util.spec_from_file_location("program_heldout", root / "benchmarks" / "program_heldout.py")
    heldout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(heldout)
    recorded = json.loads((root / "benchmarks" / "results" / "program_heldout.json").read_text())
    host = load_topology(recorded["topology"])
    assert recorded["topology"] == "host-cpu-8" and len(recorded["rows"]) == 8
    estimates = {}
    for name, row in recorded["rows"].items():
        mesh = local_mesh(row["mesh"], jax.devices("cpu")[:8])
        step, args = heldout._module(name).predict(mesh)
        estimates[name] = float(device_memory(trace(step, *args, mesh=mesh, name=name), host)["total"])
    assert estimates == {name: row["memory_estimate"] for name, row in recorded["rows"].items()}
