"""The buggy twin of tp_mlp: the partial outputs are summed over the wrong mesh axis ("data", not "model")."""

import tp_mlp
from tp_mlp import init_params, mlp  # noqa: F401  (same model and reference)


def make_parallel_mlp(mesh):
    return tp_mlp.make_parallel_mlp(mesh, reduce_axis="data")  # BUG: wrong axis -- should be "model"
