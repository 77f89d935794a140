"""The pipeline equals the layers applied in turn, on 2, 4 and 8 stages: no bubble (NaN) leaks into the result."""

import numpy as np
import pytest

from testbed.testing import assert_parallel_equal

import my_pipeline


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 4), (8, 3)])
def test_pipeline_matches_reference(mesh_factory, stages, microbatches):
    mesh = mesh_factory((stages,), ("stage",))
    xs = np.random.default_rng(stages).normal(size=(microbatches, 2, 8)).astype(np.float32)
    assert_parallel_equal(my_pipeline.make_pipeline(mesh), my_pipeline.reference, my_pipeline.init_params(stages),
                          xs, rtol=1e-5, atol=1e-5, mesh=mesh)
