"""The buggy twin of dp_step: gradients summed over devices (psum) where they should be averaged."""

import jax
from jax import lax

from dp_step import LEARNING_RATE, init_params, loss_fn, reference_step  # noqa: F401  (same model and reference)


def train_step(params: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    grads = lax.psum(grads, axis_name="batch")  # BUG: psum where pmean was meant -- gradients scaled by #devices
    params = jax.tree_util.tree_map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return params, lax.pmean(loss, axis_name="batch")
