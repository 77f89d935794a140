"""The buggy twin of my_pipeline: outputs collected by multiplying with a 0/1 mask, so NaN bubbles leak."""

import my_pipeline
from my_pipeline import init_params, reference  # noqa: F401  (same model and reference)


def collect(outs, m, y, is_last):
    return outs.at[m].add(is_last * y)  # BUG: 0 * NaN is NaN -- the idle slots' NaN leaks into the result


def make_pipeline(mesh):
    return my_pipeline.make_pipeline(mesh, collect=collect)
