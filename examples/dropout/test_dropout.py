"""Dropout on 4 data shards: each shard matches the reference run with its own key, and the masks differ."""

import jax
import numpy as np
import pytest

from testbed.testing import assert_parallel_equal, assert_replicas_differ, per_shard_reference

import dropout


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_each_shard_draws_its_own_mask(mesh_factory, make_key):
    mesh = mesh_factory((4,), ("data",))
    x = np.ones((8, 16), np.float32)          # equal rows: only the masks can tell the shards apart
    parallel = dropout.make_parallel_dropout(mesh)
    assert_parallel_equal(parallel, per_shard_reference(dropout.dropout, 4), make_key(0), x, mesh=mesh)
    assert_replicas_differ(parallel, make_key(0), x, axis="data", mesh=mesh)
