"""A user's data-parallel momentum SGD step with ``jax.jit`` and shardings: the optimizer state sharded (ZeRO-1).

The batch is split over "data"; the parameters are replicated; the momentum, as large as the parameters, is
split over "data" by its rows (``out_shardings``), so each device keeps only its share. XLA partitions the
update to match. The numbers equal the single-device step's either way: only the layout shows the sharding.
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

LEARNING_RATE = 0.1
BETA = 0.9


def init_params(features: int = 24, outputs: int = 4) -> dict:
    return {"w": jax.random.normal(jax.random.key(17), (features, outputs)) / features ** 0.5}


def init_momentum(params: dict) -> dict:
    return jax.tree.map(jnp.zeros_like, params)


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((x @ params["w"] - y) ** 2)


def reference_step(params: dict, momentum: dict, x: jax.Array, y: jax.Array) -> tuple[dict, dict]:
    """The step on one device: momentum SGD on the whole batch."""
    grads = jax.grad(loss_fn)(params, x, y)
    momentum = jax.tree.map(lambda m, g: BETA * m + g, momentum, grads)
    return jax.tree.map(lambda p, m: p - LEARNING_RATE * m, params, momentum), momentum


def make_parallel_step(mesh: jax.sharding.Mesh, state_spec: P = P("data")):
    """The step over ``mesh``: rows split over "data", parameters replicated, momentum laid out by ``state_spec``."""
    replicated, rows, state = (NamedSharding(mesh, s) for s in (P(), P("data"), state_spec))
    step = jax.jit(reference_step, in_shardings=(replicated, state, rows, rows), out_shardings=(replicated, state))

    def run(params: dict, momentum: dict, x: jax.Array, y: jax.Array) -> tuple[dict, dict]:
        momentum = jax.device_put(momentum, state)
        return step(jax.device_put(params, replicated), momentum, jax.device_put(x, rows), jax.device_put(y, rows))

    return run
