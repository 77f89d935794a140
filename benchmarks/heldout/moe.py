"""A mixture-of-experts layer stack written with ``jax.shard_map`` over ``expert`` (one expert per device, the
tokens split over the same devices): top-1 routing with a capacity, the dispatched tokens sent to their expert
and back with ``all_to_all``, a replicated router and attention-free dense residual layers; fp32, SGD.
Mesh ``expert``."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

SIZES = {"tokens_per_device": 128, "dim": 128, "hidden": 512, "capacity": 32, "layers": 2}


def _moe(x, router, w1, w2):
    """x: this device's tokens (t, d); w1, w2: this device's expert (1, d, f), (1, f, d)."""
    experts = router.shape[1]
    gates = jax.nn.softmax(x @ router, axis=-1)
    choice = jnp.argmax(gates, axis=-1)
    onehot = jax.nn.one_hot(choice, experts, dtype=x.dtype)
    position = (jnp.cumsum(onehot, axis=0) - 1.0) * onehot
    slots = jax.nn.one_hot(position.sum(-1).astype(jnp.int32), SIZES["capacity"], dtype=x.dtype)
    dispatch = onehot[:, :, None] * slots[:, None, :]                      # (t, e, c)
    combine = dispatch * jnp.max(gates, axis=-1)[:, None, None]
    sent = jnp.einsum("tec,td->ecd", dispatch, x)
    received = jax.lax.all_to_all(sent, "expert", 0, 0, tiled=True)        # (e: source devices, c, d)
    y = jnp.einsum("scf,fd->scd", jax.nn.gelu(jnp.einsum("scd,df->scf", received, w1[0])), w2[0])
    back = jax.lax.all_to_all(y, "expert", 0, 0, tiled=True)
    return x + jnp.einsum("tec,ecd->td", combine, back)


def _local_loss(params, x):
    for layer in params:
        x = _moe(x, layer["router"], layer["w1"], layer["w2"])
        x = x + jnp.tanh(x @ layer["dense"])
    return jax.lax.pmean(jnp.mean(x ** 2), "expert")


def predict(mesh):
    s = SIZES
    experts = mesh.shape["expert"]
    layer_specs = {"router": P(), "dense": P(), "w1": P("expert"), "w2": P("expert")}
    specs = [dict(layer_specs) for _ in range(s["layers"])]
    loss = jax.shard_map(_local_loss, mesh=mesh, in_specs=(specs, P("expert")), out_specs=P())

    def train_step(params, x):
        grads = jax.grad(loss)(params, x)
        return jax.tree.map(lambda w, g: w - 0.01 * g, params, grads), x

    shapes = {"router": (s["dim"], experts), "dense": (s["dim"], s["dim"]),
              "w1": (experts, s["dim"], s["hidden"]), "w2": (experts, s["hidden"], s["dim"])}
    params = [{n: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, layer_specs[n]))
               for n, shape in shapes.items()} for _ in range(s["layers"])]
    x = jax.ShapeDtypeStruct((s["tokens_per_device"] * experts, s["dim"]), jnp.float32,
                             sharding=NamedSharding(mesh, P("expert")))
    return jax.jit(train_step), (params, x)
