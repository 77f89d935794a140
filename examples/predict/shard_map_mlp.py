"""A tensor-parallel MLP training step with ``jax.shard_map`` (Megatron's MLP), and what testbed predicts for it.

The batch is split over "data" and the hidden layer over "model": W1 by columns, W2 by rows. Each device
computes its hidden slice and a partial output, summed with ``psum`` over "model"; the gradients of the
(replicated over "data") weights are averaged with ``pmean`` over "data".
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

LEARNING_RATE = 0.05
#: The predicted size: d_model 4096, d_hidden 16384 in bf16, 2048 rows per data replica.
SIZES = {"d_model": 4096, "d_hidden": 16384, "rows": 2048}
SPECS = (P(None, "model"), P("model", None), P("data", None), P("data", None))


def init_params(d_model: int = 8, d_hidden: int = 16) -> dict:
    k1, k2 = jax.random.split(jax.random.key(1))
    return {"w1": jax.random.normal(k1, (d_model, d_hidden)) / d_model ** 0.5,
            "w2": jax.random.normal(k2, (d_hidden, d_model)) / d_hidden ** 0.5}


def loss_fn(w1: jax.Array, w2: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.nn.gelu(x @ w1) @ w2 - y) ** 2)


def _local_step(w1, w2, x, y):
    """One device's step: its hidden slice, the partial outputs summed over "model", the loss averaged over
    "data" (the weights are the same on every data replica, so JAX sums their gradients over "data")."""
    def local_loss(w1, w2):
        out = lax.psum(jax.nn.gelu(x @ w1) @ w2, "model")
        return lax.pmean(jnp.mean((out - y) ** 2), "data")

    loss, (g1, g2) = jax.value_and_grad(local_loss, argnums=(0, 1))(w1, w2)
    return w1 - LEARNING_RATE * g1, w2 - LEARNING_RATE * g2, loss


def make_step(mesh):
    """The jitted step over ``mesh`` (axes "data", "model"): (w1, w2, x, y) -> (w1, w2, loss)."""
    return jax.jit(jax.shard_map(_local_step, mesh=mesh, in_specs=SPECS,
                                 out_specs=(SPECS[0], SPECS[1], P())))


def reference_step(params: dict, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    loss, (g1, g2) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params["w1"], params["w2"], x, y)
    return params["w1"] - LEARNING_RATE * g1, params["w2"] - LEARNING_RATE * g2, loss


def predict(mesh):
    """(step, args) for ``mesh``, whose axes must be "data" and "model"."""
    s = SIZES
    data = dict(zip(mesh.axis_names, mesh.axis_sizes))["data"]
    shapes = ((s["d_model"], s["d_hidden"]), (s["d_hidden"], s["d_model"]), (data * s["rows"], s["d_model"]),
              (data * s["rows"], s["d_model"]))
    args = tuple(jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
                 for shape, spec in zip(shapes, SPECS))
    return make_step(mesh), args
