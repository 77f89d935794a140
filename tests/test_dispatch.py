"""testbed.model.buffers's array counts equal what the runner's programs take and return.

The simulator prices the single controller per device buffer it dispatches
(testbed.model.buffers); the counts come from the runner's parameter layout and
the residuals ``jax.vjp`` keeps, so they are checked here against the
runner's own pytrees for every remat mode, first/middle/last chunks, tied
embeddings and both precisions (bf16-mixed's optimizer state also holds the
fp32 master).
"""

from __future__ import annotations

import jax
import pytest

from testbed.runner import devices as dev
from testbed.runner.pipeline import engine
from testbed.runner.train import build_trainer
from testbed.model import buffers
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan


def _plan(remat: str, layers: int = 6, stage: int = 3, tied: bool = False, precision: str = "fp32") -> Plan:
    return Plan(model=ModelSpec(layers=layers, d_model=16, heads=4, d_ff=32, seq_len=8, vocab=32,
                                tied_embeddings=tied),
                batch=BatchSpec(global_batch=6, microbatches=3), mesh=MeshSpec(stage=stage), remat=remat,
                precision=precision, name="d")


@pytest.mark.parametrize("remat, precision", [("none", "fp32"), ("selective", "fp32"), ("full", "fp32"),
                                              ("none", "bf16-mixed")])
def test_parameter_and_residual_arrays_match_the_runner(remat: str, precision: str) -> None:
    plan = _plan(remat, precision=precision)
    trainer = build_trainer(plan, dev.select_devices(plan.mesh.size))
    params, states = trainer.init()
    sch, last = trainer.schedule, trainer.schedule.chunks - 1
    for s in range(plan.mesh.stage):
        sh = trainer.act_shardings[s]
        ids = jax.ShapeDtypeStruct(trainer.act_shape[:2], jax.numpy.int32, sharding=sh)
        x = ids if s == 0 else jax.ShapeDtypeStruct(trainer.act_shape, trainer.act_dtype, sharding=sh)
        targets = ids if s == last else None
        _, stored = jax.eval_shape(
            lambda p, h, t, s=s: engine._forward(trainer.chunk_forward, trainer.loss_fn, trainer.prepare[s], s, 0,
                                                   s == 0, s == last, p, h, t), params[s][0], x, targets)
        assert len(jax.tree.leaves(params[s][0])) == buffers.chunk_param_arrays(plan, s, 0)
        assert len(jax.tree.leaves(stored)) == buffers.chunk_residual_arrays(plan, s, 0)
        # The update takes parameters, optimizer state and gradients; returns parameters and state.
        state = len(jax.tree.leaves(params[s])) + len(jax.tree.leaves(states[s]))
        assert buffers.update_buffers(plan, s) == (2 * state + len(jax.tree.leaves(params[s]))) * 1


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_tied_head_has_no_projection_and_spmd_step_counts_its_state(precision: str) -> None:
    tied = Plan(model=ModelSpec(layers=2, d_model=16, heads=4, d_ff=32, seq_len=8, vocab=32, tied_embeddings=True),
                batch=BatchSpec(global_batch=4, microbatches=1), mesh=MeshSpec(data=2), precision=precision,
                name="t")
    params = buffers.chunk_param_arrays(tied, 0, 0)
    assert params == 2 * buffers.PARAM_ARRAYS_PER_LAYER + 2 + 2
    trainer = build_trainer(tied, dev.select_devices(2))
    p, o = trainer.init()
    state = len(jax.tree.leaves(p)) + len(jax.tree.leaves(o))
    assert len(jax.tree.leaves(p)) == params
    assert buffers.spmd_step_buffers(tied) == (2 * state + 3) * 2
