"""A user's data-parallel training step with dropout, with ``jax.shard_map``: each device draws its own mask.

Dropout on the hidden layer uses ``fold_in(key, axis_index("data"))``: shard ``i``'s rows get the mask drawn
from ``fold_in(key, i)``. The single-device reference draws the same masks, block by block of rows
(:func:`make_reference_step`), so the two steps are equal.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

RATE = 0.5
LEARNING_RATE = 0.1


def init_params(features: int = 4, hidden: int = 16, outputs: int = 2) -> dict:
    k1, k2 = jax.random.split(jax.random.key(7))
    return {"w1": jax.random.normal(k1, (features, hidden)) / features ** 0.5,
            "w2": jax.random.normal(k2, (hidden, outputs)) / hidden ** 0.5}


def loss_fn(params: dict, x: jax.Array, y: jax.Array, keep: jax.Array) -> jax.Array:
    h = jnp.where(keep, jax.nn.relu(x @ params["w1"]) / (1 - RATE), 0.0)
    return jnp.mean((h @ params["w2"] - y) ** 2)


def mask(key: jax.Array, rows: int, hidden: int) -> jax.Array:
    return jax.random.bernoulli(key, 1 - RATE, (rows, hidden))


def make_reference_step(shards: int):
    """The single-device step whose mask for the rows of shard ``i`` is drawn from ``fold_in(key, i)``."""

    def step(params: dict, key: jax.Array, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
        rows, hidden = x.shape[0] // shards, params["w1"].shape[1]
        keep = jnp.concatenate([mask(jax.random.fold_in(key, i), rows, hidden) for i in range(shards)])
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y, keep)
        return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), loss

    return step


def shard_key(key: jax.Array) -> jax.Array:
    return jax.random.fold_in(key, lax.axis_index("data"))


def _step(params: dict, key: jax.Array, x: jax.Array, y: jax.Array, derive=shard_key) -> tuple[dict, jax.Array]:
    keep = mask(derive(key), x.shape[0], params["w1"].shape[1])
    loss, grads = jax.value_and_grad(lambda p: lax.pmean(loss_fn(p, x, y, keep), "data"))(params)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), loss


def make_parallel_step(mesh: jax.sharding.Mesh, derive=shard_key):
    """The step over ``mesh``'s "data" axis: parameters and key replicated, rows split."""
    mapped = jax.jit(jax.shard_map(lambda p, k, x, y: _step(p, k, x, y, derive), mesh=mesh,
                                   in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P())))
    rows = NamedSharding(mesh, P("data"))
    return lambda params, key, x, y: mapped(params, key, jax.device_put(x, rows), jax.device_put(y, rows))
