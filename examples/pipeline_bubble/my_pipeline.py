"""A user's hand-written GPipe forward pass with ``jax.shard_map``: one layer per device on the "stage" axis.

At tick t stage s works on microbatch t - s; activations move one stage on with ``lax.ppermute``. Slots where
a stage has nothing to do (the pipeline bubble) hold NaN, so a bubble value that leaks into the result shows.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P


def init_params(stages: int, d: int = 8) -> jax.Array:
    return jax.random.normal(jax.random.key(2), (stages, d, d)) / d ** 0.5


def layer(w: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ w)


def reference(ws: jax.Array, xs: jax.Array) -> jax.Array:
    """Every microbatch through every layer, on one device."""
    for s in range(ws.shape[0]):
        xs = layer(ws[s], xs)
    return xs


def collect(outs: jax.Array, m: int, y: jax.Array, is_last: jax.Array) -> jax.Array:
    """Store the last stage's output for microbatch m (other stages keep zeros)."""
    return outs.at[m].set(jnp.where(is_last, y, outs[m]))


def make_pipeline(mesh: jax.sharding.Mesh, collect=collect):
    stages = mesh.shape["stage"]

    def local(w: jax.Array, xs: jax.Array) -> jax.Array:
        w, s = w[0], lax.axis_index("stage")
        micro = xs.shape[0]
        state = jnp.full(xs.shape[1:], jnp.nan, xs.dtype)        # idle: NaN
        outs = jnp.zeros_like(xs)
        for t in range(micro + stages - 1):
            feed = xs[t] if t < micro else jnp.full(xs.shape[1:], jnp.nan, xs.dtype)
            y = layer(w, jnp.where(s == 0, feed, state))
            m = t - (stages - 1)                                  # the microbatch the last stage finishes
            outs = collect(outs, min(max(m, 0), micro - 1), y, (s == stages - 1) & (0 <= m < micro))
            state = lax.ppermute(y, "stage", [(i, i + 1) for i in range(stages - 1)])
        return lax.psum(outs, "stage")                            # the last stage's outputs, everywhere

    shard = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("stage"), P()), out_specs=P(), check_vma=False))

    def pipeline(ws: jax.Array, xs: jax.Array) -> jax.Array:
        return shard(jax.device_put(ws, NamedSharding(mesh, P("stage"))), jax.device_put(xs, NamedSharding(mesh, P())))

    return pipeline
