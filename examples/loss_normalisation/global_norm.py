"""A user's data-parallel step with ``jax.pmap``: a summed loss normalised by the global batch, gradients psum-ed.

Each device sums its rows' squared errors and divides by the *global* number of rows (its own rows times the
number of devices); the ``psum`` of the gradients is then the gradient of the whole batch's mean loss.
"""

import jax
import jax.numpy as jnp
from jax import lax

LEARNING_RATE = 0.1


def init_params(features: int = 4, outputs: int = 2) -> dict:
    return {"w": jax.random.normal(jax.random.key(13), (features, outputs))}


def squared_errors(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.sum((x @ params["w"] - y) ** 2, axis=-1)


def reference_step(params: dict, x: jax.Array, y: jax.Array) -> dict:
    """The single-device step: the mean loss over the whole batch."""
    grads = jax.grad(lambda p: jnp.sum(squared_errors(p, x, y)) / x.shape[0])(params)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)


def global_rows(x: jax.Array) -> jax.Array:
    return x.shape[0] * lax.psum(1, "batch")


def train_step(params: dict, x: jax.Array, y: jax.Array, rows=global_rows) -> dict:
    """One step on this device's rows (under ``jax.pmap(..., axis_name="batch")``)."""
    grads = jax.grad(lambda p: jnp.sum(squared_errors(p, x, y)) / rows(x))(params)
    grads = lax.psum(grads, "batch")
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
