"""Momentum SGD with the momentum sharded over "data" equals the one-device step, and the momentum stays sharded."""

import numpy as np
import pytest

from testbed.testing import assert_parallel_equal, assert_sharded

import zero


@pytest.mark.parametrize("data", [1, 2, 4, 6, 8])
def test_step_matches_reference_and_shards_the_momentum(mesh_factory, data):
    mesh = mesh_factory((data,), ("data",))
    rng = np.random.default_rng(data)
    x, y = rng.normal(size=(48, 24)).astype(np.float32), rng.normal(size=(48, 4)).astype(np.float32)
    params = zero.init_params()
    momentum = zero.init_momentum(params)
    step = zero.make_parallel_step(mesh)
    assert_parallel_equal(step, zero.reference_step, params, momentum, x, y, mesh=mesh, atol=1e-5)
    if data > 1:
        assert_sharded(step(params, momentum, x, y)[1], "data")
