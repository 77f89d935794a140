"""A ResNet-like CNN (a stem, two residual stages with strided convolutions, global pooling, a classifier) in plain
JAX, fp32, ``jit`` data parallel over every mesh axis, SGD with momentum written by hand."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

SIZES = {"per_device": 8, "image": 32, "channels": (16, 32, 64), "classes": 10}


def _conv(x, k, stride=1):
    return jax.lax.conv_general_dilated(x, k, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _forward(params, images):
    x = jax.nn.relu(_conv(images, params["stem"]))
    for stage in params["stages"]:
        y = jax.nn.relu(_conv(x, stage["down"], stride=2))
        x = y + _conv(jax.nn.relu(_conv(y, stage["a"])), stage["b"])
    return jnp.mean(x, axis=(1, 2)) @ params["head"]


def _loss(params, images, labels):
    logits = _forward(params, images)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def train_step(params, momentum, images, labels):
    loss, grads = jax.value_and_grad(_loss)(params, images, labels)
    momentum = jax.tree.map(lambda m, g: 0.9 * m + g, momentum, grads)
    params = jax.tree.map(lambda p, m: p - 0.01 * m, params, momentum)
    return params, momentum, loss


def predict(mesh):
    s = SIZES
    rep, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P(mesh.axis_names))
    c = s["channels"]
    shapes = {"stem": (3, 3, 3, c[0]), "head": (c[-1], s["classes"]),
              "stages": [{"down": (3, 3, a, b), "a": (3, 3, b, b), "b": (3, 3, b, b)} for a, b in zip(c, c[1:])]}
    params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rep), shapes,
                          is_leaf=lambda v: isinstance(v, tuple))
    n = s["per_device"] * mesh.size
    images = jax.ShapeDtypeStruct((n, s["image"], s["image"], 3), jnp.float32, sharding=batch)
    labels = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=batch)
    return jax.jit(train_step), (params, params, images, labels)
