"""A user's data-parallel training step: linear regression, SGD, gradients averaged with ``lax.pmean``."""

import jax
import jax.numpy as jnp
from jax import lax

LEARNING_RATE = 0.1


def init_params(features: int = 4, outputs: int = 2) -> dict:
    key_w, key_b = jax.random.split(jax.random.key(0))
    return {"w": jax.random.normal(key_w, (features, outputs)), "b": jax.random.normal(key_b, (outputs,))}


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def reduce_gradients(grads: dict) -> dict:
    return lax.pmean(grads, axis_name="batch")


def train_step(params: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
    """One step on this device's part of the batch (run under ``jax.pmap(..., axis_name="batch")``)."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    grads = reduce_gradients(grads)
    params = jax.tree_util.tree_map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return params, lax.pmean(loss, axis_name="batch")


def reference_step(params: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
    """The same step on one device over the whole batch."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return jax.tree_util.tree_map(lambda p, g: p - LEARNING_RATE * g, params, grads), loss
