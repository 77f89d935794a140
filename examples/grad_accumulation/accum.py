"""A user's data-parallel step with gradient accumulation, with ``jax.shard_map`` (``check_vma=True``).

Each device splits its rows into ``MICROBATCHES`` microbatches, takes the gradient of each microbatch's loss
(averaged over "data", so JAX's sum of the replicated parameters' gradients makes it the mean over the shards),
sums them and divides the sum once by ``MICROBATCHES``: the mean gradient over the whole batch, as the
single-device step computes it in one go.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

LEARNING_RATE = 0.1
MICROBATCHES = 3


def init_params(features: int = 4, outputs: int = 2) -> dict:
    return {"w": jax.random.normal(jax.random.key(11), (features, outputs)), "b": jnp.zeros((outputs,))}


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jnp.tanh(x @ params["w"]) + params["b"] - y) ** 2)


def reference_step(params: dict, x: jax.Array, y: jax.Array) -> dict:
    """The single-device step: one gradient over the whole batch."""
    grads = jax.grad(loss_fn)(params, x, y)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)


def microbatch_loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return lax.pmean(loss_fn(params, x, y), "data")


def _step(params: dict, x: jax.Array, y: jax.Array, loss=microbatch_loss) -> dict:
    rows = x.shape[0] // MICROBATCHES
    total = jax.tree.map(jnp.zeros_like, params)
    for m in range(MICROBATCHES):
        part = slice(m * rows, (m + 1) * rows)
        total = jax.tree.map(jnp.add, total, jax.grad(loss)(params, x[part], y[part]))
    grads = jax.tree.map(lambda g: g / MICROBATCHES, total)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)


def make_parallel_step(mesh: jax.sharding.Mesh, loss=microbatch_loss):
    """The step over ``mesh``'s "data" axis: parameters replicated, rows split, microbatches accumulated."""
    mapped = jax.jit(jax.shard_map(lambda p, x, y: _step(p, x, y, loss), mesh=mesh,
                                   in_specs=(P(), P("data"), P("data")), out_specs=P()))
    rows = NamedSharding(mesh, P("data"))
    return lambda params, x, y: mapped(params, jax.device_put(x, rows), jax.device_put(y, rows))
