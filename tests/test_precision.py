"""bf16-mixed holds what docs/plan-format.md and testbed.model.memory say: bf16 params and grads, fp32 master + moments.

The trainers hold bf16 parameters, their gradients (and the accumulators
across microbatches) are bf16, and the optimizer state holds the fp32 master
sharded exactly like the moments (ZeRO-1 over data shards it where the
parameters are replicated). The update runs on the master, so steps below
bf16's spacing are not lost, and verify still matches the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from testbed.runner import devices as dev
from testbed.runner import model
from testbed.runner.train import build_trainer, verify_plan
from testbed.runner.precision import MasterState, Optimizer
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, OptimizerSpec, Plan

MODEL = ModelSpec(layers=4, d_model=16, heads=4, d_ff=32, seq_len=8, vocab=32)


def _plan(precision: str = "bf16-mixed", zero: int = 1, microbatches: int = 2, **mesh: int) -> Plan:
    # test_runner's global batch: the single-device reference step compiles once for these files.
    return Plan(model=MODEL, batch=BatchSpec(global_batch=48, microbatches=microbatches), mesh=MeshSpec(**mesh),
                zero=zero, precision=precision, name="precision")


def _stage_states(trainer, state) -> list[tuple]:
    """(params, optimizer state, optimizer shardings) per stage (one entry for an SPMD trainer)."""
    params, states = state
    if isinstance(params, list):
        return list(zip(params, states, trainer.opt_shardings))
    return [(params, states, trainer.opt_shardings)]


@pytest.mark.parametrize("mesh", [dict(data=4), dict(data=2, tensor=2, stage=2)], ids=["spmd-dp4", "pp2-dp2-tp2"])
def test_bf16_params_and_an_fp32_master_sharded_like_the_moments(mesh: dict) -> None:
    plan = _plan(**mesh)
    trainer = build_trainer(plan, dev.select_devices(plan.mesh.size))
    state = trainer.init()
    for params, opt_state, shardings in _stage_states(trainer, state):
        assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
        assert isinstance(opt_state, MasterState) and isinstance(shardings, MasterState)
        master, moments = opt_state.master, opt_state.inner[0].mu
        assert {leaf.dtype for leaf in jax.tree.leaves(master)} == {jnp.dtype(jnp.float32)}
        # The master's shardings are the moments', leaf by leaf (the trainer's chosen ones and the arrays').
        for m, mu, m_sh, mu_sh in zip(jax.tree.leaves(master), jax.tree.leaves(moments),
                                      jax.tree.leaves(shardings.master), jax.tree.leaves(shardings.inner[0].mu)):
            assert m_sh == mu_sh and m.sharding.is_equivalent_to(mu.sharding, m.ndim)
        # ZeRO-1: the largest matrix's master is split over data, its bf16 parameter is not.
        big = max(range(len(jax.tree.leaves(params))), key=lambda i: jax.tree.leaves(params)[i].size)
        assert "data" in str(jax.tree.leaves(master)[big].sharding.spec)
        assert "data" not in str(jax.tree.leaves(params)[big].sharding.spec)
    # full_params is the fp32 master: before any step, exactly the fp32 initial parameters.
    full = trainer.full_params(state)
    expected = jax.tree.map(np.asarray, model.init_params(plan.model, plan.seed))
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(expected)):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, b)


def test_spmd_gradients_are_bf16_and_the_step_keeps_bf16_params() -> None:
    plan = _plan(data=2)
    trainer = build_trainer(plan, dev.select_devices(2), return_grads=True)
    (params, opt_state), _ = trainer.step(trainer.init(), 0)
    assert {g.dtype for g in jax.tree.leaves(trainer.last_grads)} == {jnp.dtype(jnp.bfloat16)}
    assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    assert isinstance(opt_state, MasterState)


def test_fp32_keeps_plain_optax_state() -> None:
    optimizer = Optimizer(_plan(precision="fp32"))
    params = {"w": jnp.ones((3,), jnp.float32)}
    assert optimizer.held(params) is params and not isinstance(optimizer.init(params), MasterState)


@pytest.mark.quick  # make test-quick's test of this module
def test_master_keeps_updates_below_bf16_spacing() -> None:
    """Adam moves a weight at 1.0 by lr = 1e-3 a step, under bf16's spacing (2^-8) there: only a master keeps it."""
    plan = Plan(model=MODEL, batch=BatchSpec(global_batch=2), precision="bf16-mixed",
                optimizer=OptimizerSpec(name="adam", learning_rate=1e-3), name="master")
    optimizer = Optimizer(plan)
    full = {"scale": jnp.ones((4,), jnp.float32)}
    params, state = optimizer.held(full), optimizer.init(full)
    grads = {"scale": jnp.ones((4,), jnp.bfloat16)}
    naive, naive_state = params, optimizer.tx.init(params)
    update = jax.jit(optimizer.update)
    for _ in range(3):
        params, state = update(params, state, grads)
        u, naive_state = optimizer.tx.update(grads, naive_state, naive)
        naive = optax.apply_updates(naive, u)
    np.testing.assert_allclose(optimizer.master(params, state)["scale"], 1.0 - 3e-3, rtol=1e-6)
    assert params["scale"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(naive["scale"], np.float32), 1.0)  # what the master avoids


def test_verify_bf16_zero1_pipeline_matches_the_reference() -> None:
    """The layout of plans/validation/mix-zero1-dp2-tp2-pp2-bf16.yaml, on a small GPT."""
    plan = _plan(data=2, tensor=2, stage=2, microbatches=4)
    result = verify_plan(plan, dev.select_devices(8), steps=2, check_hlo=True)
    tol, errors = result["thresholds"], result["errors"]
    assert max(errors["loss_rel"]) <= tol["loss"] and max(errors["grad_rel"]) <= tol["grads"], errors
    assert errors["param_steps"] <= tol["param_steps"], errors
    assert result["ok"], result
