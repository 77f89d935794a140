"""The kit's diagnosis by experiment: interposed re-runs name the change that makes a parallel function match.

The examples' twins (tests/test_examples.py) show each classic bug named; here: the mechanism -- every patch
is undone and the caches cleared, the budget bounds the re-runs and says what it left out, no match says
what was tried, a mean taken twice is undone by a pmean made a psum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from testbed.testing import assert_parallel_equal, replicate, shard_batch, unreplicate
from testbed.testing.diagnose import experiments
from testbed.testing.interpose import Change, Site, interposed


def _rows_mesh(n: int = 4):
    return jax.make_mesh((n,), ("data",))


def _sum_rows(mesh, reduce: str = "psum", extra: float = 0.0):
    # The collective is looked up on jax.lax when traced, as `lax.psum(...)` in user code is: a function object
    # bound earlier (a default argument `reduce=lax.psum`, `from jax.lax import psum`) is not interposed.
    body = lambda x: getattr(lax, reduce)(x.sum(axis=0), "data") + extra  # noqa: E731
    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P()))
    return lambda x: mapped(jax.device_put(x, NamedSharding(mesh, P("data"))))


def test_every_patch_is_undone_and_the_changed_trace_is_not_reused() -> None:
    from jax._src.numpy import reductions
    from jax._src.random import prng

    before = (jax.lax.psum, jax.lax.pmean, jax.lax.all_gather, reductions.mean, jnp.var, jax.grad, jax.value_and_grad)
    mesh = _rows_mesh()
    x = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    buggy = _sum_rows(mesh, reduce="pmean")  # a pmean where the sum was meant
    with pytest.raises(AssertionError, match=r"the pmean at .*test_kit_diagnosis.py:\d+ as psum"):
        assert_parallel_equal(buggy, lambda v: v.sum(axis=0), x, mesh=mesh)
    after = (jax.lax.psum, jax.lax.pmean, jax.lax.all_gather, reductions.mean, jnp.var, jax.grad, jax.value_and_grad)
    assert all(a is b for a, b in zip(before, after))
    assert all("bind" not in p.__dict__ for p in (prng.random_bits_p, prng.random_split_p, prng.random_fold_in_p))
    np.testing.assert_allclose(buggy(x), x.sum(axis=0) / 4, rtol=1e-6)  # the experiment's psum is gone again


def test_a_change_applies_inside_the_region_only_and_records_its_sites() -> None:
    mesh = _rows_mesh()
    x = np.ones((8, 4), np.float32)
    with interposed(None) as survey:
        _sum_rows(mesh)(x)
        jnp.mean(x, axis=0)  # outside any mapped region: not a site
    assert [s.kind for s in survey.sites] == ["psum"] and survey.env == {"data": 4}
    site = survey.sites[0]
    assert site.axes == ("data",) and site.where.endswith(f"test_kit_diagnosis.py:{site.where.split(':')[-1]}")
    with interposed(Change(what="as_pmean", site=site)):
        np.testing.assert_allclose(_sum_rows(mesh)(x), np.full(4, 2.0))
    assert [e.change.what for e in experiments(survey)] == ["as_pmean"]  # one axis: no swap; no grad: no scale


def test_no_matching_change_says_what_was_tried() -> None:
    mesh = _rows_mesh()
    x = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    with pytest.raises(AssertionError, match=r"diagnosis: no single change made it match; tried 1: the psum at "
                                             r".*test_kit_diagnosis.py:\d+ as pmean$"):
        assert_parallel_equal(_sum_rows(mesh, extra=1.0), lambda v: v.sum(axis=0), x, mesh=mesh)


def test_the_budget_bounds_the_re_runs_and_says_what_it_left_out() -> None:
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    x = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    body = lambda v: lax.psum(v.sum(axis=0), "model") + 1.0  # noqa: E731  (no single change fixes the +1)
    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False))
    run = lambda v: mapped(jax.device_put(v, NamedSharding(mesh, P("data"))))  # noqa: E731
    with pytest.raises(AssertionError, match=r"tried 1: the psum at .* as pmean; 1 more not run \(budget diagnose=1\)"):
        assert_parallel_equal(run, lambda v: v.sum(axis=0), x, mesh=mesh, diagnose=1)
    with pytest.raises(AssertionError) as caught:
        assert_parallel_equal(run, lambda v: v.sum(axis=0), x, mesh=mesh, diagnose=0)
    assert "diagnosis" not in str(caught.value)


def test_a_mean_taken_twice_is_undone_by_a_pmean_made_a_psum() -> None:
    """pmap: the loss already normalised by the global batch, then the gradients pmean-ed again."""
    n = 4
    loss = lambda w, x: jnp.sum((x @ w) ** 2) / (x.shape[0] * lax.psum(1, "batch"))  # noqa: E731
    step = lambda w, x: w - 0.1 * lax.pmean(jax.grad(loss)(w, x), "batch")  # noqa: E731
    run = jax.pmap(step, axis_name="batch", devices=jax.devices()[:n])
    parallel = lambda w, x: unreplicate(run(replicate(w, n), shard_batch(x, n)))  # noqa: E731
    reference = lambda w, x: w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.sum((x @ w) ** 2, axis=-1)))(w)  # noqa: E731
    rng = np.random.default_rng(0)
    w, x = rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=(8, 3)).astype(np.float32)
    with pytest.raises(AssertionError, match=r"it matches the reference with the pmean at .* as psum -- the pmean over "
                                             r"'batch' at .* should be a psum: the values are averaged twice"):
        assert_parallel_equal(parallel, reference, w, x, atol=1e-5)


def test_a_site_knows_its_line() -> None:
    a = Site(kind="psum", axes=("data",), where="f.py:3", index=0)
    b = Site(kind="psum", axes=("data",), where="f.py:3", index=2)
    assert a.line == b.line and a.key != b.key
    with pytest.raises(ValueError, match="needs the site"):
        Change(what="as_psum")
    with pytest.raises(ValueError, match="Change.what must be one of"):
        Change(what="reorder")
