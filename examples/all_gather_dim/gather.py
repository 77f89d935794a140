"""A user's data-parallel contrastive loss with ``jax.shard_map``: every device scores its rows against all rows.

Each device holds its rows of two embeddings ``a`` and ``b``; it gathers ``b`` from every device
(``all_gather`` over "data" along a new leading dim, then flattened: the whole batch in order) and computes,
for each of its rows, the cross entropy of its similarities to all rows with its own global row as the label.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

TEMPERATURE = 0.5


def contrastive_loss(a: jax.Array, b: jax.Array) -> jax.Array:
    """The single-device reference: the loss of every row of ``a`` against all rows of ``b`` (label: its own)."""
    logits = a @ b.T / TEMPERATURE
    return -jax.nn.log_softmax(logits)[jnp.arange(a.shape[0]), jnp.arange(a.shape[0])]


def gather_rows(b: jax.Array) -> jax.Array:
    return lax.all_gather(b, "data", axis=0).reshape(-1, b.shape[-1])


def _local(a: jax.Array, b: jax.Array, gather=gather_rows) -> jax.Array:
    everyone = gather(b)                                   # (all rows, dim), in the global order
    labels = lax.axis_index("data") * a.shape[0] + jnp.arange(a.shape[0])
    logits = a @ everyone.T / TEMPERATURE
    return -jax.nn.log_softmax(logits)[jnp.arange(a.shape[0]), labels]


def make_parallel_loss(mesh: jax.sharding.Mesh, gather=gather_rows):
    """The per-row losses over ``mesh``'s "data" axis (rows of ``a`` and ``b`` split)."""
    mapped = jax.jit(jax.shard_map(lambda a, b: _local(a, b, gather), mesh=mesh, in_specs=(P("data"), P("data")),
                                   out_specs=P("data")))
    rows = NamedSharding(mesh, P("data"))
    return lambda a, b: mapped(jax.device_put(a, rows), jax.device_put(b, rows))
