"""The kit on one device: what holds on a single accelerator chip (a TPU v5e), the mode it runs in there.

One device cannot emulate a mesh, so here the examples run on a one-device mesh against the single-device
reference, with the tolerances the backend's matmul precision sets (left unset: on a TPU the kit derives them
from its bf16 passes; on CPU they are float32's 1e-5/1e-6); the bugs that do not depend on the shard count
are still diagnosed by experiment, and the backend's own default-precision matmul is checked against the
bound the kit assumes for it. Runs in the normal suite (on the first of 8 CPU devices) and alone with
``TESTBED_TEST_DEVICES=1`` (one CPU device), or on a chip with ``JAX_PLATFORMS=tpu`` (docs/testing.md).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from testbed.testing import (assert_parallel_equal, assert_sharded, matmul_precision, per_shard_reference, replicate,
                             shard_batch, unreplicate)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DIRS = ("pmap_data_parallel", "shard_map_tensor_parallel", "batch_norm", "dropout", "shard_map_data_parallel",
        "batch_stats_step", "dropout_step", "grad_accumulation", "loss_normalisation", "all_gather_dim",
        "zero_optimizer")


@pytest.fixture(autouse=True)
def _example_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in DIRS:
        monkeypatch.syspath_prepend(str(EXAMPLES / name))


def _mesh(*names: str):
    return jax.make_mesh((1,) * len(names), names, devices=jax.devices()[:1])


def _pmapped(step):
    run = jax.pmap(step, axis_name="batch", devices=jax.devices()[:1])
    return lambda *a: unreplicate(run(*(replicate(x, 1) if i == 0 else shard_batch(x, 1) for i, x in enumerate(a))))


def _rows(rows: int, features: int, outputs: int):
    rng = np.random.default_rng(0)
    return (rng.normal(1.0, 2.0, size=(rows, features)).astype(np.float32),
            rng.normal(size=(rows, outputs)).astype(np.float32))


def _case(name: str):
    """(parallel function on one device, reference, arguments) for each example that runs on one device."""
    import accum, bn, bn_step, dp_step, dropout, dropout_step, gather, global_norm, sgd, tp_mlp, zero  # noqa: E401

    data = _mesh("data")
    x, y = _rows(24, 4, 2)
    cases = {
        "pmap_data_parallel": lambda: (_pmapped(dp_step.train_step), dp_step.reference_step, (dp_step.init_params(), x, y)),
        "shard_map_tensor_parallel": lambda: (tp_mlp.make_parallel_mlp(_mesh("data", "model")), tp_mlp.mlp,
                                              (tp_mlp.init_params(), _rows(16, 8, 1)[0])),
        "batch_norm": lambda: (bn.make_parallel_bn(data), bn.batch_norm, (_rows(16, 3, 1)[0],)),
        "dropout": lambda: (dropout.make_parallel_dropout(data), per_shard_reference(dropout.dropout, 1),
                            (jax.random.key(0), np.ones((8, 16), np.float32))),
        "shard_map_data_parallel": lambda: (sgd.make_parallel_step(data), sgd.reference_step, (sgd.init_params(), x, y)),
        "batch_stats_step": lambda: (bn_step.make_parallel_step(data), bn_step.reference_step, (bn_step.init_params(), x, y)),
        "dropout_step": lambda: (dropout_step.make_parallel_step(data), dropout_step.make_reference_step(1),
                                 (dropout_step.init_params(), jax.random.key(0), x, y)),
        "grad_accumulation": lambda: (accum.make_parallel_step(data), accum.reference_step, (accum.init_params(), x, y)),
        "loss_normalisation": lambda: (_pmapped(global_norm.train_step), global_norm.reference_step,
                                       (global_norm.init_params(), x, y)),
        "all_gather_dim": lambda: (gather.make_parallel_loss(data), gather.contrastive_loss, _rows(24, 8, 8)),
        "zero_optimizer": lambda: (zero.make_parallel_step(data), zero.reference_step,
                                   (zero.init_params(), zero.init_momentum(zero.init_params()), *_rows(24, 24, 4))),
    }
    return cases[name]()


@pytest.mark.parametrize("name", DIRS)
def test_each_example_equals_its_reference_on_a_one_device_mesh(name: str) -> None:
    parallel, reference, args = _case(name)
    assert_parallel_equal(parallel, reference, *args)  # tolerances from the backend's matmul precision


def test_a_bug_that_needs_no_second_shard_is_diagnosed_on_one_device() -> None:
    import accum
    import accum_buggy

    x, y = _rows(24, 4, 2)
    with pytest.raises(AssertionError, match=r"it matches the reference with the loss scaled by 3 -- the gradients of "
                                             r"the 3 accumulated microbatches are averaged twice"):
        assert_parallel_equal(accum_buggy.make_parallel_step(_mesh("data")), accum.reference_step,
                              accum.init_params(), x, y)


def test_state_on_a_one_device_axis_counts_as_sharded() -> None:
    import zero

    params = zero.init_params()
    out = zero.make_parallel_step(_mesh("data"))(params, zero.init_momentum(params), *_rows(24, 24, 4))
    assert_sharded(out[1], "data")


@pytest.mark.parametrize("k", [64, 1024])
def test_the_backends_default_matmul_is_within_the_bound_the_kit_assumes(k: int) -> None:
    """On a TPU the default float32 matmul is one bf16 pass: its error against float64 must stay within the
    bound for u = 2^-8; on CPU, float32's (u32 = 2^-24, summation alone)."""
    rng = np.random.default_rng(k)
    a, b = rng.normal(size=(64, k)).astype(np.float32), rng.normal(size=(k, 32)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    got = np.asarray(jax.jit(jnp.matmul)(a, b), np.float64)
    assert (np.abs(got - exact) / scale).max() <= matmul_precision().bound(k)


def test_a_default_precision_step_passes_at_the_kits_tolerances_and_tight_ones_are_explained() -> None:
    rng = np.random.default_rng(2)
    w, x = rng.normal(size=(256, 16)).astype(np.float32), rng.normal(size=(32, 256)).astype(np.float32)
    step = jax.jit(lambda w, x: jnp.tanh(x @ w))
    reference = lambda w, x: jnp.tanh(jnp.matmul(x, w, precision="highest"))  # noqa: E731
    assert_parallel_equal(step, reference, w, x)
    if matmul_precision().reduced:  # a TPU or GPU: float32 tolerances cannot hold, and the message says why
        with pytest.raises(AssertionError, match=r"within precision: every difference is"):
            assert_parallel_equal(step, reference, w, x, rtol=1e-6, atol=1e-7)
