"""examples/predict: each user step is correct on emulated devices (the testing kit) before it is predicted."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from testbed.testing import assert_parallel_equal, replicate, shard_batch, unreplicate

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(autouse=True)
def _example_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES / "predict"))


def test_the_pmap_mlp_equals_its_single_device_step(testbed_devices) -> None:
    import pmap_mlp

    n = 8
    pmapped = jax.pmap(pmap_mlp.train_step, axis_name="batch", devices=testbed_devices[:n])

    def parallel(params, x, y):
        return unreplicate(pmapped(replicate(params, n), shard_batch(x, n), shard_batch(y, n)))

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 8)).astype(np.float32), rng.normal(size=(32, 4)).astype(np.float32)
    assert_parallel_equal(parallel, pmap_mlp.reference_step, pmap_mlp.init_params(), x, y, rtol=1e-5, atol=1e-5)


def test_the_shard_map_mlp_equals_its_single_device_step(testbed_devices) -> None:
    import shard_map_mlp

    mesh = jax.sharding.Mesh(np.array(testbed_devices[:8]).reshape(2, 4), ("data", "model"))
    step = shard_map_mlp.make_step(mesh)

    def parallel(params, x, y):
        args = (params["w1"], params["w2"], x, y)
        return step(*(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, shard_map_mlp.SPECS)))

    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16, 8)).astype(np.float32)
    assert_parallel_equal(parallel, shard_map_mlp.reference_step, shard_map_mlp.init_params(), x, y,
                          rtol=1e-5, atol=1e-5)


def test_the_cnn_trained_data_parallel_equals_its_single_device_step(testbed_devices) -> None:
    import vision_cnn

    mesh = jax.sharding.Mesh(np.array(testbed_devices[:8]), ("data",))
    step = vision_cnn.make_step(mesh)
    rng = np.random.default_rng(2)
    images = rng.normal(size=(16, 8, 8, 3)).astype(np.float32)
    labels = rng.integers(0, 3, size=(16,)).astype(np.int32)
    assert_parallel_equal(step, jax.jit(vision_cnn.train_step), vision_cnn.init_params(), images, labels,
                          rtol=1e-4, atol=1e-5)
