"""A training step with dropout on each data shard equals the one-device step drawing the same per-shard masks."""

import jax
import numpy as np
import pytest

from testbed.testing import assert_parallel_equal

import dropout_step


@pytest.mark.parametrize("data", [1, 2, 4, 6, 8])
def test_step_matches_reference(mesh_factory, data):
    mesh = mesh_factory((data,), ("data",))
    rng = np.random.default_rng(data)
    x, y = rng.normal(size=(48, 4)).astype(np.float32), rng.normal(size=(48, 2)).astype(np.float32)
    assert_parallel_equal(dropout_step.make_parallel_step(mesh), dropout_step.make_reference_step(data),
                          dropout_step.init_params(), jax.random.key(0), x, y, mesh=mesh, atol=1e-5)
