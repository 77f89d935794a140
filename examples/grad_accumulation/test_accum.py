"""Gradients accumulated over 3 microbatches on each data shard equal the one-device gradient of the batch."""

import numpy as np
import pytest

from testbed.testing import assert_parallel_equal

import accum


@pytest.mark.parametrize("data", [1, 2, 4, 6, 8])
def test_step_matches_reference(mesh_factory, data):
    mesh = mesh_factory((data,), ("data",))
    rng = np.random.default_rng(data)
    x = rng.normal(size=(72, 4)).astype(np.float32)  # 72 rows: 3 microbatches on 1, 2, 4, 6 or 8 shards
    y = rng.normal(size=(72, 2)).astype(np.float32)
    assert_parallel_equal(accum.make_parallel_step(mesh), accum.reference_step, accum.init_params(), x, y,
                          mesh=mesh, atol=1e-5)
