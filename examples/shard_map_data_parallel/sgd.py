"""A user's data-parallel SGD step with ``jax.shard_map`` (``check_vma=True``, the default).

The loss is averaged over "data" before differentiating: with ``check_vma=True`` JAX tracks that the
parameters are replicated, and the gradient of the averaged loss is already the whole batch's mean
gradient (JAX inserts the psum of the parameters' implicit ``pvary`` in the backward). No reduction of
the gradients is needed.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

LEARNING_RATE = 0.1


def init_params() -> dict:
    return {"w": jax.random.normal(jax.random.key(3), (4, 2))}


def local_loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((x @ params["w"] - y) ** 2)


def reference_step(params: dict, x: jax.Array, y: jax.Array) -> dict:
    grads = jax.grad(local_loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)


def _step(params: dict, x: jax.Array, y: jax.Array) -> dict:
    grads = jax.grad(lambda p: lax.pmean(local_loss(p, x, y), "data"))(params)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)


def make_parallel_step(mesh: jax.sharding.Mesh, step=_step):
    """The step over ``mesh``'s "data" axis: parameters replicated, rows split."""
    mapped = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P()))
    rows = NamedSharding(mesh, P("data"))
    return lambda params, x, y: mapped(params, jax.device_put(x, rows), jax.device_put(y, rows))
