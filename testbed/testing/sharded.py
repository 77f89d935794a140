"""The layout of a parallel step's outputs: state that must be split over a mesh axis, not replicated.

ZeRO (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models")
shards the optimizer state over the data-parallel axis; FSDP shards the parameters too. State left
replicated gives the same numbers -- a single-device reference cannot tell -- but every device holds all of
it: an optimizer state left unsharded costs ``size`` times its share. :func:`assert_sharded` reads the
arrays' ``NamedSharding`` and fails, naming the leaf, its bytes per device and the fix.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["assert_sharded"]


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(str(a) for a in entry) if isinstance(entry, tuple) else (str(entry),)


def _problem(leaf: Any, axis: str) -> str | None:
    """Why ``leaf`` is not split over ``axis`` (None when it is)."""
    import jax

    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return f"its sharding ({type(sharding).__name__}) is not a NamedSharding, whose mesh axes could be read"
    mesh = sharding.mesh
    if axis not in mesh.axis_names:
        return f"the mesh has no axis '{axis}' (axes {tuple(mesh.axis_names)})"
    size = int(mesh.shape[axis])
    if size == 1 or any(axis in _axes(e) for e in sharding.spec):  # one device on the axis: nothing to split
        return None
    nbytes = math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return (f"it is replicated over mesh axis '{axis}' (spec {sharding.spec}): each of the {size} devices along "
            f"'{axis}' holds {nbytes} bytes of it where {nbytes // size} were meant")


def assert_sharded(tree: Any, axis: str, *, min_bytes: int = 0, what: str = "optimizer state") -> None:
    """Assert that every array leaf of ``tree`` of at least ``min_bytes`` is split over mesh ``axis`` (an axis of
    size 1 splits nothing and always passes).

    Leaves must be ``jax.Array`` s with a ``NamedSharding`` (what ``jit`` with ``out_shardings``,
    ``shard_map`` and ``device_put`` give). ``what`` names the tree in the message (the hint says how to
    shard it: ``NamedSharding(mesh, P(axis))`` in ``out_shardings``, ``with_sharding_constraint``, or
    ``out_specs``).
    """
    __tracebackhide__ = True
    import jax

    failures = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not hasattr(leaf, "shape") or leaf.size * leaf.dtype.itemsize < min_bytes or not getattr(leaf, "ndim", 0):
            continue
        problem = _problem(leaf, axis)
        if problem:
            failures.append(f"leaf {jax.tree_util.keystr(path) or '<root>'} (shape {leaf.shape}, "
                            f"{leaf.size * leaf.dtype.itemsize} bytes) is not split over '{axis}': {problem}")
    if failures:
        raise AssertionError("\n".join(failures) + (
            f"\n  hint: {what} left unsharded: every device keeps all of it. Shard it over '{axis}' -- "
            f"NamedSharding(mesh, P('{axis}')) on a dim it divides, in jit's out_shardings (and the initial state's "
            f"device_put), jax.lax.with_sharding_constraint inside the step, or shard_map's out_specs"))
