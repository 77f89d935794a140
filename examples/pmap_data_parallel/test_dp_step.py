"""The data-parallel step equals the single-device step on 1 to 8 devices (testbed's pytest plugin gives 8)."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from testbed.testing import assert_parallel_equal, replicate, shard_batch, unreplicate
from testbed.testing.strategies import batches

import dp_step


def parallel(step, devices):
    n = len(devices)
    pmapped = jax.pmap(step, axis_name="batch", devices=devices)

    def run(params, x, y):
        return unreplicate(pmapped(replicate(params, n), shard_batch(x, n), shard_batch(y, n)))

    return run


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_step_matches_reference(testbed_devices, n):
    rng = np.random.default_rng(n)
    x = rng.normal(size=(8 * 3, 4)).astype(np.float32)  # 24 rows: divisible by 1, 2, 3, 4, 8
    y = rng.normal(size=(8 * 3, 2)).astype(np.float32)
    assert_parallel_equal(parallel(dp_step.train_step, testbed_devices[:n]), dp_step.reference_step,
                          dp_step.init_params(), x, y, rtol=1e-5, atol=1e-5)


@settings(max_examples=5, deadline=None)
@given(n=st.sampled_from([2, 4, 8]), data=st.data())
def test_step_matches_reference_on_any_batch(testbed_devices, n, data):
    rows = data.draw(batches(n, (6,)))  # a batch divisible by n: 4 input features, 2 targets
    x, y = rows[:, :4], rows[:, 4:]
    assert_parallel_equal(parallel(dp_step.train_step, testbed_devices[:n]), dp_step.reference_step,
                          dp_step.init_params(), x, y, rtol=1e-5, atol=1e-5)
