"""testbed.runner.program: a user's JAX step traced on an abstract mesh, read per device (FLOPs, bytes, collectives)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, strategies as st
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from testbed.errors import InputError
from testbed.runner.program import abstract_mesh, trace, trace_pmap
from testbed.runner.program.evaluate import UNROLL_NODES
from testbed.sim.xla.workload import OpKind

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sd = jax.ShapeDtypeStruct


def _mlp_step(w1, w2, x):
    def loss(w1, w2):
        return jnp.mean((jax.nn.gelu(x @ w1) @ w2) ** 2)

    g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
    return w1 - 0.1 * g1, w2 - 0.1 * g2


def test_a_megatron_mlp_on_data_x_tensor_is_read_per_device() -> None:
    rows, d, h = 32, 64, 256
    w = trace(_mlp_step, sd((d, h), jnp.float32), sd((h, d), jnp.float32), sd((rows, d), jnp.float32),
              mesh={"data": 4, "tensor": 2}, in_shardings=(P(None, "tensor"), P("tensor", None), P("data", None)))
    local_rows, local_h = rows // 4, h // 2
    gemms = [op for op in w.ops if op.kind is OpKind.GEMM]
    # forward 2 matmuls, backward 3 (dW2, dH, dW1): each 2 * rows * d * h / (data * tensor)
    assert len(gemms) == 5
    assert all(op.flops == 2 * local_rows * d * local_h for op in gemms)
    assert w.flops() == 5 * 2 * local_rows * d * local_h
    assert w.collective_bytes() == {"tensor": {"all_reduce": local_rows * d * 4},   # the row-parallel output
                                    "data": {"all_reduce": 2 * d * local_h * 4}}    # both weights' gradients
    assert w.mesh == {"data": 4, "tensor": 2} and w.dtype == "fp32"
    assert w.memory["arguments"] == (2 * d * local_h + local_rows * d) * 4


def test_an_adam_update_is_one_multi_output_fusion() -> None:
    """optax's AdamW over an fp32 master from bf16 gradients: XLA fuses the moments' and the parameters'
    updates into one kernel with several outputs, so each parameter costs its reads (bf16 gradient, fp32
    master and two moments: 14 bytes) and writes (master, moments, bf16 copy: 14 bytes) once - the 28 bytes
    plan-driven simulation charges (testbed.sim.step.facts: grad + param + 2 x (4 + 4 x moments)). The new
    moments, written because the step returns them, are not read back."""
    import optax

    n, tx = 1 << 16, optax.adamw(1e-3)

    def update(master, mu, nu, count, grads):
        state = (optax.ScaleByAdamState(count=count, mu=mu, nu=nu), optax.EmptyState(), optax.EmptyState())
        updates, (adam, *_) = tx.update(grads.astype(jnp.float32), state, master)
        master = optax.apply_updates(master, updates)
        return master.astype(jnp.bfloat16), master, adam.mu, adam.nu, adam.count

    w = trace(jax.jit(update), *(sd((n,), jnp.float32),) * 3, sd((), jnp.int32), sd((n,), jnp.bfloat16),
              mesh={"data": 1})
    assert sum(op.hbm_bytes for op in w.ops) == pytest.approx(28 * n, rel=1e-3)


def test_a_causal_mask_of_index_generators_is_fused_into_its_consumers() -> None:
    """A causal mask built from iotas (compare, select) depends on no input: XLA fuses it into each consumer
    and recomputes it in registers (XLA:CPU's compiled attention: the iotas and the compare sit inside the
    select's loop fusion, whose only operand is the scores), so it moves no HBM bytes: a masked softmax costs
    what an unmasked one does."""
    h, s, d = 2, 256, 64

    def attention(q, k, v, causal):
        scores = jnp.einsum("hqd,hkd->hqk", q, k) / 8.0
        if causal:  # the runner's form (testbed.runner.attention): an additive bias of 0 or the dtype's minimum
            keys = jnp.arange(s)
            scores = scores + jnp.where(keys[None, :] <= keys[:, None], 0.0, jnp.finfo(scores.dtype).min)
        return jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(scores, axis=-1), v)

    args = (sd((h, s, d), jnp.float32),) * 3
    masked, plain = (trace(jax.jit(lambda q, k, v, c=c: attention(q, k, v, c)), *args, mesh={"data": 1})
                     for c in (True, False))
    assert sum(op.hbm_bytes for op in masked.ops) == sum(op.hbm_bytes for op in plain.ops) > 0


def test_a_pmap_step_is_a_shard_map_over_one_axis() -> None:
    sys.path.insert(0, str(EXAMPLES / "predict"))
    try:
        import pmap_mlp
    finally:
        sys.path.pop(0)
    n, rows, d_in, hid, d_out = 8, 16, 8, 32, 4
    params = {"w1": sd((n, d_in, hid), jnp.float32), "w2": sd((n, hid, hid), jnp.float32),
              "w3": sd((n, hid, d_out), jnp.float32)}
    w = trace_pmap(pmap_mlp.train_step, params, sd((n, rows, d_in), jnp.float32), sd((n, rows, d_out), jnp.float32),
                   axis_name="batch", devices=n)
    assert w.mesh == {"batch": n}
    forward = 2 * rows * (d_in * hid + hid * hid + hid * d_out)
    assert w.flops() == pytest.approx(3 * forward - 2 * rows * d_in * hid)  # no input gradient of the first layer
    grads = 4 * (d_in * hid + hid * hid + hid * d_out)
    assert w.collective_bytes()["batch"]["all_reduce"] == grads + 4  # the gradients and the loss
    with pytest.raises(ValueError, match="leading dimension of 8"):
        trace_pmap(pmap_mlp.train_step, params, sd((4, rows, d_in), jnp.float32), sd((n, rows, d_out), jnp.float32),
                   axis_name="batch", devices=n)


def test_shard_map_collectives_are_mapped_to_their_mesh_axes() -> None:
    sys.path.insert(0, str(EXAMPLES / "predict"))
    try:
        import shard_map_mlp
    finally:
        sys.path.pop(0)
    mesh = abstract_mesh({"data": 2, "model": 4})
    step, args = shard_map_mlp.predict(mesh)
    w = trace(step, *args, mesh=mesh)
    s = shard_map_mlp.SIZES
    out = s["rows"] * s["d_model"] * 2  # one replica's rows, bf16
    local_w = s["d_model"] * s["d_hidden"] // 4 * 2
    moved = w.collective_bytes()
    assert moved["model"]["all_reduce"] == out  # the forward psum (x is not differentiated: no backward one)
    assert moved["data"]["all_reduce"] == 2 * local_w + 2  # both gradients and the (bf16) loss
    assert w.dtype == "bf16"


def test_a_scan_is_unrolled_or_counted_with_its_trip_count() -> None:
    def stack(ws, x):
        return lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, ws)[0]

    layers, d = 6, 32
    w = trace(stack, sd((layers, d, d), jnp.float32), sd((8, d), jnp.float32), mesh={"data": 1})
    gemms = [op for op in w.ops if op.kind is OpKind.GEMM]
    assert len(gemms) == layers and all(op.count == 1 for op in gemms)
    # consecutive layers depend on each other through the carried value
    assert all(any(d_ > 0 for d_ in op.deps) for op in gemms[1:])
    many = UNROLL_NODES  # more iterations than the unroll budget: the body once, counted
    w = trace(stack, sd((many, d, d), jnp.float32), sd((8, d), jnp.float32), mesh={"data": 1})
    gemms = [op for op in w.ops if op.kind is OpKind.GEMM]
    assert len(gemms) == 1 and gemms[0].count == many
    assert w.flops() == many * 2 * 8 * d * d
    assert any("priced as its body repeated" in a for a in w.assumptions)


def test_a_collective_repeats_in_every_iteration_but_not_twice_in_one() -> None:
    """A loop's body gathers a loop-invariant shard again in every iteration (XLA runs a while body's
    collectives each time), while the same gather of the same value twice in one body runs once (XLA's
    common-subexpression elimination, as for a checkpoint's recomputed gather)."""
    trips, rows, d = 4, 8, 16

    def step(w, xs):
        def body(total, x):
            full = lax.all_gather(w, "data", tiled=True)
            again = lax.all_gather(w, "data", tiled=True)
            return total + jnp.sum(x @ full) + jnp.sum(x @ again), None

        return lax.scan(body, jnp.zeros(()), xs)[0]

    mesh = abstract_mesh({"data": 4})
    mapped = jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P()), out_specs=P(), check_vma=False)
    w = trace(mapped, sd((d, d), jnp.float32), sd((trips, rows, d), jnp.float32), mesh=mesh)
    gathers = [op for op in w.ops if op.kind is OpKind.COLLECTIVE and op.collective == "all_gather"]
    assert sum(op.count for op in gathers) == trips and all(op.nbytes == d * d * 4 for op in gathers)
    # each iteration's ops carry an iteration of their own (XLA keeps the loop: nothing merges or moves across)
    assert len({op.iteration for op in gathers}) == trips and all(op.iteration > 0 for op in gathers)


def test_a_convolution_is_priced_as_its_implicit_gemm() -> None:
    def conv(x, k):
        return lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    n, hw, cin, cout = 8, 16, 3, 32
    mesh = abstract_mesh({"data": 4})
    x = sd((n, hw, hw, cin), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    k = sd((3, 3, cin, cout), jnp.float32, sharding=NamedSharding(mesh, P()))
    w = trace(conv, x, k, mesh=mesh)
    (op,) = [o for o in w.ops if o.kind is OpKind.GEMM]
    assert op.flops == 2 * (n // 4) * hw * hw * cout * 9 * cin
    assert (op.gemms[0].m, op.gemms[0].n, op.gemms[0].k) == ((n // 4) * hw * hw, cout, 9 * cin)


def _with_callback(x):
    y = jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return (y @ y.T).sum()


def test_a_host_callback_is_refused_by_name_or_priced_with_a_stated_assumption() -> None:
    x = sd((16, 16), jnp.float32)
    with pytest.raises(InputError, match=r"the step calls the host callback jax\.pure_callback\(`"):
        trace(_with_callback, x, mesh={"data": 1})
    w = trace(_with_callback, x, mesh={"data": 1}, on_unknown="assume")
    assert any("host callback" in a and "memory-bound" in a for a in w.assumptions)
    assert w.flops() == 2 * 16 * 16 * 16


def test_memory_is_the_arguments_plus_the_peak_of_live_values() -> None:
    def chain(w1, w2, w3, x):
        return ((x @ w1) @ w2) @ w3

    n, d = 64, 128
    w = trace(chain, *(sd((d, d), jnp.float32),) * 3, sd((n, d), jnp.float32), mesh={"data": 1})
    arguments = (3 * d * d + n * d) * 4
    assert w.memory["arguments"] == arguments
    # x @ w1 is still alive when (x @ w1) @ w2 is written; then it is freed
    assert w.memory["total"] == arguments + 2 * n * d * 4


@pytest.mark.parametrize("example, shape, names, sizes", [
    ("vision_cnn", (8,), ("data",), {"image": 8, "channels": (4, 8), "classes": 3, "per_device": 2}),
    ("shard_map_mlp", (2, 4), ("data", "model"), {"d_model": 8, "d_hidden": 16, "rows": 4}),
])
def test_the_traced_collectives_are_those_xla_compiles(example, shape, names, sizes, monkeypatch) -> None:
    """On 8 emulated devices, XLA:CPU's compiled step runs the traced collectives (kind, mesh axes, count),
    once merged as XLA:CPU merges them (all-reduces; no all-gathers or reduce-scatters: combine_bytes 0)."""
    import importlib
    from collections import Counter

    from testbed.runner.reshards import compiled_axes
    from testbed.sim.xla.combine import combine_collectives

    monkeypatch.syspath_prepend(str(EXAMPLES / "predict"))
    module = importlib.import_module(example)
    monkeypatch.setattr(module, "SIZES", {**module.SIZES, **sizes})
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))
    step, args = module.predict(mesh)
    compiled = compiled_axes(step.trace(*args).lower().compile().as_text(), shape, names)
    abstract = abstract_mesh(dict(zip(names, shape)))
    step, args = module.predict(abstract)
    merged = combine_collectives(trace(step, *args, mesh=abstract), 0)
    traced = Counter(("+".join(op.axes), op.collective.replace("_", "-")) for op in merged.ops
                     if op.kind is OpKind.COLLECTIVE and op.group > 1)
    assert traced == compiled


@pytest.mark.slow
@pytest.mark.parametrize("mesh, remat, sequence_parallel", [
    ({"fsdp": 8}, "full", False),
    ({"fsdp": 2, "tensor": 4}, "none", True)])
def test_the_runners_step_moves_the_bytes_xla_compiles(mesh, remat, sequence_parallel) -> None:
    """testbed's GPT step on 8 emulated devices: per mesh axis and kind, the traced bytes are XLA:CPU's
    compiled step's exactly. Full remat gathers each fsdp leaf once (XLA reuses the forward's gather in the
    recomputation), sequence parallelism's recomputed sequence gathers likewise; the gathers the partitioner adds
    where values enter the backward's maps merge with none, not even a shard_map's gather of the same value
    (each has a channel id of its own: testbed.runner.program.evaluate's CSE)."""
    from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec
    from testbed.runner.check_sharding import compiled_spmd
    from testbed.runner.program.plans import trace_plan
    from testbed.runner.reshards import compiled_bytes

    spec = ModelSpec(layers=2, d_model=256, heads=4, d_ff=1024, seq_len=128, vocab=1024)
    plan = Plan(name="compiled", model=spec, batch=BatchSpec(global_batch=8), mesh=MeshSpec(**mesh),
                schedule=ScheduleSpec(name="1f1b"), precision="fp32", remat=remat, sequence_parallel=sequence_parallel)
    mesh, text = compiled_spmd(plan)
    compiled = {("+".join(axes) if isinstance(axes, tuple) else axes, kind.replace("-", "_")): float(b)
                for (axes, kind), b in compiled_bytes(text, mesh.devices.shape, mesh.axis_names).items()}
    traced = {(axes, kind): b for axes, row in trace_plan(plan).collective_bytes().items() for kind, b in row.items()}
    assert traced == compiled


@given(data=st.sampled_from([1, 2, 4, 8]), tensor=st.sampled_from([1, 2, 4]), rows=st.integers(1, 4),
       d=st.integers(1, 4), h=st.integers(1, 4))
def test_any_megatron_mlp_mesh_is_read_by_the_formulas(data, tensor, rows, d, h) -> None:
    """Drawn meshes and sizes: per-device FLOPs and bytes per axis are the Megatron MLP's formulas."""
    rows, d, h = 8 * rows * data, 8 * d, 8 * h * tensor
    w = trace(_mlp_step, sd((d, h), jnp.float32), sd((h, d), jnp.float32), sd((rows, d), jnp.float32),
              mesh={"data": data, "tensor": tensor},
              in_shardings=(P(None, "tensor"), P("tensor", None), P("data", None)))
    local_rows, local_h = rows // data, h // tensor
    assert w.flops() == 5 * 2 * local_rows * d * local_h
    expected = {}
    if tensor > 1:
        expected["tensor"] = {"all_reduce": local_rows * d * 4}
    if data > 1:
        expected["data"] = {"all_reduce": 2 * d * local_h * 4}
    assert w.collective_bytes() == expected


def _every_kind(x):
    """A bf16 shard_map body running every collective kind (tests below)."""
    y = lax.psum(x, "model") + lax.pmax(x, "model")
    y = lax.all_gather(lax.psum_scatter(y, "model", tiled=True), "data", tiled=True)
    y = lax.all_to_all(y, "model", 0, 1, tiled=True)
    return lax.ppermute(y, "data", [(0, 1), (1, 0)])


def _bf16_data_parallel(w, x):
    return jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w).astype(jnp.float32) ** 2))(w)


def _fp8_moves(x):
    return lax.ppermute(lax.all_gather(x, "model", tiled=True), "data", [(0, 1), (1, 0)])


@pytest.mark.parametrize("program", ["every_kind", "data_parallel", "fp8"])
def test_xla_cpu_moves_bf16_collectives_in_f32(program) -> None:
    """XLA:CPU widens every bf16 collective to f32 and every f8 one to f16 (its float normalization): on 8 emulated
    devices the compiled bytes per axis and kind are the traced ones as host-cpu-8's compiler moves them
    (testbed.sim.graph.traced.device_collectives), twice the traced bytes; a GPU's compiler keeps them."""
    from testbed.runner.program.measure import compiled_collectives
    from testbed.sim.graph.traced import device_collectives
    from testbed.topology.io import load_topology

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    if program == "every_kind":
        step = jax.jit(jax.shard_map(_every_kind, mesh=mesh, in_specs=P("data", "model"), out_specs=P("data", "model"),
                                     check_vma=False))
        args = (sd((16, 32), jnp.bfloat16, sharding=NamedSharding(mesh, P("data", "model"))),)
    elif program == "fp8":
        step = jax.jit(jax.shard_map(_fp8_moves, mesh=mesh, in_specs=P("data", "model"), out_specs=P("data"),
                                     check_vma=False))
        args = (sd((16, 32), jnp.float8_e4m3fn, sharding=NamedSharding(mesh, P("data", "model"))),)
    else:
        step = jax.jit(_bf16_data_parallel)
        args = (sd((32, 16), jnp.bfloat16, sharding=NamedSharding(mesh, P())),
                sd((64, 32), jnp.bfloat16, sharding=NamedSharding(mesh, P(("data", "model")))))
    compiled = compiled_collectives(step.trace(*args).lower().compile().as_text(), mesh)
    workload = trace(step, *args, mesh=mesh)
    host = device_collectives(workload, load_topology("host-cpu-8")).collective_bytes()
    assert host == compiled
    assert host == {axes: {kind: 2 * b for kind, b in row.items()} for axes, row in workload.collective_bytes().items()}
    assert device_collectives(workload, load_topology("dgx-h100")) is workload
    assert program != "every_kind" or {k for row in compiled.values() for k in row} == {
        "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "collective_permute"}


def _fsdp_grad(w, x, gather):
    """The weight gradient of a one-matmul FSDP model; ``gather``: the weight gathered explicitly first."""
    def loss(w):
        return jnp.sum((x @ (lax.with_sharding_constraint(w, gather) if gather is not None else w)) ** 2)

    return jax.grad(loss)(w)


@pytest.mark.parametrize("explicit", [False, True])
def test_an_fsdp_weight_is_gathered_as_xla_gathers_it(explicit) -> None:
    """A weight sharded over fsdp on its contracting dim times an activation sharded over (data, fsdp): XLA's SPMD
    partitioner gathers the weight whole, where Shardy's explicit reshards would move the activation with an
    all-to-all; the tracer partitions the matmul as XLA does (testbed.runner.gspmd_dots), gathered explicitly
    (``with_sharding_constraint(w, P())``) or not: the traced bytes per axis and kind are XLA:CPU's compiled ones."""
    from testbed.runner.program.compile import MOVED_DOTS
    from testbed.runner.program.measure import compiled_collectives

    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    w = sd((256, 1024), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    x = sd((128, 256), jnp.float32, sharding=NamedSharding(mesh, P(("data", "fsdp"))))
    gather = NamedSharding(mesh, P()) if explicit else None
    step = jax.jit(lambda w, x: _fsdp_grad(w, x, gather), out_shardings=w.sharding)
    compiled = compiled_collectives(step.trace(w, x).lower().compile().as_text(), mesh)
    workload = trace(step, w, x, mesh=mesh)
    note = any(MOVED_DOTS.split("{s}")[1][:60] in a for a in workload.assumptions)
    assert workload.collective_bytes() == compiled and not note
    if not explicit:
        # GSPMD: the weight gathered, its full gradient all-reduced over fsdp, then its shard over data
        weight = 256 * 1024 * 4
        assert compiled == {"fsdp": {"all_gather": weight, "all_reduce": weight}, "data": {"all_reduce": weight / 4}}
