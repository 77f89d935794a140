"""Hints that read a parallel output's device buffers or rerun the reference: the classic bugs named by their axis.

:mod:`testbed.testing.compare` explains a difference from the values alone (a
scale, one bad shard). The bugs here need more than the gathered values:

* **replicas that disagree** -- a ``jax.Array`` whose sharding says it is
  replicated over a mesh axis, but whose device buffers along that axis differ
  (``shard_map(..., check_vma=False)`` trusts ``out_specs``; ``np.asarray``
  then shows one device's copy). When the copies sum to the reference a
  ``psum`` over that axis is missing (Megatron's partial sums); when they
  average to it, a ``pmean``;
* **blocks made equal by a collective** -- the output's blocks along a dim
  split over a mesh axis are all equal while the reference's are not: a
  collective ran over that axis (the wrong axis for a reduction meant
  elsewhere);
* **per-device statistics** -- each batch shard's output matches the
  reference run on that shard alone (BatchNorm statistics, a normaliser, a
  loss averaged per device): a ``pmean`` over the batch axis is missing.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["replica_hint", "equal_blocks_hint", "per_device_hint"]


def _mesh_of(leaf: Any) -> Any:
    sharding = getattr(leaf, "sharding", None)
    return getattr(sharding, "mesh", None) if getattr(sharding, "spec", None) is not None else None


def _axes_used(spec: Any) -> set[str]:
    used: set[str] = set()
    for entry in spec:
        if entry is None:
            continue
        used |= set(entry) if isinstance(entry, tuple) else {entry}
    return used


def replica_hint(leaf: Any, reference: Any, rtol: float, atol: float) -> str | None:
    """A hint when the device copies of ``leaf`` along a replicated mesh axis differ (module doc)."""
    import numpy as np

    mesh = _mesh_of(leaf)
    if mesh is None or not hasattr(leaf, "addressable_shards"):
        return None
    names = list(mesh.axis_names)
    where = {d.id: np.argwhere(mesh.devices == d)[0] for d in mesh.devices.flat}
    replicated = [a for a in names if a not in _axes_used(leaf.sharding.spec) and mesh.shape[a] > 1]
    for axis in replicated:
        k = names.index(axis)
        groups: dict[tuple, list[tuple[int, Any, Any]]] = {}
        for shard in leaf.addressable_shards:
            coords = where[shard.device.id]
            key = (tuple(c for i, c in enumerate(coords) if i != k), str(shard.index))
            groups.setdefault(key, []).append((int(coords[k]), shard.index, np.asarray(shard.data)))
        for copies in groups.values():
            if len(copies) < 2:
                continue
            copies.sort(key=lambda c: c[0])
            blocks = [c[2].astype(np.float64) if c[2].dtype.kind in "fc" else c[2] for c in copies]
            if all(np.array_equal(b, blocks[0], equal_nan=True) for b in blocks[1:]):
                continue
            text = (f"the device copies along mesh axis '{axis}' differ, though the output's sharding says it is "
                    f"replicated over '{axis}' (out_specs leaves it out; check_vma=False does not check)")
            ref = np.asarray(reference)[copies[0][1]] if np.ndim(reference) else np.asarray(reference)
            if ref.dtype.kind in "fc" and np.allclose(sum(blocks), ref, rtol=rtol, atol=atol):
                return text + f": they sum to the reference -- partial sums: missing psum over '{axis}'?"
            if ref.dtype.kind in "fc" and np.allclose(sum(blocks) / len(blocks), ref, rtol=rtol, atol=atol):
                return text + f": they average to the reference -- missing pmean over '{axis}'?"
            return text + f": a reduction over '{axis}' missing, or run over another axis?"
    return None


def equal_blocks_hint(leaf: Any, parallel: Any, reference: Any, atol: float) -> str | None:
    """A hint when the blocks of ``parallel`` along a dim split over a mesh axis are all equal, the reference's not."""
    import numpy as np

    mesh = _mesh_of(leaf)
    if mesh is None or parallel.shape != reference.shape:
        return None
    for dim, entry in enumerate(leaf.sharding.spec):
        for axis in (entry if isinstance(entry, tuple) else (entry,)) if entry is not None else ():
            n = mesh.shape[axis]
            if n < 2 or parallel.shape[dim] % n:
                continue
            par = np.split(parallel, n, axis=dim)
            ref = np.split(reference, n, axis=dim)
            if all(np.allclose(b, par[0], atol=atol, equal_nan=True) for b in par[1:]) and not all(
                    np.allclose(b, ref[0], atol=atol, equal_nan=True) for b in ref[1:]):
                return (f"the output's {n} blocks along dim {dim} (split over mesh axis '{axis}') are all equal, the "
                        f"reference's are not: a collective over '{axis}' mixed the shards (a psum/pmean over "
                        f"'{axis}' where another axis was meant?), or every shard drew the same random numbers "
                        f"(jax.random.fold_in(key, jax.lax.axis_index('{axis}')))?")
    return None


def _split_args(args: Sequence[Any], n: int) -> list[list[Any]] | None:
    """Each argument whose leading dim ``n`` divides, cut into ``n`` blocks (others whole); None if none splits."""
    import numpy as np

    from testbed.testing.shards import is_key_arg

    cut, any_split = [[] for _ in range(n)], False
    for a in args:
        array = hasattr(a, "shape") and getattr(a, "dtype", None) is not None and not is_key_arg(a)
        x = np.asarray(a) if array else None
        if x is not None and x.ndim and x.shape[0] % n == 0 and x.shape[0] >= n and x.dtype.kind in "fciub":
            for i, block in enumerate(np.split(x, n)):
                cut[i].append(block)
            any_split = True
        else:
            for i in range(n):
                cut[i].append(a)
    return cut if any_split else None


def per_device_hint(run_reference: Callable[..., Any], args: Sequence[Any], parallel: Any,
                    counts: Sequence[tuple[int, str]], rtol: float, atol: float) -> str | None:
    """A hint when the parallel output equals the reference run on each batch shard alone, for one count.

    ``run_reference(*args)`` runs the reference; ``args`` the positional
    arguments (split along their leading dim, those it divides);
    ``parallel`` one output leaf as numpy; ``counts`` (size, what it is).
    """
    import jax
    import numpy as np

    for n, what in sorted(counts, key=lambda c: not c[1].startswith("mesh axis")):  # an axis's name first
        cut = _split_args(args, n)
        if cut is None:
            continue
        try:
            outs = [run_reference(*c) for c in cut]
        except Exception:  # the reference cannot run on a shard (shape checks): no hint from this count
            continue
        leaves = [jax.tree.leaves(o) for o in outs]
        if len(leaves[0]) != 1:
            continue
        blocks = [np.asarray(b[0], np.float64) for b in leaves]
        whole = np.concatenate(blocks) if blocks[0].ndim else None
        if whole is not None and whole.shape == parallel.shape and np.allclose(parallel, whole, rtol=rtol, atol=atol):
            axis = what.split("'")[1] if "'" in what else "the batch axis"
            where = f"'{axis}'" if "'" in what else axis
            return (f"each of the {n} batch shards ({what}) matches the reference run on that shard alone: "
                    f"per-device statistics (a mean, variance or normaliser over the local batch only) -- "
                    f"pmean over {where}?")
    return None
