"""examples/: users' parallel JAX code tested with testbed.testing; each buggy twin is caught, with its reason.

The examples' own test files run as a user would run them (pytest in a subprocess, the testbed plugin
giving 8 emulated devices); the buggy twins run here, on conftest's 8 devices, and must fail with the
message that names the bug.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from testbed.testing import (assert_parallel_equal, assert_replicas_differ, assert_sharded, per_shard_reference,
                             replicate, shard_batch, unreplicate)

from helpers import CHILD_XLA_FLAGS

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DIRS = ("pmap_data_parallel", "shard_map_tensor_parallel", "pipeline_bubble", "batch_norm", "dropout",
        "shard_map_data_parallel", "batch_stats_step", "dropout_step", "grad_accumulation", "loss_normalisation",
        "all_gather_dim", "zero_optimizer")


@pytest.fixture(autouse=True)
def _example_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in DIRS:
        monkeypatch.syspath_prepend(str(EXAMPLES / name))


@pytest.mark.slow
def test_the_examples_own_tests_pass_under_the_plugin() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}  # as a user's shell
    # ... but for conftest's LLVM optimisation level 0 (no device count: the plugin must still set that; the code
    # path is the same with other flags present): these tiny programs' compiles are most of the run, 46 s -> 33 s.
    env["XLA_FLAGS"] = CHILD_XLA_FLAGS
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *DIRS],
                            cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "testbed: 8 emulated host devices requested for JAX (set)" in result.stdout
    assert " passed" in result.stdout and "skipped" not in result.stdout


def _pmapped(step, n: int):
    run = jax.pmap(step, axis_name="batch", devices=jax.devices()[:n])
    return lambda params, x, y: unreplicate(run(replicate(params, n), shard_batch(x, n), shard_batch(y, n)))


@pytest.mark.parametrize("n", [8, 4, 2])
def test_psum_instead_of_pmean_is_caught_and_names_the_factor(n: int) -> None:
    import dp_step
    import dp_step_buggy

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 4)).astype(np.float32), rng.normal(size=(24, 2)).astype(np.float32)
    assert_parallel_equal(_pmapped(dp_step.train_step, n), dp_step.reference_step, dp_step.init_params(), x, y,
                          atol=1e-5)
    with pytest.raises(AssertionError) as caught:
        assert_parallel_equal(_pmapped(dp_step_buggy.train_step, n), dp_step.reference_step, dp_step.init_params(),
                              x, y, atol=1e-5)
    message = str(caught.value)
    assert f"gradients scaled by {n}" in message and "psum where pmean was meant?" in message
    assert "leaf [0]['w']" in message and "args[0]['w']" in message
    if n == 8:
        assert "8 = the device count" in message


def test_wrong_reduction_axis_is_caught() -> None:
    import tp_mlp
    import tp_mlp_buggy

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    x = jax.random.normal(jax.random.key(0), (16, 8))
    assert_parallel_equal(tp_mlp.make_parallel_mlp(mesh), tp_mlp.mlp, tp_mlp.init_params(), x, mesh=mesh, atol=1e-5)
    with pytest.raises(AssertionError) as caught:
        assert_parallel_equal(tp_mlp_buggy.make_parallel_mlp(mesh), tp_mlp.mlp, tp_mlp.init_params(), x, mesh=mesh,
                              atol=1e-5)
    message = str(caught.value)
    assert re.search(r"leaf <root> \(shape \(16, 8\)\): \d+ of 128 elements differ", message)
    # Summed over 'data': the row blocks are all equal; not over 'model': the model ranks' copies differ.
    assert "blocks along dim 0 (split over mesh axis 'data') are all equal" in message
    assert "a psum/pmean over 'data' where another axis was meant?" in message
    assert "device copies along mesh axis 'model' differ" in message


def test_a_missing_psum_is_named_by_its_axis() -> None:
    import tp_mlp
    import tp_mlp_partial

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    x = jax.random.normal(jax.random.key(0), (16, 8))
    with pytest.raises(AssertionError, match=r"they sum to the reference -- partial sums: missing psum over 'model'\?"):
        assert_parallel_equal(tp_mlp_partial.make_parallel_mlp(mesh), tp_mlp.mlp, tp_mlp.init_params(), x,
                              mesh=mesh, atol=1e-5)


def test_per_device_statistics_are_named() -> None:
    import bn
    import bn_buggy

    mesh = jax.make_mesh((4,), ("data",))
    x = np.random.default_rng(0).normal(2.0, 3.0, size=(16, 3)).astype(np.float32)
    assert_parallel_equal(bn.make_parallel_bn(mesh), bn.batch_norm, x, mesh=mesh, atol=1e-5)
    with pytest.raises(AssertionError, match=r"matches the reference run on that shard alone: per-device statistics "
                                             r".* pmean over 'data'\?"):
        assert_parallel_equal(bn_buggy.make_parallel_bn(mesh), bn.batch_norm, x, mesh=mesh, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_per_device_statistics_within_bf16_tolerances_are_caught(dtype: str) -> None:
    """Shards alike: the buggy BatchNorm errs by ~1e-3, inside bf16 tolerances; the error's structure (the
    output is the reference run per shard; in fp32 for bf16 inputs) fails it, and the correct one passes."""
    import bn
    import bn_buggy
    import test_bn

    mesh = jax.make_mesh((4,), ("data",))
    x = test_bn.mixed_batch().astype(dtype)
    tol = dict(rtol=3e-2, atol=3e-2)  # bf16 code: its own rounding errs up to 1.5e-2 of |y| + 1
    assert_parallel_equal(bn.make_parallel_bn(mesh), bn.batch_norm, x, mesh=mesh, **tol)
    buggy, reference = (np.asarray(y, np.float64) for y in (bn_buggy.make_parallel_bn(mesh)(x), bn.batch_norm(x)))
    assert np.allclose(buggy, reference, **tol) and not np.array_equal(buggy, reference)  # only the structure tells
    with pytest.raises(AssertionError, match=r"within the tolerance, but its error is per-device statistics: .* "
                                             r"4 batch shards of mesh axis 'data' alone .* pmean over 'data'\?"):
        assert_parallel_equal(bn_buggy.make_parallel_bn(mesh), bn.batch_norm, x, mesh=mesh, **tol)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_an_unfolded_dropout_key_is_caught(make_key) -> None:
    import dropout
    import dropout_buggy

    mesh = jax.make_mesh((4,), ("data",))
    x = np.ones((8, 16), np.float32)
    reference = per_shard_reference(dropout.dropout, 4)
    assert_parallel_equal(dropout.make_parallel_dropout(mesh), reference, make_key(0), x, mesh=mesh)
    assert_replicas_differ(dropout.make_parallel_dropout(mesh), make_key(0), x, axis="data", mesh=mesh)
    buggy = dropout_buggy.make_parallel_dropout(mesh)
    with pytest.raises(AssertionError, match=r"fold_in\(key, jax.lax.axis_index\('data'\)\)"):
        assert_parallel_equal(buggy, reference, make_key(0), x, mesh=mesh)
    with pytest.raises(AssertionError, match=r"blocks 0 and 1 of 4 .* identical(.|\n)*fold_in\(key, "
                                             r"jax.lax.axis_index\('data'\)\)"):
        assert_replicas_differ(buggy, make_key(0), x, axis="data", mesh=mesh)


def test_a_second_reduction_under_check_vma_is_explained() -> None:
    import sgd
    import sgd_buggy

    mesh = jax.make_mesh((4,), ("data",))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32)
    assert_parallel_equal(sgd.make_parallel_step(mesh), sgd.reference_step, sgd.init_params(), x, y, mesh=mesh,
                          atol=1e-5)
    with pytest.raises(AssertionError) as caught:
        assert_parallel_equal(sgd_buggy.make_parallel_step(mesh), sgd.reference_step, sgd.init_params(), x, y,
                              mesh=mesh, atol=1e-5)
    message = str(caught.value)
    assert "gradients scaled by 4 (4 = mesh axis 'data'" in message and "a loss not averaged over 'data'" in message
    assert "JAX already sums the gradients of parameters replicated over 'data'" in message


def test_a_loss_summed_instead_of_averaged_is_named() -> None:
    import sgd
    import sgd_loss_summed

    mesh = jax.make_mesh((2,), ("data",))
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32)
    with pytest.raises(AssertionError, match=r"gradients scaled by 2 \(2 = mesh axis 'data'.*\): psum where pmean was "
                                             r"meant, or a loss not averaged over 'data'"):
        assert_parallel_equal(sgd_loss_summed.make_parallel_step(mesh), sgd.reference_step, sgd.init_params(), x, y,
                              mesh=mesh, atol=1e-5)


def test_a_bubble_leak_is_caught() -> None:
    import my_pipeline
    import my_pipeline_buggy

    mesh = jax.make_mesh((4,), ("stage",))
    xs = np.random.default_rng(0).normal(size=(4, 2, 8)).astype(np.float32)
    assert_parallel_equal(my_pipeline.make_pipeline(mesh), my_pipeline.reference, my_pipeline.init_params(4), xs,
                          mesh=mesh, atol=1e-5)
    with pytest.raises(AssertionError) as caught:
        assert_parallel_equal(my_pipeline_buggy.make_pipeline(mesh), my_pipeline.reference,
                              my_pipeline.init_params(4), xs, mesh=mesh, atol=1e-5)
    assert "NaN/inf" in str(caught.value) and "bubble" in str(caught.value)


def _rows(n: int, rows: int, features: int, outputs: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.normal(1.0, 2.0, size=(rows, features)).astype(np.float32),
            rng.normal(size=(rows, outputs)).astype(np.float32))


def _twin(name: str, n: int) -> tuple[object, object, object, tuple]:
    """(correct parallel function, buggy twin's, reference, arguments) of a classic bug on ``n`` data shards."""
    import accum
    import accum_buggy
    import bn_step
    import bn_step_buggy
    import dropout_step
    import dropout_step_buggy
    import gather
    import gather_buggy
    import global_norm
    import global_norm_buggy

    mesh = jax.make_mesh((n,), ("data",))
    if name == "batch_stats_step":
        return (bn_step.make_parallel_step(mesh), bn_step_buggy.make_parallel_step(mesh), bn_step.reference_step,
                (bn_step.init_params(), *_rows(n, 48, 4, 2)))
    if name == "dropout_step":
        return (dropout_step.make_parallel_step(mesh), dropout_step_buggy.make_parallel_step(mesh),
                dropout_step.make_reference_step(n), (dropout_step.init_params(), jax.random.key(0), *_rows(n, 48, 4, 2)))
    if name == "grad_accumulation":
        return (accum.make_parallel_step(mesh), accum_buggy.make_parallel_step(mesh), accum.reference_step,
                (accum.init_params(), *_rows(n, 72, 4, 2)))
    if name == "loss_normalisation":
        return (_pmapped(global_norm.train_step, n), _pmapped(global_norm_buggy.train_step, n),
                global_norm.reference_step, (global_norm.init_params(), *_rows(n, 48, 4, 2)))
    a, b = _rows(n, 48, 8, 8)
    return gather.make_parallel_loss(mesh), gather_buggy.make_parallel_loss(mesh), gather.contrastive_loss, (a, b)


#: What the diagnosis must say of each twin: the change that made it match, and the cause it names.
DIAGNOSED = {
    "batch_stats_step": r"statistics over dim 0 pmean-ed over 'data' -- batch statistics are per device: pmean them "
                        r"over 'data' \(the statistics over dim 0 at .*bn_step_buggy.py:10, .*bn_step_buggy.py:11",
    "dropout_step": r"keys folded with axis_index\('data'\) -- every shard draws the same random numbers from one key: "
                    r"fold each shard's key with its index, jax.random.fold_in\(key, jax.lax.axis_index\('data'\)\)",
    "grad_accumulation": r"the loss scaled by 3 -- the gradients of the 3 accumulated microbatches are averaged twice",
    "loss_normalisation": r"the psum at .*global_norm.py:\d+ as pmean -- .*the loss is normalised by the local batch "
                          r"instead of the global one",
    "all_gather_dim": r"the all_gather at .*gather_buggy.py:11 along dim 0 -- the all_gather over 'data' at "
                      r".*gather_buggy.py:11 gathers along dim 1 where dim 0 was meant",
}


def _check_twin(name: str, n: int, correct_too: bool = True) -> str:
    correct, buggy, reference, args = _twin(name, n)
    if correct_too:
        assert_parallel_equal(correct, reference, *args, atol=1e-5, diagnose=0)
    with pytest.raises(AssertionError) as caught:
        assert_parallel_equal(buggy, reference, *args, atol=1e-5)
    message = str(caught.value)
    assert re.search(r"diagnosis \(re-ran the parallel function with one change at a time; \d re-run\(s\)\): it "
                     r"matches the reference with " + DIAGNOSED[name], message), message
    return message


@pytest.mark.parametrize("name", sorted(DIAGNOSED))
def test_a_classic_bug_in_a_step_is_diagnosed_by_experiment(name: str) -> None:
    """On 8 data shards each buggy twin fails, and the re-run with one change names its cause; the correct passes."""
    _check_twin(name, 8)


@pytest.mark.slow
@pytest.mark.parametrize("n, first", [(2, 0), (6, 1)])
def test_the_classic_bugs_are_diagnosed_at_other_device_counts(n: int, first: int) -> None:
    """Every twin at one more count beside 8, the twins taking turns: 2 shards (the fewest) and 6 (no power of two)
    each diagnose every other twin (the correct versions pass at 2, 4 and 6 in the examples' own tests)."""
    for name in sorted(DIAGNOSED)[first::2]:
        _check_twin(name, n, correct_too=False)


def test_an_unsharded_optimizer_state_is_named() -> None:
    import zero
    import zero_buggy

    mesh = jax.make_mesh((8,), ("data",))
    x, y = _rows(8, 48, 24, 4)
    params = zero.init_params()
    momentum = zero.init_momentum(params)
    for module in (zero, zero_buggy):  # equal numbers either way: only the layout tells
        assert_parallel_equal(module.make_parallel_step(mesh), zero.reference_step, params, momentum, x, y,
                              mesh=mesh, atol=1e-5)
    assert_sharded(zero.make_parallel_step(mesh)(params, momentum, x, y)[1], "data")
    with pytest.raises(AssertionError, match=r"leaf \['w'\] \(shape \(24, 4\), 384 bytes\) is not split over 'data': it "
                                             r"is replicated over mesh axis 'data' .* 384 bytes of it where 48 were "
                                             r"meant\n  hint: optimizer state left unsharded"):
        assert_sharded(zero_buggy.make_parallel_step(mesh)(params, momentum, x, y)[1], "data")
