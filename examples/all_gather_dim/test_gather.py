"""The contrastive loss with the batch gathered from every data shard equals the one-device loss."""

import numpy as np
import pytest

from testbed.testing import assert_parallel_equal

import gather


@pytest.mark.parametrize("data", [1, 2, 4, 6, 8])
def test_loss_matches_reference(mesh_factory, data):
    mesh = mesh_factory((data,), ("data",))
    rng = np.random.default_rng(data)
    a, b = rng.normal(size=(48, 8)).astype(np.float32), rng.normal(size=(48, 8)).astype(np.float32)
    assert_parallel_equal(gather.make_parallel_loss(mesh), gather.contrastive_loss, a, b, mesh=mesh, atol=1e-5)
