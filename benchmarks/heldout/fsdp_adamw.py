"""An MLP stack trained with fully sharded data parallelism in plain ``jit``: every parameter and AdamW moment
split over ``fsdp`` (XLA gathers the weights for the forward and backward, reduce-scatters the gradients), the
batch over ``data`` x ``fsdp``, optax AdamW; fp32. Mesh ``data`` x ``fsdp``."""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

SIZES = {"per_device": 16, "dim": 256, "hidden": 1024, "layers": 3}
OPTIMIZER = optax.adamw(1e-3, weight_decay=0.01)


def _loss(params, x):
    for layer in params:
        x = x + jax.nn.gelu(x @ layer["w1"]) @ layer["w2"]
    return jnp.mean(x ** 2)


def predict(mesh):
    s = SIZES
    shard = NamedSharding(mesh, P("fsdp"))
    shapes = [{"w1": (s["dim"], s["hidden"]), "w2": (s["hidden"], s["dim"])} for _ in range(s["layers"])]
    params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=shard), shapes,
                          is_leaf=lambda v: isinstance(v, tuple))
    opt_state = jax.eval_shape(OPTIMIZER.init, params)
    rep = NamedSharding(mesh, P())
    opt_state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shard if a.ndim else rep),
                             opt_state)
    batch = NamedSharding(mesh, P(("data", "fsdp")))
    x = jax.ShapeDtypeStruct((s["per_device"] * mesh.size, s["dim"]), jnp.float32, sharding=batch)
    shardings = (jax.tree.map(lambda a: a.sharding, params), jax.tree.map(lambda a: a.sharding, opt_state))

    def train_step(params, opt_state, x):
        loss, grads = jax.value_and_grad(_loss)(params, x)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(train_step, out_shardings=(*shardings, rep)), (params, opt_state, x)
