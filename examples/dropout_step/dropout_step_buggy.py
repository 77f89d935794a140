"""The buggy twin of dropout_step: every device draws its mask from the same key (no fold_in with its index)."""

import dropout_step
from dropout_step import init_params, make_reference_step  # noqa: F401  (same model and reference)


def _same_key(key):
    return key                              # BUG: jax.random.fold_in(key, lax.axis_index("data")) missing


def make_parallel_step(mesh):
    return dropout_step.make_parallel_step(mesh, derive=_same_key)
