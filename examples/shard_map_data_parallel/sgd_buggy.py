"""The buggy twin of sgd: gradients of the per-device loss pmean-ed, as one would under pmap.

Under shard_map with check_vma=True JAX has already summed them over "data" (the transpose of the
parameters' implicit pvary): the pmean of that sum is the sum, and the update is "data" times too large.
The same step with the loss never averaged over "data" fails the same way.
"""

import jax
from jax import lax

import sgd
from sgd import init_params, reference_step  # noqa: F401  (same model and reference)


def _step(params, x, y):
    grads = jax.grad(sgd.local_loss)(params, x, y)      # already summed over "data" by JAX
    grads = lax.pmean(grads, "data")                    # BUG: a second reduction; average the loss instead
    return jax.tree.map(lambda p, g: p - sgd.LEARNING_RATE * g, params, grads)


def make_parallel_step(mesh):
    return sgd.make_parallel_step(mesh, step=_step)
