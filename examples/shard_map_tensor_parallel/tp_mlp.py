"""A user's tensor-parallel MLP with ``jax.shard_map``: the batch split over "data", the hidden layer over "model".

W1 is split by columns and W2 by rows over "model" (Megatron's MLP): each device computes its slice of the
hidden layer and a partial output, and a ``psum`` over "model" adds the partials.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

REDUCE_AXIS = "model"


def init_params(d_model: int = 8, d_hidden: int = 16) -> dict:
    k1, k2 = jax.random.split(jax.random.key(1))
    return {"w1": jax.random.normal(k1, (d_model, d_hidden)) / d_model ** 0.5,
            "w2": jax.random.normal(k2, (d_hidden, d_model)) / d_hidden ** 0.5}


def mlp(params: dict, x: jax.Array) -> jax.Array:
    """The single-device reference."""
    return jax.nn.gelu(x @ params["w1"]) @ params["w2"]


def _local(w1: jax.Array, w2: jax.Array, x: jax.Array, reduce_axis: str) -> jax.Array:
    partial = jax.nn.gelu(x @ w1) @ w2           # this device's hidden slice -> a partial output
    return lax.psum(partial, reduce_axis)


def make_parallel_mlp(mesh: jax.sharding.Mesh, reduce_axis: str = REDUCE_AXIS):
    """The MLP over ``mesh`` (axes "data", "model"); ``reduce_axis`` is where the partial outputs are summed."""
    specs = (P(None, "model"), P("model", None), P("data", None))
    local = jax.jit(jax.shard_map(lambda w1, w2, x: _local(w1, w2, x, reduce_axis), mesh=mesh,
                                  in_specs=specs, out_specs=P("data", None), check_vma=False))

    def parallel(params: dict, x: jax.Array) -> jax.Array:
        args = (params["w1"], params["w2"], x)
        return local(*(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)))

    return parallel
