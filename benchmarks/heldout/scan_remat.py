"""A deep MLP written as ``lax.scan`` over stacked layers, each layer under ``jax.checkpoint`` (recomputed in the
backward) with a ``custom_vjp`` activation, tensor parallel over ``model`` by sharding annotations (hidden units
split), batch over ``data``; fp32, SGD. Mesh ``data`` x ``model``."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

SIZES = {"per_replica": 32, "dim": 256, "hidden": 1024, "layers": 4}


@jax.custom_vjp
def squared_relu(x):
    return jnp.maximum(x, 0.0) ** 2


def _forward_rule(x):
    return squared_relu(x), x


def _backward_rule(x, g):
    return (g * 2.0 * jnp.maximum(x, 0.0),)


squared_relu.defvjp(_forward_rule, _backward_rule)


@jax.checkpoint
def _layer(x, weights):
    w1, w2 = weights
    return x + squared_relu(x @ w1) @ w2, None


def _loss(weights, x):
    x, _ = jax.lax.scan(_layer, x, weights)
    return jnp.mean(x ** 2)


def train_step(weights, x):
    grads = jax.grad(_loss)(weights, x)
    return jax.tree.map(lambda w, g: w - 0.01 * g, weights, grads), x


def predict(mesh):
    s = SIZES
    w1 = jax.ShapeDtypeStruct((s["layers"], s["dim"], s["hidden"]), jnp.float32,
                              sharding=NamedSharding(mesh, P(None, None, "model")))
    w2 = jax.ShapeDtypeStruct((s["layers"], s["hidden"], s["dim"]), jnp.float32,
                              sharding=NamedSharding(mesh, P(None, "model", None)))
    x = jax.ShapeDtypeStruct((s["per_replica"] * mesh.shape["data"], s["dim"]), jnp.float32,
                             sharding=NamedSharding(mesh, P("data")))
    return jax.jit(train_step), ((w1, w2), x)
