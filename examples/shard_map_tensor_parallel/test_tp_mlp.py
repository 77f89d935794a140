"""The tensor-parallel MLP equals the single-device MLP on every mesh of 8 devices and any valid batch."""

import jax
import pytest
from hypothesis import given, settings

from testbed.testing import assert_parallel_equal
from testbed.testing.strategies import batches, meshes

import tp_mlp


@pytest.mark.parametrize("shape", [(1, 8), (2, 4), (4, 2), (8, 1), (1, 1)])
def test_mlp_matches_reference(mesh_factory, shape):
    mesh = mesh_factory(shape, ("data", "model"))
    x = jax.random.normal(jax.random.key(0), (16, 8))
    assert_parallel_equal(tp_mlp.make_parallel_mlp(mesh), tp_mlp.mlp, tp_mlp.init_params(), x,
                          rtol=1e-5, atol=1e-5, mesh=mesh)


@settings(max_examples=5, deadline=None)
@given(mesh=meshes(8, ("data", "model")), x=batches(8, (8,)))
def test_mlp_matches_reference_on_any_mesh(testbed_devices, mesh, x):
    assert_parallel_equal(tp_mlp.make_parallel_mlp(mesh), tp_mlp.mlp, tp_mlp.init_params(), x,
                          rtol=1e-5, atol=1e-5, mesh=mesh)
