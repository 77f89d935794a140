"""A passing comparison that still hides per-device statistics: the structure of the error, not its size.

Statistics computed per device (BatchNorm's mean and variance, a normaliser, a
loss averaged over the local batch) err by how far each shard's statistics are
from the whole batch's: on large or evenly mixed batches that is 1e-5 to 1e-2,
inside the tolerances of bf16 code. The size of the error cannot tell such a
bug from rounding; its structure can. The output of the bug *is* the reference
run on each batch shard alone, while correct code's output is the reference on
the whole batch plus rounding, which owes nothing to the shards.

:func:`statistics_check` reruns the reference on each batch shard of every
mesh axis that splits the arguments (as the failure hint of
testbed.testing.hints.per_device_hint does) and flags an output at least twice
as close to those per-shard runs as to the whole-batch reference. Arguments in
a float type narrower than fp32 (bf16, fp16) are upcast to fp32 for the check
and both functions rerun: in bf16 the statistics' difference can sit below the
rounding of the result, in fp32 it stands far above it. Only outputs whose
per-shard reference differs from the whole-batch one by more than rounding
(:data:`ROUNDING` fp32 epsilons of the output's norm) are judged: where the
function has no statistics over the batch the two references differ by
rounding alone, and correct code, which computes each shard's rows with the
shapes (and so the rounding) of the per-shard run, sits closer to it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["statistics_check"]

#: How much closer to the per-shard reference than to the whole-batch one an output must be to be flagged.
CLOSER = 2.0
#: The per-shard and whole-batch references must differ by more than this many fp32 epsilons of the output's
#: norm for an output to be judged (below, they differ by rounding: there are no statistics over the batch).
ROUNDING = 16.0


def _upcast(args: Sequence[Any]) -> tuple[list[Any], bool]:
    """``args`` with every floating array narrower than fp32 as fp32; whether any was."""
    import jax
    import numpy as np

    from testbed.testing.shards import is_key_arg

    changed = False

    def up(x: Any) -> Any:
        nonlocal changed
        dtype = getattr(x, "dtype", None)
        if dtype is None or is_key_arg(x) or not jax.numpy.issubdtype(dtype, jax.numpy.floating):
            return x
        if np.dtype(dtype).itemsize >= 4:
            return x
        changed = True
        return np.asarray(x, np.float32)

    return [jax.tree.map(up, a) for a in args], changed


def _norm(x: Any) -> float:
    import numpy as np

    return float(np.sqrt(np.sum(np.square(x))))


def _leaves(tree: Any) -> list[Any]:
    import jax
    import numpy as np

    return [np.asarray(x, np.float64) if np.asarray(x).dtype.kind == "f" or str(np.asarray(x).dtype) == "bfloat16"
            else None for x in jax.tree.leaves(tree)]


def _per_shard(run_reference: Callable[..., Any], args: Sequence[Any], n: int, count: int) -> list[Any] | None:
    """The reference's outputs on each of ``n`` batch shards, each leaf's blocks concatenated on dim 0."""
    import numpy as np

    from testbed.testing.hints import _split_args

    cut = _split_args(args, n)
    if cut is None:
        return None
    try:
        outs = [_leaves(run_reference(*c)) for c in cut]
    except Exception:  # the reference cannot run on a shard (shape checks): nothing to compare
        return None
    if any(len(o) != count for o in outs):
        return None
    return [None if any(o[i] is None or o[i].ndim == 0 for o in outs) else np.concatenate([o[i] for o in outs])
            for i in range(count)]


def statistics_check(parallel_fn: Callable[..., Any], run_reference: Callable[..., Any], args: Sequence[Any],
                     parallel: Any, reference: Any, axes: Sequence[tuple[int, str]]) -> str | None:
    """A message when ``parallel`` has the structure of per-device statistics along one of ``axes`` (module doc).

    ``parallel_fn(*args)`` and ``run_reference(*args)`` rerun the two functions (only when ``args`` hold
    floats narrower than fp32, upcast); ``parallel`` and ``reference`` are their outputs on ``args``;
    ``axes`` the (size, "mesh axis 'name'") of the mesh axes to try.
    """
    import numpy as np

    wide, upcast = _upcast(args)
    if upcast:
        try:
            parallel, reference = parallel_fn(*wide), run_reference(*wide)
        except Exception:  # the code needs its narrow inputs: check what ran
            wide = list(args)
    par, ref = _leaves(parallel), _leaves(reference)
    if len(par) != len(ref):
        return None
    for n, what in axes:
        shards = _per_shard(run_reference, wide, n, len(ref))
        if shards is None:
            continue
        for i, (p, r, s) in enumerate(zip(par, ref, shards)):
            if p is None or r is None or s is None or not (p.shape == r.shape == s.shape):
                continue
            whole, alone, apart = _norm(p - r), _norm(p - s), _norm(s - r)
            if apart <= ROUNDING * float(np.finfo(np.float32).eps) * _norm(r) or whole == 0 or CLOSER * alone > whole:
                continue
            axis = what.split("'")[1] if "'" in what else what
            return (f"output leaf {i} (shape {p.shape}) is within the tolerance, but its error is per-device "
                    f"statistics: it is {whole / max(alone, 1e-300):.3g} times closer to the reference run on each "
                    f"of the {n} batch shards of mesh axis '{axis}' alone (distance {alone:.3g}) than to the "
                    f"reference on the whole batch (distance {whole:.3g}{', inputs upcast to fp32' if upcast else ''})"
                    f" -- a mean, variance or normaliser over the local batch only: pmean over '{axis}'?")
    return None
