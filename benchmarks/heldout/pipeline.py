"""A GPipe-style pipeline written as one SPMD program with ``jax.shard_map``: one block of layers per device of
``stage``, microbatches passed to the next stage with ``ppermute`` (every stage computes every tick, the bubble's
ticks on zeros), the loss on the last stage; batch over ``data``; fp32, SGD. Mesh ``stage`` x ``data``."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

SIZES = {"microbatches": 4, "microbatch_per_replica": 16, "dim": 256, "layers_per_stage": 2}


def _local_loss(weights, x):
    """weights: this stage's (1, layers, d, d); x: (microbatches, b, d), this data replica's."""
    stages = jax.lax.axis_size("stage")
    me = jax.lax.axis_index("stage")
    microbatches = x.shape[0]
    state = jnp.zeros_like(x[0])
    total = 0.0
    for tick in range(microbatches + stages - 1):
        fresh = x[tick] if tick < microbatches else jnp.zeros_like(x[0])
        h = jnp.where(me == 0, fresh, state)
        for layer in range(weights.shape[1]):
            h = h + jnp.tanh(h @ weights[0, layer])
        if tick >= stages - 1:
            total = total + jnp.where(me == stages - 1, jnp.mean(h ** 2), 0.0)
        state = jax.lax.ppermute(h, "stage", [(i, (i + 1) % stages) for i in range(stages)])
    return jax.lax.pmean(jax.lax.psum(total, "stage"), "data") / microbatches


def predict(mesh):
    s = SIZES
    loss = jax.shard_map(_local_loss, mesh=mesh, in_specs=(P("stage"), P(None, "data")), out_specs=P())

    def train_step(weights, x):
        grads = jax.grad(loss)(weights, x)
        return weights - 0.01 * grads, x

    weights = jax.ShapeDtypeStruct((mesh.shape["stage"], s["layers_per_stage"], s["dim"], s["dim"]), jnp.float32,
                                   sharding=NamedSharding(mesh, P("stage")))
    x = jax.ShapeDtypeStruct((s["microbatches"], s["microbatch_per_replica"] * mesh.shape["data"], s["dim"]),
                             jnp.float32, sharding=NamedSharding(mesh, P(None, "data")))
    return jax.jit(train_step), (weights, x)
