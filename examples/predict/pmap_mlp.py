"""A data-parallel MLP training step with ``jax.pmap`` and ``lax.pmean``, and what testbed predicts for it.

``predict(mesh)`` is what ``testbed simulate --program examples/predict/pmap_mlp.py:predict --topology T
--mesh batch=N`` calls: it returns the step (as ``testbed.runner.program.PmapStep``) and its arguments as
``jax.ShapeDtypeStruct`` s with the leading device dimension pmap maps over.
"""

import jax
import jax.numpy as jnp
from jax import lax

AXIS = "batch"
LEARNING_RATE = 0.05
#: The predicted size: a 3-layer MLP, 4096 -> 8192 -> 8192 -> 4096 in fp32, 256 rows per device.
SIZES = {"d_in": 4096, "d_hidden": 8192, "d_out": 4096, "rows": 256}


def init_params(d_in: int = 8, d_hidden: int = 16, d_out: int = 4) -> dict:
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return {"w1": jax.random.normal(k1, (d_in, d_hidden)) / d_in ** 0.5,
            "w2": jax.random.normal(k2, (d_hidden, d_hidden)) / d_hidden ** 0.5,
            "w3": jax.random.normal(k3, (d_hidden, d_out)) / d_hidden ** 0.5}


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ params["w1"])
    h = jax.nn.relu(h @ params["w2"])
    return jnp.mean((h @ params["w3"] - y) ** 2)


def train_step(params: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
    """One SGD step on this device's rows (under ``jax.pmap(..., axis_name="batch")``)."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    grads = lax.pmean(grads, axis_name=AXIS)
    params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return params, lax.pmean(loss, axis_name=AXIS)


def reference_step(params: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
    """The same step on one device over the whole batch."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), loss


def predict(mesh):
    """(step, args) for ``mesh`` (one axis: the devices pmap runs on)."""
    from testbed.runner.program import PmapStep

    n = mesh.size
    s = SIZES
    shapes = {"w1": (s["d_in"], s["d_hidden"]), "w2": (s["d_hidden"], s["d_hidden"]), "w3": (s["d_hidden"], s["d_out"])}
    params = {k: jax.ShapeDtypeStruct((n, *v), jnp.float32) for k, v in shapes.items()}
    x = jax.ShapeDtypeStruct((n, s["rows"], s["d_in"]), jnp.float32)
    y = jax.ShapeDtypeStruct((n, s["rows"], s["d_out"]), jnp.float32)
    return PmapStep(train_step, axis_name=AXIS), (params, x, y)
