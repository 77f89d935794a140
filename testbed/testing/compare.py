"""Compare a parallel function's outputs with a single-device reference, and explain a difference."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

from testbed.testing.devices import ReferenceDevice, is_key, to_host
from testbed.testing.diagnose import DEFAULT_BUDGET, diagnose
from testbed.testing.hints import equal_blocks_hint, per_device_hint, replica_hint
from testbed.testing.precision import Tolerance, highest_removes, resolve_tolerance
from testbed.testing.structure import statistics_check

__all__ = ["assert_parallel_equal", "assert_outputs_equal"]


def assert_parallel_equal(parallel_fn: Callable[..., Any], reference_fn: Callable[..., Any], *args: Any,
                          rtol: float | None = None, atol: float | None = None, mesh: Any = None,
                          axis_sizes: Mapping[str, int] | None = None, reference_device: Any = None,
                          diagnose: int = DEFAULT_BUDGET, precision: Any = None, contraction: int | None = None,
                          depth: int = 1, **kwargs: Any) -> None:
    """Run ``parallel_fn(*args, **kwargs)`` and ``reference_fn`` on the same arguments; assert equal outputs.

    The reference runs on one device (``reference_device``: a device or a :class:`ReferenceDevice`;
    default, JAX's first device) with its array arguments copied to the host, so it never sees the
    parallel run's shardings. Outputs are compared leaf by leaf with numpy (``rtol``, ``atol``; NaN
    equals NaN). Unset tolerances are 1e-5 and 1e-6, or, where the backend's float32 matmuls run below float32
    (TPU bf16 passes, GPU tf32; ``precision`` names a backend to simulate, or is a
    :class:`testbed.testing.precision.MatmulPrecision`; bf16 arguments count too), the bound that precision
    implies for a contraction of ``contraction`` (default: the arguments' largest dim) over ``depth`` chained
    matmuls; a mismatch within that bound says so (testbed.testing.precision). Where this backend's own setting
    reduces the precision, a failing comparison reruns both at ``jax.default_matmul_precision("highest")``: with
    tolerances unset, outputs that then agree at float32's pass (a bound on one matmul does not carry through
    nonlinearities); with given ones, the message says whether the precision explains the difference. On a difference the AssertionError names the leaf path, the worst index and both
    values, and adds hints: a constant ratio that is a device count or a ``mesh`` axis size
    (``axis_sizes`` adds others) -- psum where pmean was meant --, also on the change from an input
    (an updated parameter); an error confined to one shard; NaN where the reference is finite (a
    pipeline bubble leaking); device copies of a replicated output that differ (a missing psum over the
    axis they differ along); blocks made equal by a collective over the wrong axis; outputs that match the
    reference run on each batch shard alone (per-device statistics). Outputs equal within the tolerance still
    fail when they are per-device statistics along a ``mesh`` axis: at least twice as close to the reference
    run on each batch shard alone as to the reference (testbed.testing.structure; bf16 inputs upcast to fp32). On a
    difference the parallel function is also re-run with one controlled change at a time, at most ``diagnose`` times
    (0: never), and the change that makes it match is named (testbed.testing.diagnose). Random keys (``jax.random.key`` or
    raw ``uint32[2]``) pass to the reference as they are; for code whose shards draw their own numbers,
    give a :func:`testbed.testing.per_shard_reference` as ``reference_fn``.
    """
    __tracebackhide__ = True
    parallel = parallel_fn(*args, **kwargs)
    if not isinstance(reference_device, ReferenceDevice):
        import jax

        reference_device = ReferenceDevice(reference_device if reference_device is not None else jax.devices()[0])
    reference = reference_device(reference_fn, *args, **kwargs)
    rerun = (lambda *a: reference_device(reference_fn, *a, **kwargs), args, lambda *a: parallel_fn(*a, **kwargs))
    assert_outputs_equal(parallel, reference, rtol=rtol, atol=atol, mesh=mesh, axis_sizes=axis_sizes,
                         inputs=(args, kwargs), precision=precision, contraction=contraction, depth=depth,
                         _rerun=rerun, _diagnose=diagnose)


def assert_outputs_equal(parallel: Any, reference: Any, *, rtol: float | None = None, atol: float | None = None,
                         mesh: Any = None, axis_sizes: Mapping[str, int] | None = None, inputs: Any = (),
                         precision: Any = None, contraction: int | None = None, depth: int = 1, _rerun: Any = None,
                         _diagnose: int = 0) -> None:
    """The comparison of :func:`assert_parallel_equal` on outputs already computed (``inputs``: the arguments,
    for the hint on updated parameters and the precision's contraction length)."""
    __tracebackhide__ = True
    import jax

    tol = resolve_tolerance(rtol, atol, precision, contraction, depth, jax.tree.leaves(inputs))
    counts = _counts(mesh, axis_sizes)
    par_leaves, par_def = jax.tree_util.tree_flatten_with_path(parallel)
    ref_leaves, ref_def = jax.tree_util.tree_flatten_with_path(reference)
    if par_def != ref_def:
        raise AssertionError(f"output structures differ:\n  parallel:  {par_def}\n  reference: {ref_def}")
    input_leaves = [(jax.tree_util.keystr(p), _array(x)) for p, x in jax.tree_util.tree_flatten_with_path(inputs)[0]]
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict):  # (args, kwargs)
        input_leaves = [(("args" + name[3:]) if name.startswith("[0]") else ("kwargs" + name[3:]), x)
                        for name, x in input_leaves]
    failures, differing = [], []
    for (path, p), (_, r) in zip(par_leaves, ref_leaves):
        pa, ra = _array(p), _array(r)
        rtol, atol = tol.rtol, tol.atol_for(ra)
        message = _compare_leaf(jax.tree_util.keystr(path) or "<root>", pa, ra, rtol, atol, counts, input_leaves)
        if message:
            extra = [replica_hint(p, ra, rtol, atol)]
            if pa.dtype.kind in "fc" and pa.shape == ra.shape:
                differing.append((pa, ra))
                extra.append(equal_blocks_hint(p, pa, ra, atol))
                if _rerun is not None and len(par_leaves) == 1:
                    extra.append(per_device_hint(_rerun[0], _rerun[1], pa, counts, rtol, atol))
            failures.append(message + "".join(f"\n  hint: {h}" for h in extra if h))
    if failures:
        experiment = _precision_experiment(_rerun, tol)
        if not (tol.auto and experiment):
            _fail(failures, len(par_leaves), differing, reference, tol, _rerun, _diagnose, experiment)
    axes = [(n, what) for n, what in counts if what.startswith("mesh axis")]
    if _rerun is not None and len(_rerun) > 2 and axes:  # equal within the tolerance: the error's structure
        found = statistics_check(_rerun[2], _rerun[0], _rerun[1], parallel, reference, axes)
        if found:
            raise AssertionError(found)


def _fail(failures: Sequence[str], leaves: int, differing: Sequence[tuple[Any, Any]], reference: Any,
          tol: Tolerance, rerun: Any, budget: int, experiment: bool | None = None) -> None:
    """Raise the comparison's AssertionError: the leaves' messages, the precision's note (``experiment``: what
    :func:`_precision_experiment` found), the diagnosis."""
    __tracebackhide__ = True
    text = "\n\n".join(failures)
    if len(failures) > 1:
        text += f"\n({len(failures)} of {leaves} leaves differ)"
    note = tol.note(differing) if len(differing) == len(failures) else None
    if experiment is not None:
        note = _experiment_note(experiment, tol)
    if note:
        text += f"\n\n{note}"
    if rerun is not None and len(rerun) > 2 and budget > 0 and not (note or "").startswith("within precision"):
        found = diagnose(rerun[2], rerun[1], lambda out: _matches(out, reference, tol), budget)
        text += f"\n\n{found}" if found else ""
    raise AssertionError(text)


#: The comparison at ``highest`` precision: float32's usual tolerances.
_FP32 = Tolerance(rtol=1e-5, atol=1e-6)


def _precision_experiment(rerun: Any, tol: Tolerance) -> bool | None:
    """Where the backend's matmuls run below float32: whether the parallel function and the reference, both rerun
    under ``jax.default_matmul_precision("highest")``, agree at float32's tolerances (True: the difference was the
    precision's; False: it is not); None where no rerun is possible or ``highest`` would not change the precision
    (testbed.testing.precision.highest_removes). A bound on one matmul does not carry through nonlinearities (a
    tanh's output is small where its input's error is not); the rerun does."""
    if rerun is None or len(rerun) < 3 or tol.precision is None or not highest_removes(tol.precision):
        return None
    import jax

    with jax.default_matmul_precision("highest"):
        parallel = rerun[2](*rerun[1])
        reference = rerun[0](*rerun[1])
    return _matches(parallel, reference, _FP32)


def _experiment_note(agrees: bool, tol: Tolerance) -> str:
    """What :func:`_precision_experiment` found, for the failure's message."""
    how = (f"rerun at jax.default_matmul_precision('highest'), the parallel function and the reference "
           f"{'agree' if agrees else 'still differ'} at float32's tolerances (rtol 1e-5, atol 1e-6)")
    if agrees:
        return (f"within precision: every difference is the backend's matmul precision ({tol.precision.describe()}): "
                f"{how} -- leave rtol/atol unset (the kit then compares this way), or compute at "
                f"jax.default_matmul_precision('highest')")
    return f"beyond precision: {how}, so the backend's matmul precision does not explain the differences"


def _matches(output: Any, reference: Any, tol: Tolerance) -> bool:
    """Whether ``output`` equals ``reference`` leaf by leaf within the tolerances (the comparison's test)."""
    import jax
    import numpy as np

    out, ref = jax.tree_util.tree_flatten(output), jax.tree_util.tree_flatten(reference)
    if out[1] != ref[1]:
        return False
    for p, r in zip(out[0], ref[0]):
        pa, ra = _array(p), _array(r)
        if pa.shape != ra.shape:
            return False
        floats = pa.dtype.kind in "fc" and ra.dtype.kind in "fc"
        same = np.isclose(pa, ra, rtol=tol.rtol, atol=tol.atol_for(ra), equal_nan=True) if floats else pa == ra
        if not np.all(same):
            return False
    return True


def _array(x: Any) -> Any:
    import numpy as np

    a = np.asarray(_key_data(x) if is_key(x) else x)
    # Floats (bfloat16 included) compared in float64; integers and booleans exactly.
    return a.astype(np.float64) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a


def _key_data(x: Any) -> Any:
    import jax

    return jax.random.key_data(x)


def _num(x: Any) -> str:
    return f"{complex(x):.8g}" if getattr(x, "dtype", None) is not None and x.dtype.kind == "c" else (
        f"{float(x):.8g}" if getattr(x, "dtype", None) is not None and x.dtype.kind in "fiub" else repr(x))


def _counts(mesh: Any, axis_sizes: Mapping[str, int] | None) -> list[tuple[int, str]]:
    """(size, what it is) for every count a bug could scale by: the device count, mesh axes, their product."""
    import jax

    found: list[tuple[int, str]] = [(jax.device_count(), "the device count")]
    sizes = dict(axis_sizes or {})
    if mesh is not None:
        sizes.update({str(k): int(v) for k, v in dict(mesh.shape).items()})
        found.append((math.prod(sizes.values()), "the mesh size"))
    found += [(size, f"mesh axis '{name}'") for name, size in sizes.items()]
    return [(n, what) for n, what in found if n >= 2]


def _named(k: int, counts: Sequence[tuple[int, str]]) -> str:
    names = sorted({what for n, what in counts if n == k})
    return f" ({k} = {', '.join(names)})" if names else ""


def _constant_ratio(numerator: Any, denominator: Any, atol: float) -> float | None:
    """The common ratio numerator/denominator where the denominator is not ~0, when it is (nearly) constant."""
    import numpy as np

    use = np.isfinite(numerator) & np.isfinite(denominator) & (np.abs(denominator) > max(atol, 1e-12))
    if use.sum() == 0:
        return None
    ratio = numerator[use] / denominator[use]
    k = float(np.median(ratio))
    if k == 0 or not np.allclose(ratio, k, rtol=2e-3, atol=0):
        return None
    return k


def _scale(k: float) -> tuple[int, bool] | None:
    """(n, inverse) when k is (nearly) an integer n >= 2, or 1/n."""
    for factor, inverse in ((k, False), (1 / k, True)):
        n = round(factor)
        if n >= 2 and abs(factor - n) <= 2e-3 * n:
            return n, inverse
    return None


def _scale_hint(k: float | None, counts: Sequence[tuple[int, str]], what: str) -> str | None:
    """``values scaled by 8 (8 = the device count): psum where pmean was meant?``"""
    found = _scale(k) if k is not None else None
    if found is None:
        return None
    n, inverse = found
    if inverse:
        return f"{what} scaled by 1/{n}{_named(n, counts)}: pmean where psum was meant, or a mean taken twice?"
    axes = [w.split("'")[1] for k, w in counts if k == n and w.startswith("mesh axis")]
    if not axes:
        return f"{what} scaled by {n}{_named(n, counts)}: psum where pmean was meant?"
    axis = axes[0]
    return (f"{what} scaled by {n}{_named(n, counts)}: psum where pmean was meant, or a loss not averaged over "
            f"'{axis}' (lax.pmean(loss, '{axis}'))? Under shard_map with check_vma=True JAX already sums the "
            f"gradients of parameters replicated over '{axis}' (the transpose of their implicit pvary): a psum or "
            f"pmean of them reduces twice -- average the loss over '{axis}' and reduce nothing more")


def _shard_hint(bad: Any, counts: Sequence[tuple[int, str]]) -> str | None:
    """Errors confined to some of the equal blocks along one dimension (one device's shard)."""
    import numpy as np

    if bad.ndim == 0 or bad.all():
        return None
    best = None
    candidates = sorted({n for n, _ in counts})
    for dim, size in enumerate(bad.shape):
        along = bad.any(axis=tuple(d for d in range(bad.ndim) if d != dim))
        for n in candidates:
            if size % n or size < n:
                continue
            blocks = np.flatnonzero(along.reshape(n, size // n).any(axis=1))
            if 0 < len(blocks) < n and (best is None or len(blocks) < len(best[2])):
                best = (dim, n, blocks, size // n)
    if best is None:
        return None
    dim, n, blocks, width = best
    if len(blocks) == 1:
        b = int(blocks[0])
        return (f"errors confined to one shard: block {b} of {n}{_named(n, counts)} along dim {dim} "
                f"(indices {b * width}:{(b + 1) * width}) -- one device's part is wrong: a wrong axis name, "
                f"a collective missing on that shard, or a pipeline bubble leaking?")
    return f"errors confined to blocks {[int(b) for b in blocks]} of {n} along dim {dim} (block size {width})"


def _compare_leaf(path: str, p: Any, r: Any, rtol: float, atol: float, counts: Sequence[tuple[int, str]],
                  inputs: Sequence[tuple[str, Any]]) -> str | None:
    import numpy as np

    if p.shape != r.shape:
        hints = []
        for n, what in counts:
            if p.shape == (n, *r.shape):
                hints.append(f"the parallel output keeps a per-device leading axis of {n} ({what}): unreplicate it "
                             f"(testbed.testing.unreplicate) or fix out_specs")
        for d, (a, b) in enumerate(zip(p.shape, r.shape)) if p.ndim == r.ndim else ():
            if a != b and b and a and (b % a == 0 or a % b == 0):
                k = b // a if b % a == 0 else a // b
                what = "1/%d of" % k if b % a == 0 else "%d times" % k
                hints.append(f"dim {d} is {what} the reference's{_named(k, counts)}: one shard instead of the whole "
                             f"(a missing all_gather, or out_specs)?" if b % a == 0 else
                             f"dim {d} is {what} the reference's{_named(k, counts)}: replicated copies concatenated "
                             f"(out_specs names an axis the value is replicated over)?")
        return (f"leaf {path}: shapes differ: parallel {p.shape}, reference {r.shape}"
                + "".join(f"\n  hint: {h}" for h in hints))
    if p.dtype.kind not in "fc" or r.dtype.kind not in "fc":
        bad = p != r
    else:
        bad = ~np.isclose(p, r, rtol=rtol, atol=atol, equal_nan=True)
    if not bad.any():
        return None
    lines = [f"leaf {path} (shape {p.shape}): {int(bad.sum())} of {bad.size} elements differ "
             f"(rtol={rtol:g}, atol={atol:g})"]
    if p.dtype.kind in "fc":
        err = np.where(bad, np.abs(p - r), -1.0)
        err = np.where(bad & ~np.isfinite(err), np.inf, err)
        worst = np.unravel_index(int(np.argmax(err)), p.shape) if p.ndim else ()
        idx = tuple(int(i) for i in worst)
        lines.append(f"  worst at index {idx}: parallel {_num(p[idx])}, reference {_num(r[idx])} "
                     f"(abs error {float(err[idx]):.6g})")
        hints = []
        nan_leak = ~np.isfinite(p) & np.isfinite(r)
        if nan_leak.any():
            hints.append(f"the parallel result has NaN/inf at {int(nan_leak.sum())} element(s) where the reference is "
                         f"finite: values from idle (bubble) slots or uninitialised buffers leak into the result?")
        text = _scale_hint(_constant_ratio(p, r, atol), counts, "values")
        if text:
            hints.append(text)
        else:
            for name, x in inputs:
                if x.shape == p.shape and x.dtype.kind in "fc":
                    text = _scale_hint(_constant_ratio(p - x, r - x, atol), counts, "gradients")
                    if text:
                        hints.append(f"the update (change from input {name}) is {text}")
                        break
        shard = _shard_hint(bad, counts)
        if shard:
            hints.append(shard)
        lines += [f"  hint: {h}" for h in hints]
    else:
        idx = tuple(int(i[0]) for i in np.nonzero(bad))
        lines.append(f"  first at index {idx}: parallel {_num(p[idx])}, reference {_num(r[idx])}")
    return "\n".join(lines)
