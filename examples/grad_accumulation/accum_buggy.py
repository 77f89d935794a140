"""The buggy twin of accum: each microbatch's loss is also divided by the number of microbatches (the
``loss / accumulation_steps`` idiom) before their gradients' sum is divided by it: averaged twice."""

import accum
from accum import init_params, reference_step  # noqa: F401  (same model and reference)


def _scaled_loss(params, x, y):
    return accum.microbatch_loss(params, x, y) / accum.MICROBATCHES   # BUG: the sum is divided again later


def make_parallel_step(mesh):
    return accum.make_parallel_step(mesh, loss=_scaled_loss)
