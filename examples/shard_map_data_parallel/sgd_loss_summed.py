"""The buggy twin of sgd whose loss is summed over "data" (psum) instead of averaged (pmean).

The gradient of the summed loss is "data" times the batch's mean gradient: the update is too large.
"""

import jax
from jax import lax

import sgd
from sgd import init_params, reference_step  # noqa: F401  (same model and reference)


def _step(params, x, y):
    grads = jax.grad(lambda p: lax.psum(sgd.local_loss(p, x, y), "data"))(params)  # BUG: lax.pmean meant
    return jax.tree.map(lambda p, g: p - sgd.LEARNING_RATE * g, params, grads)


def make_parallel_step(mesh):
    return sgd.make_parallel_step(mesh, step=_step)
