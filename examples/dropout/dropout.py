"""A user's data-parallel dropout with ``jax.shard_map``: every device draws its own mask.

The key is folded with the device's index on "data" (``fold_in(key, axis_index("data"))``): with the
same key everywhere, every replica would drop the same positions of its rows.
"""

import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

RATE = 0.5


def dropout(key: jax.Array, x: jax.Array) -> jax.Array:
    """The reference for one shard: inverted dropout of ``x`` with ``key``."""
    keep = jax.random.bernoulli(key, 1 - RATE, x.shape)
    return jax.numpy.where(keep, x / (1 - RATE), 0.0)


def _local(key: jax.Array, x: jax.Array) -> jax.Array:
    return dropout(jax.random.fold_in(key, lax.axis_index("data")), x)


def make_parallel_dropout(mesh: jax.sharding.Mesh, local=_local):
    """Dropout of rows split over ``mesh``'s "data" axis; the key is replicated."""
    mapped = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data")))
    return lambda key, x: mapped(key, jax.device_put(x, NamedSharding(mesh, P("data"))))
