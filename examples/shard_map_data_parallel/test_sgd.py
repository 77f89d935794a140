"""The shard_map SGD step equals the single-device step on 1, 2 and 4 data shards."""

import numpy as np
import pytest

from testbed.testing import assert_parallel_equal

import sgd


@pytest.mark.parametrize("data", [1, 2, 4])
def test_step_matches_reference(mesh_factory, data):
    mesh = mesh_factory((data,), ("data",))
    rng = np.random.default_rng(data)
    x, y = rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32)
    assert_parallel_equal(sgd.make_parallel_step(mesh), sgd.reference_step, sgd.init_params(), x, y,
                          mesh=mesh, atol=1e-5)
