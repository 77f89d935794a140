"""The buggy twin of zero: the momentum is left replicated (P()), so every device keeps all of it."""

from jax.sharding import PartitionSpec as P

import zero
from zero import init_momentum, init_params, reference_step  # noqa: F401  (same model and reference)


def make_parallel_step(mesh):
    return zero.make_parallel_step(mesh, state_spec=P())   # BUG: P("data") shards it (ZeRO-1)
