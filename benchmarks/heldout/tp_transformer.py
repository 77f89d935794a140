"""A transformer block stack written with ``jax.shard_map``: Megatron tensor parallelism over ``model`` (attention
heads and the MLP's hidden units split) with sequence parallelism (the residual stream split over ``model`` along
the sequence: ``all_gather`` before each block's matmuls, ``psum_scatter`` after), batch over ``data``; fp32, SGD.
Mesh ``data`` x ``model``."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

SIZES = {"per_replica": 2, "seq": 128, "dim": 256, "heads": 8, "hidden": 1024, "layers": 2}


def _norm(x):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + 1e-6)


def _attention(x, layer):
    """x: (b, t, d) whole sequence; this device's heads."""
    b, t, _ = x.shape
    q, k, v = (x @ layer[n] for n in ("q", "k", "v"))
    local = q.shape[-1]
    e = SIZES["dim"] // SIZES["heads"]
    q, k, v = (a.reshape(b, t, local // e, e) for a in (q, k, v))
    scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / jnp.sqrt(float(e))
    mask = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(mask, scores, -1e9)
    out = jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, local)
    return out @ layer["o"]


def _local_loss(layers, x):
    for layer in layers:
        full = jax.lax.all_gather(_norm(x), "model", axis=1, tiled=True)
        x = x + jax.lax.psum_scatter(_attention(full, layer), "model", scatter_dimension=1, tiled=True)
        full = jax.lax.all_gather(_norm(x), "model", axis=1, tiled=True)
        h = jax.nn.gelu(full @ layer["w1"]) @ layer["w2"]
        x = x + jax.lax.psum_scatter(h, "model", scatter_dimension=1, tiled=True)
    return jax.lax.pmean(jax.lax.pmean(jnp.mean(x ** 2), "model"), "data")


def predict(mesh):
    s = SIZES
    column, row = P(None, "model"), P("model", None)
    specs = [{"q": column, "k": column, "v": column, "o": row, "w1": column, "w2": row} for _ in range(s["layers"])]
    loss = jax.shard_map(_local_loss, mesh=mesh, in_specs=(specs, P("data", "model")), out_specs=P())

    def train_step(layers, x):
        grads = jax.grad(loss)(layers, x)
        return jax.tree.map(lambda w, g: w - 0.01 * g, layers, grads), x

    d = s["dim"]
    shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "w1": (d, s["hidden"]), "w2": (s["hidden"], d)}
    layers = [{n: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec[n]))
               for n, shape in shapes.items()} for spec in specs]
    x = jax.ShapeDtypeStruct((s["per_replica"] * mesh.shape["data"], s["seq"], d), jnp.float32,
                             sharding=NamedSharding(mesh, P("data", "model")))
    return jax.jit(train_step), (layers, x)
