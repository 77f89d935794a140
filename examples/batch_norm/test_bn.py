"""BatchNorm with statistics over the whole data-parallel batch equals the single-device BatchNorm."""

import jax.numpy as jnp
import numpy as np
import pytest

from testbed.testing import assert_parallel_equal

import bn


@pytest.mark.parametrize("data", [1, 2, 4])
def test_batch_norm_matches_reference(mesh_factory, data):
    mesh = mesh_factory((data,), ("data",))
    x = np.random.default_rng(0).normal(2.0, 3.0, size=(16, 3)).astype(np.float32)
    assert_parallel_equal(bn.make_parallel_bn(mesh), bn.batch_norm, x, mesh=mesh, rtol=1e-5, atol=1e-5)


def mixed_batch(rows: int = 64, features: int = 8) -> np.ndarray:
    """A batch whose shards are alike (each a shuffled copy of one block, slightly perturbed): per-device
    statistics then err by only ~1e-3, inside bf16 tolerances."""
    rng = np.random.default_rng(1)
    block = rng.normal(2.0, 3.0, size=(rows // 4, features))
    copies = [block[rng.permutation(len(block))] for _ in range(4)]
    return (np.concatenate(copies) + 1e-3 * rng.normal(size=(rows, features))).astype(np.float32)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_batch_norm_matches_reference_at_bf16_tolerances(mesh_factory, dtype):
    # rtol/atol 3e-2: what this bf16 code is compared at (its own rounding errs up to 1.5e-2). The kit also
    # checks the error's structure, so the per-device-statistics twin fails here though within the tolerance.
    mesh = mesh_factory((4,), ("data",))
    x = mixed_batch().astype(dtype)
    assert_parallel_equal(bn.make_parallel_bn(mesh), bn.batch_norm, x, mesh=mesh, rtol=3e-2, atol=3e-2)
