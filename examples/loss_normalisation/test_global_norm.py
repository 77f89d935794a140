"""A loss normalised by the global batch, its gradients psum-ed under pmap, equals the one-device step."""

import jax
import numpy as np
import pytest

from testbed.testing import assert_parallel_equal, replicate, shard_batch, unreplicate

import global_norm


def pmapped(step, devices):
    n = len(devices)
    run = jax.pmap(step, axis_name="batch", devices=devices)
    return lambda params, x, y: unreplicate(run(replicate(params, n), shard_batch(x, n), shard_batch(y, n)))


@pytest.mark.parametrize("n", [1, 2, 4, 6, 8])
def test_step_matches_reference(testbed_devices, n):
    rng = np.random.default_rng(n)
    x, y = rng.normal(size=(48, 4)).astype(np.float32), rng.normal(size=(48, 2)).astype(np.float32)
    assert_parallel_equal(pmapped(global_norm.train_step, testbed_devices[:n]), global_norm.reference_step,
                          global_norm.init_params(), x, y, atol=1e-5)
