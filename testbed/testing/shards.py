"""Random numbers in parallel code: per-shard references and the check that replicas draw different numbers.

A dropout mask or per-device noise cannot equal a single-device reference: each
device should draw its own numbers, from ``jax.random.fold_in(key,
jax.lax.axis_index(axis))``. Two checks make such code testable:

* :func:`per_shard_reference` -- the reference run once per shard, on that
  shard's block of the batch and with that shard's key, derived as the
  parallel code should derive it (``fold_in(key, i)`` by default); the blocks
  of its outputs concatenated. Pass it to :func:`assert_parallel_equal` as
  the reference;
* :func:`assert_replicas_differ` -- the blocks of an output along an axis
  must all differ: an unfolded key makes every replica draw the same mask.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from testbed.testing.devices import is_key

__all__ = ["shard_key", "per_shard_reference", "assert_replicas_differ"]


def shard_key(key: Any, index: int) -> Any:
    """Shard ``index``'s key as parallel code should derive it: ``jax.random.fold_in(key, index)``, where the
    parallel code calls ``fold_in(key, jax.lax.axis_index(axis))``. Typed and raw keys alike."""
    import jax

    return jax.random.fold_in(key, index)


def is_key_arg(x: Any) -> bool:
    """A typed key, or a raw ``uint32[2]`` key (``jax.random.PRNGKey``)."""
    import numpy as np

    return is_key(x) or (getattr(x, "dtype", None) == np.uint32 and getattr(x, "shape", None) == (2,))


def per_shard_reference(reference_fn: Callable[..., Any], shards: int, *, split: Sequence[int] | None = None,
                        key: int | None = None, derive: Callable[[Any, int], Any] = shard_key) -> Callable[..., Any]:
    """A reference that runs ``reference_fn`` once per shard and concatenates its outputs' blocks on dim 0.

    Args:
      shards: the number of shards (the size of the batch axis the parallel code splits).
      split: positions of the arguments cut into ``shards`` blocks along dim 0 (default: every array
        argument whose leading dim ``shards`` divides, keys excepted).
      key: the position of the key argument (default: the first typed or raw ``uint32[2]`` key); shard ``i``
        receives ``derive(key, i)``.
      derive: how the parallel code derives shard ``i``'s key (default :func:`shard_key`, ``fold_in``).
    """
    import jax
    import numpy as np

    def run(*args: Any, **kwargs: Any) -> Any:
        where = key if key is not None else next((i for i, a in enumerate(args) if is_key_arg(a)), None)
        cut = split if split is not None else [
            i for i, a in enumerate(args) if i != where and getattr(a, "ndim", 0) and a.shape[0] % shards == 0]
        outs = []
        for s in range(shards):
            mine = list(args)
            for i in cut:
                if args[i].shape[0] % shards:
                    raise ValueError(f"argument {i}'s leading dim {args[i].shape[0]} is not divisible by {shards} "
                                     f"shards")
                step = args[i].shape[0] // shards
                mine[i] = args[i][s * step:(s + 1) * step]
            if where is not None:
                mine[where] = derive(args[where], s)
            outs.append(reference_fn(*mine, **kwargs))
        return jax.tree.map(lambda *blocks: np.concatenate([np.atleast_1d(np.asarray(b)) for b in blocks]), *outs)

    return run


def _blocks(x: Any, n: int, dim: int) -> list[Any]:
    import numpy as np

    a = np.asarray(x)
    if a.ndim <= dim or a.shape[dim] % n:
        raise ValueError(f"output of shape {a.shape} has no dim {dim} divisible into {n} blocks")
    return np.split(a, n, axis=dim)


def assert_replicas_differ(fn: Callable[..., Any], *args: Any, axis: str = "", shards: int | None = None,
                           mesh: Any = None, dim: int = 0, **kwargs: Any) -> None:
    """Run ``fn(*args, **kwargs)``; assert that each output leaf's ``shards`` blocks along ``dim`` all differ.

    For values every device must draw for itself (dropout masks, per-device noise): ``fn`` returns them
    with the devices' blocks along ``dim`` (a ``jax.pmap`` output's leading axis, or ``out_specs`` naming
    ``axis`` at ``dim``). ``shards`` defaults to ``mesh.shape[axis]``. On two equal blocks the
    AssertionError names them, the axis and the fix: ``fold_in(key, axis_index(axis))``.
    """
    __tracebackhide__ = True
    import jax
    import numpy as np

    if shards is None:
        if mesh is None or not axis:
            raise ValueError("assert_replicas_differ needs shards=N, or mesh= and axis= to read it from")
        shards = int(mesh.shape[axis])
    name = f"'{axis}'" if axis else "the device axis"
    for path, leaf in jax.tree_util.tree_flatten_with_path(fn(*args, **kwargs))[0]:
        blocks = _blocks(jax.random.key_data(leaf) if is_key(leaf) else leaf, shards, dim)
        for i in range(shards):
            for j in range(i + 1, shards):
                if np.array_equal(blocks[i], blocks[j], equal_nan=True):
                    where = jax.tree_util.keystr(path) or "<root>"
                    raise AssertionError(
                        f"leaf {where}: blocks {i} and {j} of {shards} along dim {dim} (shards of {name}) are "
                        f"identical, but each shard should draw its own random numbers\n"
                        f"  hint: the same key on every device -- derive each shard's key with "
                        f"jax.random.fold_in(key, jax.lax.axis_index({axis or 'axis'!r})) inside the parallel code")
