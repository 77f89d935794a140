"""Hypothesis strategies over device counts and layouts (needs hypothesis; JAX only when a draw builds a mesh).

``meshes(8, ("data", "model"))`` draws every factorisation of 8 devices over the axes;
``partition_specs(shape, mesh)`` valid specs for an array of ``shape`` (each dimension sharded by
distinct axes whose sizes' product divides it); ``shardings`` the NamedShardings of those;
``batches`` arrays whose leading dimension is divisible by a count; ``plans`` small valid testbed
Plans (:mod:`testbed.plan.spec`) over a device count.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

from hypothesis import strategies as st

from testbed.errors import InputError

__all__ = ["factorisations", "mesh_shapes", "meshes", "partition_specs", "shardings", "batches", "plans",
           "moe_plans"]


def factorisations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Every ordered tuple of ``parts`` positive integers whose product is ``n``."""
    if parts == 0:
        return [()] if n == 1 else []
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in factorisations(n // d, parts - 1)]


def _counts(num_devices: int | Sequence[int] | st.SearchStrategy[int]) -> st.SearchStrategy[int]:
    if isinstance(num_devices, st.SearchStrategy):
        return num_devices
    if isinstance(num_devices, int):
        return st.just(num_devices)
    return st.sampled_from(list(num_devices))


def mesh_shapes(num_devices: int | Sequence[int] | st.SearchStrategy[int], axes: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Mesh shapes (tuples of ``axes`` sizes) whose product is the device count (drawn when several)."""
    return _counts(num_devices).flatmap(lambda n: st.sampled_from(factorisations(n, axes)))


def meshes(num_devices: int | Sequence[int] | st.SearchStrategy[int] | None = None,
           axis_names: Sequence[str] = ("data", "model"), *, axis_types: Any = None,
           devices: Sequence[Any] | None = None) -> st.SearchStrategy[Any]:
    """``jax.sharding.Mesh`` objects over the first n devices (``devices``, default ``jax.devices()``), one per
    factorisation of n over ``axis_names``; ``num_devices`` an int, a list or a strategy (None: all devices)."""
    names = tuple(axis_names)

    def build(shape: tuple[int, ...]) -> Any:
        import jax

        pool = list(devices if devices is not None else jax.devices())
        types = axis_types
        if isinstance(types, str):
            types = (getattr(jax.sharding.AxisType, types.capitalize()),) * len(shape)
        return jax.make_mesh(shape, names, axis_types=types, devices=pool[:math.prod(shape)])

    if num_devices is None:
        import jax

        num_devices = len(devices) if devices is not None else len(jax.devices())
    return mesh_shapes(num_devices, len(names)).map(build)


def _sizes(mesh: Any) -> dict[str, int]:
    return {str(k): int(v) for k, v in dict(mesh.shape if hasattr(mesh, "shape") else mesh).items()}


def _specs(shape: Sequence[int], sizes: dict[str, int]) -> list[tuple[Any, ...]]:
    """All valid per-dimension entries: None, an axis name, or a tuple of distinct names; each axis used once."""
    axes = [a for a, s in sizes.items() if s > 1] or list(sizes)
    options_per_dim = []
    for dim in shape:
        options: list[tuple[str, ...]] = [()]
        for r in range(1, len(axes) + 1):
            for combo in itertools.permutations(axes, r):
                if dim % math.prod(sizes[a] for a in combo) == 0:
                    options.append(combo)
        options_per_dim.append(options)
    found = []
    for choice in itertools.product(*options_per_dim):
        used = [a for c in choice for a in c]
        if len(used) == len(set(used)):
            found.append(tuple(None if not c else c[0] if len(c) == 1 else c for c in choice))
    return found


def partition_specs(shape: Sequence[int], mesh: Any) -> st.SearchStrategy[Any]:
    """Valid ``PartitionSpec``s for an array of ``shape`` on ``mesh`` (a Mesh or a {axis: size} mapping): each
    dimension unsharded or sharded by distinct axes whose sizes' product divides it."""
    entries = _specs(tuple(shape), _sizes(mesh))

    def spec(entry: tuple[Any, ...]) -> Any:
        from jax.sharding import PartitionSpec

        return PartitionSpec(*entry)

    return st.sampled_from(entries).map(spec)


def shardings(shape: Sequence[int], mesh: Any) -> st.SearchStrategy[Any]:
    """``NamedSharding``s for an array of ``shape`` on ``mesh`` (a Mesh, or a strategy of meshes)."""
    from jax.sharding import NamedSharding

    if isinstance(mesh, st.SearchStrategy):
        return mesh.flatmap(lambda m: shardings(shape, m))
    return partition_specs(shape, mesh).map(lambda spec: NamedSharding(mesh, spec))


def batches(divisible_by: int, feature_shape: Sequence[int] = (), *, max_multiple: int = 4, dtype: str = "float32",
            low: float = -2.0, high: float = 2.0) -> st.SearchStrategy[Any]:
    """numpy arrays of shape (k x divisible_by, *feature_shape), k in 1..max_multiple, values in [low, high)
    (integers for an integer dtype)."""
    import numpy as np

    def make(k: int, seed: int) -> Any:
        rng = np.random.default_rng(seed)
        shape = (k * divisible_by, *feature_shape)
        if np.dtype(dtype).kind in "iu":
            return rng.integers(int(low), int(high), size=shape).astype(dtype)
        return rng.uniform(low, high, size=shape).astype(dtype)

    return st.builds(make, st.integers(1, max_multiple), st.integers(0, 2**32 - 1))


@st.composite
def plans(draw: st.DrawFn, num_devices: int | Sequence[int] = 8, *, schedules: Sequence[str] = ("gpipe", "1f1b"),
          max_stage: int = 4, zero: bool = True, contexts: Sequence[int] = (1,)) -> Any:
    """Small valid testbed :class:`~testbed.plan.spec.Plan` objects whose mesh uses exactly the drawn device
    count: data x fsdp x tensor x stage (x context, drawn from ``contexts`` where it divides the count), a GPT
    sized to fit (heads, d_ff, layers, vocab divisible as needed; seq_len by 2 x context), microbatches,
    schedule and ZeRO stage, and the model family keys: ``head_dim`` apart from ``d_model / heads``, a
    parallel (PaLM) block, a ``sliding_window`` shorter than the sequence."""
    from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec

    n = draw(_counts(num_devices))
    options = [c for c in contexts if n % c == 0] or [1]
    context = draw(st.sampled_from(options)) if len(options) > 1 else options[0]  # one option: no draw (same plans)
    n //= context
    shapes = [s for s in factorisations(n, 4) if s[3] <= max_stage]
    data, fsdp, tensor, stage = draw(st.sampled_from(shapes))
    heads = tensor * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([2, 4]))
    layers = stage * draw(st.sampled_from([1, 2]))
    seq_len = draw(st.sampled_from([s for s in (4, 8, 16) if s % (2 * context) == 0][:2]))
    model = ModelSpec(layers=layers, d_model=heads * head_dim, heads=heads, d_ff=2 * heads * head_dim,
                      seq_len=seq_len, vocab=16 * tensor, head_dim=draw(st.sampled_from([None, 2 * head_dim])),
                      parallel_block=draw(st.booleans()),
                      sliding_window=draw(st.sampled_from([None, max(1, seq_len // 2 - 1)])))
    microbatches = draw(st.sampled_from([stage, 2 * stage]) if stage > 1 else st.sampled_from([1, 2]))
    global_batch = data * fsdp * microbatches * draw(st.sampled_from([1, 2]))
    schedule = draw(st.sampled_from(list(schedules))) if stage > 1 else "1f1b"
    try:
        return Plan(model=model, batch=BatchSpec(global_batch=global_batch, microbatches=microbatches),
                    mesh=MeshSpec(data=data, fsdp=fsdp, tensor=tensor, stage=stage, context=context),
                    schedule=ScheduleSpec(name=schedule), zero=draw(st.integers(0, 3)) if zero else 0,
                    name=f"drawn-{n * context}")
    except InputError:  # a combination the plan rules reject: draw again
        from hypothesis import reject

        reject()


@st.composite
def moe_plans(draw: st.DrawFn, num_devices: int = 8, *, experts_degrees: Sequence[int] = (2, 4, 8),
              schedules: Sequence[str] = ("1f1b", "gpipe"), max_stage: int = 2) -> Any:
    """Small valid mixture-of-experts :class:`~testbed.plan.spec.Plan` objects on exactly ``num_devices``:
    ``mesh.expert`` from ``experts_degrees`` times data x tensor x stage, a tiny model whose experts the
    expert degree divides (1 or 2 per rank), top-1 or top-2 routing, dropless or with capacity drops, shared
    experts, a first dense layer, GELU or SwiGLU, a load-balancing coefficient large enough to show, and with
    tensor > 1 ``mesh.expert_tensor`` 1 (MoE parallel folding: the experts over expert x tensor) or unset."""
    from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec

    expert = draw(st.sampled_from([e for e in experts_degrees if num_devices % e == 0]))
    shapes = [s for s in factorisations(num_devices // expert, 3) if s[2] <= max_stage]
    data, tensor, stage = draw(st.sampled_from(shapes))
    heads = 2 * tensor
    first_dense = draw(st.sampled_from([0, 1]))
    layers = stage * draw(st.sampled_from([1, 2])) + (first_dense if stage == 1 else 0)
    swiglu = draw(st.booleans())
    expert_tensor = draw(st.sampled_from([None, 1])) if tensor > 1 else None
    model = ModelSpec(layers=layers, d_model=16, heads=heads, d_ff=32, seq_len=8, vocab=16 * tensor,
                      mlp="swiglu" if swiglu else "gelu",
                      experts=expert * (tensor if expert_tensor == 1 else 1) * draw(st.sampled_from([1, 2])),
                      top_k=draw(st.sampled_from([1, 2])), expert_d_ff=8 * tensor,
                      shared_experts=draw(st.sampled_from([0, 1])), first_dense_layers=first_dense,
                      capacity_factor=draw(st.sampled_from([None, 0.75, 1.25])),
                      router_aux_loss=draw(st.sampled_from([0.01, 1.0])))
    microbatches = draw(st.sampled_from([stage, 2 * stage]) if stage > 1 else st.sampled_from([1, 2]))
    global_batch = data * expert * microbatches
    schedule = draw(st.sampled_from(list(schedules))) if stage > 1 else "1f1b"
    try:
        return Plan(model=model, batch=BatchSpec(global_batch=global_batch, microbatches=microbatches),
                    mesh=MeshSpec(data=data, expert=expert, tensor=tensor, stage=stage, expert_tensor=expert_tensor),
                    schedule=ScheduleSpec(name=schedule), name=f"moe-drawn-{num_devices}")
    except InputError:  # a combination the plan rules reject: draw again
        from hypothesis import reject

        reject()
