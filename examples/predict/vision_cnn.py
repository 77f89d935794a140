"""A small convolutional network (plain JAX) trained data-parallel with ``jax.jit`` and ``NamedSharding``.

Two 3x3 convolutions (ReLU), global average pooling and a linear classifier, cross-entropy loss and SGD.
The batch is sharded over the mesh's "data" axis and the parameters replicated: XLA (here Shardy)
inserts the gradient all-reduces.
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

LEARNING_RATE = 0.05
#: The predicted size: 224x224 RGB images, 64 and 128 channels, 1000 classes, 32 images per device, bf16.
SIZES = {"image": 224, "channels": (64, 128), "classes": 1000, "per_device": 32}


def init_params(channels: tuple[int, int] = (4, 8), classes: int = 3) -> dict:
    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    c1, c2 = channels
    return {"conv1": jax.random.normal(k1, (3, 3, 3, c1)) / 27 ** 0.5,
            "conv2": jax.random.normal(k2, (3, 3, c1, c2)) / (9 * c1) ** 0.5,
            "dense": jax.random.normal(k3, (c2, classes)) / c2 ** 0.5}


def _conv(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.conv_general_dilated(x, w, window_strides=(1, 1), padding="SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def loss_fn(params: dict, images: jax.Array, labels: jax.Array) -> jax.Array:
    h = jax.nn.relu(_conv(images, params["conv1"]))
    h = jax.nn.relu(_conv(h, params["conv2"]))
    logits = h.mean(axis=(1, 2)) @ params["dense"]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(labels, logits.shape[-1]), axis=-1))


def train_step(params: dict, images: jax.Array, labels: jax.Array) -> tuple[dict, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), loss


def make_step(mesh):
    """``train_step`` jitted over ``mesh``: the batch split over "data", parameters replicated."""
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    return jax.jit(train_step, in_shardings=(replicated, batch, batch), out_shardings=(replicated, replicated))


def predict(mesh):
    """(step, args) for ``mesh`` (an axis "data"; other axes replicate)."""
    s = SIZES
    batch = dict(zip(mesh.axis_names, mesh.axis_sizes))["data"] * s["per_device"]
    params = jax.eval_shape(lambda: init_params(s["channels"], s["classes"]))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=replicated), params)
    images = jax.ShapeDtypeStruct((batch, s["image"], s["image"], 3), jnp.bfloat16, sharding=sharded)
    labels = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=sharded)
    return make_step(mesh), (params, images, labels)
