"""A training step through BatchNorm with statistics over the whole data-parallel batch equals the one-device step."""

import numpy as np
import pytest

from testbed.testing import assert_parallel_equal

import bn_step


@pytest.mark.parametrize("data", [1, 2, 4, 6, 8])
def test_step_matches_reference(mesh_factory, data):
    mesh = mesh_factory((data,), ("data",))
    rng = np.random.default_rng(data)
    x = rng.normal(1.0, 2.0, size=(48, 4)).astype(np.float32)  # 48 rows: divisible by 1, 2, 4, 6, 8
    y = rng.normal(size=(48, 2)).astype(np.float32)
    assert_parallel_equal(bn_step.make_parallel_step(mesh), bn_step.reference_step, bn_step.init_params(), x, y,
                          mesh=mesh, atol=1e-5)
