"""An MLP-Mixer (patches, token-mixing and channel-mixing MLPs with LayerNorm, a classifier) in plain JAX, fp32,
``jit`` data parallel over every mesh axis, SGD."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

SIZES = {"per_device": 8, "image": 32, "patch": 4, "channels": 128, "tokens_hidden": 64, "channels_hidden": 256,
         "blocks": 2, "classes": 10}


def _norm(x):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + 1e-6)


def _mlp(x, w1, w2):
    return jax.nn.gelu(x @ w1) @ w2


def _forward(params, images):
    s = SIZES
    b, p = images.shape[0], s["patch"]
    g = s["image"] // p
    patches = images.reshape(b, g, p, g, p, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, g * g, p * p * 3)
    x = patches @ params["embed"]
    for block in params["blocks"]:
        x = x + _mlp(_norm(x).transpose(0, 2, 1), block["t1"], block["t2"]).transpose(0, 2, 1)
        x = x + _mlp(_norm(x), block["c1"], block["c2"])
    return jnp.mean(_norm(x), axis=1) @ params["head"]


def _loss(params, images, labels):
    logits = _forward(params, images)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def train_step(params, images, labels):
    loss, grads = jax.value_and_grad(_loss)(params, images, labels)
    return jax.tree.map(lambda w, g: w - 0.01 * g, params, grads), loss


def predict(mesh):
    s = SIZES
    rep, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P(mesh.axis_names))
    tokens, c = (s["image"] // s["patch"]) ** 2, s["channels"]
    block = {"t1": (tokens, s["tokens_hidden"]), "t2": (s["tokens_hidden"], tokens),
             "c1": (c, s["channels_hidden"]), "c2": (s["channels_hidden"], c)}
    shapes = {"embed": (s["patch"] ** 2 * 3, c), "blocks": [dict(block) for _ in range(s["blocks"])],
              "head": (c, s["classes"])}
    params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rep), shapes,
                          is_leaf=lambda v: isinstance(v, tuple))
    n = s["per_device"] * mesh.size
    images = jax.ShapeDtypeStruct((n, s["image"], s["image"], 3), jnp.float32, sharding=batch)
    labels = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=batch)
    return jax.jit(train_step), (params, images, labels)
