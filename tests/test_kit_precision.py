"""Precision-aware comparison: the backend's matmul precision, the bound it implies, and the messages.

A TPU's default float32 matmul is one bf16 pass, a recent GPU's tf32 (JAX docs, "Matmul precision"); the
backend is simulated here by name, and the bf16 pass by casting the inputs to bf16 with fp32 accumulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from testbed.testing import assert_parallel_equal, matmul_precision
from testbed.testing.precision import MatmulPrecision, resolve_tolerance


def _bf16_pass(a, b):
    """A float32 matmul as a TPU's default precision computes it: inputs rounded to bf16, products summed in fp32."""
    return jnp.matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def _highest(a, b):
    return jnp.matmul(a, b, precision="highest")


def test_the_backends_precision_table() -> None:
    assert matmul_precision("tpu").bits == 8 and matmul_precision("tpu", "high").bits == 16
    assert matmul_precision("tpu", "highest").bits == matmul_precision("tpu", "float32").bits == 24
    assert matmul_precision("gpu").bits == matmul_precision("cuda", "tensorfloat32").bits == 11
    assert matmul_precision("cpu").bits == 24 and not matmul_precision("cpu").reduced
    with jax.default_matmul_precision("highest"):
        assert matmul_precision("tpu").bits == 24
    assert matmul_precision("cpu", args=[np.ones(2, jnp.bfloat16)]).bits == 8  # bf16 arguments: their own
    assert matmul_precision("cpu", args=[np.ones(2, np.float16)]).bits == 11
    with pytest.raises(ValueError, match="backend must be one of"):
        matmul_precision("ipu")
    with pytest.raises(ValueError, match="is not one of"):
        matmul_precision("tpu", "quadruple")
    with pytest.raises(ValueError, match="bits must be"):
        MatmulPrecision(backend="tpu", setting="default", bits=40)


def test_the_bound_is_higham_s_with_bf16_inputs() -> None:
    u, u32, k = 2.0 ** -8, 2.0 ** -24, 256
    gamma = k * u32 / (1 - k * u32)
    tpu = matmul_precision("tpu")
    assert tpu.bound(k) == pytest.approx(2 * u + u * u + gamma, rel=1e-12)
    assert tpu.tolerance(k, depth=3) == pytest.approx(6 * (2 * u + u * u + gamma), rel=1e-12)
    assert matmul_precision("cpu").bound(k) == pytest.approx(gamma, rel=1e-12)  # fp32 inputs are not rounded
    tol = resolve_tolerance(None, None, "tpu", None, 1, [np.ones((16, 64), np.float32)])
    assert tol.auto and tol.contraction == 64 and tol.rtol == tol.scale == pytest.approx(tpu.tolerance(64))
    kept = resolve_tolerance(1e-5, 1e-6, "tpu", None, 1, [np.ones((16, 64), np.float32)])
    assert not kept.auto and (kept.rtol, kept.atol, kept.scale) == (1e-5, 1e-6, 0.0)
    cpu = resolve_tolerance(None, None, "cpu", None, 1, [np.ones((16, 64), np.float32)])
    assert (cpu.rtol, cpu.atol, cpu.auto) == (1e-5, 1e-6, False)  # float32 matmuls: the usual defaults


@pytest.mark.parametrize("k", [8, 256, 4096])
def test_a_bf16_pass_stays_within_the_bound_and_near_it(k: int) -> None:
    rng = np.random.default_rng(k)
    a, b = rng.normal(size=(32, k)).astype(np.float32), rng.normal(size=(k, 16)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    ratio = np.abs(np.asarray(_bf16_pass(a, b), np.float64) - exact) / scale
    bound = matmul_precision("tpu").bound(k)
    assert ratio.max() <= bound
    assert ratio.max() >= bound / 64  # the rounding of bf16 inputs is what the bound says, not far below it


def test_a_mismatch_within_the_precision_says_so_and_unset_tolerances_pass() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(16, 256)).astype(np.float32), rng.normal(size=(256, 8)).astype(np.float32)
    assert_parallel_equal(jax.jit(_bf16_pass), _highest, a, b, precision="tpu")
    if jax.default_backend() == "tpu":  # not simulated there: the rerun at highest keeps the explicit bf16 casts
        return
    with pytest.raises(AssertionError, match=r"within precision: every difference is within what tpu matmuls at "
                                             r"precision 'default': products of bf16 inputs \(u = 2\^-8\) summed in "
                                             r"fp32 explains for a contraction of 256"):
        assert_parallel_equal(jax.jit(_bf16_pass), _highest, a, b, precision="tpu", rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError, match=r"beyond precision: the differences exceed what tpu matmuls"):
        assert_parallel_equal(jax.jit(lambda a, b: 1.05 * _bf16_pass(a, b)), _highest, a, b, precision="tpu",
                              rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError) as caught:  # a float32 backend explains none of it
        assert_parallel_equal(jax.jit(_bf16_pass), _highest, a, b, precision="cpu")
    assert "precision" not in str(caught.value)


def test_bf16_arguments_set_the_tolerance_on_any_backend() -> None:
    rng = np.random.default_rng(1)
    a = rng.normal(size=(16, 128)).astype(jnp.bfloat16)
    b = rng.normal(size=(128, 8)).astype(jnp.bfloat16)
    f32 = lambda a, b: jnp.matmul(a.astype(np.float32), b.astype(np.float32), precision="highest")  # noqa: E731
    bf16 = lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)  # noqa: E731
    assert_parallel_equal(jax.jit(bf16), f32, a, b, precision="cpu")
    with pytest.raises(AssertionError, match=r"within precision: .* products of bf16 inputs"):
        assert_parallel_equal(jax.jit(bf16), f32, a, b, precision="cpu", rtol=1e-6, atol=1e-7)


def _setting_pass(a, b):
    """A TPU's float32 matmul as the setting makes it: one bf16 pass, or float32 under ``highest`` (read while
    tracing, as XLA:TPU reads the precision the product is traced with)."""
    if jax.config.jax_default_matmul_precision in ("highest", "float32"):
        return _highest(a, b)
    return _bf16_pass(a, b)


def test_a_nonlinearity_past_the_bound_is_rerun_at_highest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chip's case: tanh of a bf16-pass product errs beyond a bound scaled by the tanh's own magnitude; the
    kit reruns both sides at ``highest``, passes where they then agree, and names the precision where rtol/atol
    were given; a real bug still fails and says the precision does not explain it."""
    from testbed.testing import compare

    monkeypatch.setattr(compare, "highest_removes", lambda precision: precision.reduced)  # as on a TPU
    rng = np.random.default_rng(2)
    w, x = rng.normal(size=(256, 16)).astype(np.float32), rng.normal(size=(32, 256)).astype(np.float32)
    step = jax.jit(lambda w, x: jnp.tanh(_setting_pass(x, w)))
    reference = lambda w, x: jnp.tanh(_highest(x, w))  # noqa: E731
    with pytest.raises(AssertionError):  # the bound alone does not hold past the tanh
        compare.assert_outputs_equal(step(w, x), reference(w, x), inputs=((w, x), {}), precision="tpu")
    assert_parallel_equal(step, reference, w, x, precision="tpu")
    with pytest.raises(AssertionError, match=r"within precision: every difference is the backend's matmul precision "
                                             r"\(tpu matmuls .*rerun at jax.default_matmul_precision\('highest'\)"):
        assert_parallel_equal(step, reference, w, x, precision="tpu", rtol=1e-6, atol=1e-7)
    with pytest.raises(AssertionError, match=r"beyond precision: rerun at .* still differ"):
        assert_parallel_equal(jax.jit(lambda w, x: 1.05 * jnp.tanh(_setting_pass(x, w))), reference, w, x,
                              precision="tpu")


def test_highest_removes_only_this_backends_own_rounding() -> None:
    from testbed.testing.precision import highest_removes

    assert not highest_removes(matmul_precision("cpu"))  # float32 already
    assert not highest_removes(matmul_precision("tpu")) or jax.default_backend() == "tpu"  # simulated by name
    assert not highest_removes(matmul_precision(args=[np.ones(2, jnp.bfloat16)]))  # bf16 arguments stay bf16
