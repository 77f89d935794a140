"""A small Vision Transformer (patch embedding, pre-norm blocks of multi-head self-attention and a GELU MLP, mean
pooling, a classifier) in plain JAX, bf16 parameters and activations, ``jit`` data parallel over every mesh axis,
optax Adam (its moments in bf16 like the parameters)."""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

SIZES = {"per_device": 4, "image": 32, "patch": 4, "dim": 128, "heads": 4, "hidden": 256, "blocks": 2,
         "classes": 10}
DTYPE = jnp.bfloat16
OPTIMIZER = optax.adam(1e-3)


def _norm(x):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + 1e-6)


def _attention(x, block):
    b, t, d = x.shape
    h = SIZES["heads"]
    q, k, v = (jnp.einsum("btd,de->bte", x, block[n]).reshape(b, t, h, d // h) for n in ("q", "k", "v"))
    scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / jnp.sqrt(jnp.asarray(d // h, x.dtype))
    out = jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, d)
    return out @ block["o"]


def _forward(params, images):
    s = SIZES
    b, p = images.shape[0], s["patch"]
    g = s["image"] // p
    x = images.reshape(b, g, p, g, p, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, g * g, p * p * 3) @ params["embed"]
    x = x + params["position"]
    for block in params["blocks"]:
        x = x + _attention(_norm(x), block)
        x = x + jax.nn.gelu(_norm(x) @ block["w1"]) @ block["w2"]
    return (jnp.mean(_norm(x), axis=1) @ params["head"]).astype(jnp.float32)


def _loss(params, images, labels):
    logits = _forward(params, images)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def train_step(params, opt_state, images, labels):
    loss, grads = jax.value_and_grad(_loss)(params, images, labels)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def predict(mesh):
    s = SIZES
    rep, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P(mesh.axis_names))
    d, tokens = s["dim"], (s["image"] // s["patch"]) ** 2
    block = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "w1": (d, s["hidden"]), "w2": (s["hidden"], d)}
    shapes = {"embed": (s["patch"] ** 2 * 3, d), "position": (tokens, d),
              "blocks": [dict(block) for _ in range(s["blocks"])], "head": (d, s["classes"])}
    params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, DTYPE, sharding=rep), shapes,
                          is_leaf=lambda v: isinstance(v, tuple))
    opt_state = jax.eval_shape(OPTIMIZER.init, params)
    opt_state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), opt_state)
    n = s["per_device"] * mesh.size
    images = jax.ShapeDtypeStruct((n, s["image"], s["image"], 3), DTYPE, sharding=batch)
    labels = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=batch)
    return jax.jit(train_step), (params, opt_state, images, labels)
