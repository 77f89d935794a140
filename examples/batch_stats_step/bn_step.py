"""A user's data-parallel training step through a BatchNorm layer, with ``jax.shard_map`` (``check_vma=True``).

The model is linear -> BatchNorm (no affine) -> linear, the loss a mean squared error. The BatchNorm's mean and
variance are ``pmean``-ed over "data", so every device normalises by the whole batch's statistics, as the
single-device step does; the loss is averaged over "data" and JAX sums the replicated parameters' gradients.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

EPS = 1e-5
LEARNING_RATE = 0.1


def init_params(features: int = 4, hidden: int = 8, outputs: int = 2) -> dict:
    k1, k2 = jax.random.split(jax.random.key(5))
    return {"w1": jax.random.normal(k1, (features, hidden)) / features ** 0.5,
            "w2": jax.random.normal(k2, (hidden, outputs)) / hidden ** 0.5}


def batch_norm(h: jax.Array, axis_name: str | None) -> jax.Array:
    mean = h.mean(axis=0)
    mean = lax.pmean(mean, axis_name) if axis_name else mean
    var = ((h - mean) ** 2).mean(axis=0)
    var = lax.pmean(var, axis_name) if axis_name else var
    return (h - mean) / jnp.sqrt(var + EPS)


def loss_fn(params: dict, x: jax.Array, y: jax.Array, axis_name: str | None = None, norm=batch_norm) -> jax.Array:
    h = norm(x @ params["w1"], axis_name)
    return jnp.mean((h @ params["w2"] - y) ** 2)


def reference_step(params: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
    """The single-device step over the whole batch."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), loss


def _step(params: dict, x: jax.Array, y: jax.Array, norm=batch_norm) -> tuple[dict, jax.Array]:
    loss, grads = jax.value_and_grad(lambda p: lax.pmean(loss_fn(p, x, y, "data", norm), "data"))(params)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), loss


def make_parallel_step(mesh: jax.sharding.Mesh, norm=batch_norm):
    """The step over ``mesh``'s "data" axis: parameters replicated, rows split."""
    mapped = jax.jit(jax.shard_map(lambda p, x, y: _step(p, x, y, norm), mesh=mesh,
                                   in_specs=(P(), P("data"), P("data")), out_specs=(P(), P())))
    rows = NamedSharding(mesh, P("data"))
    return lambda params, x, y: mapped(params, jax.device_put(x, rows), jax.device_put(y, rows))
