"""BatchNorm with statistics over the whole data-parallel batch equals the single-device BatchNorm."""

import numpy as np
import pytest

from testbed.testing import assert_parallel_equal

import bn


@pytest.mark.parametrize("data", [1, 2, 4])
def test_batch_norm_matches_reference(mesh_factory, data):
    mesh = mesh_factory((data,), ("data",))
    x = np.random.default_rng(0).normal(2.0, 3.0, size=(16, 3)).astype(np.float32)
    assert_parallel_equal(bn.make_parallel_bn(mesh), bn.batch_norm, x, mesh=mesh, rtol=1e-5, atol=1e-5)
