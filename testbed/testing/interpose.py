"""Interposed changes to a parallel function's trace: the controlled re-runs behind the kit's diagnosis.

:func:`interposed` patches, for the duration of one call of the user's
parallel function, the functions parallel code calls while JAX traces it, and
clears JAX's caches before and after so the call re-traces (and later calls
do not reuse the changed program). Patched are:

* the collectives ``jax.lax.psum``, ``pmean``, ``pmax``, ``pmin``,
  ``all_gather`` and ``psum_scatter`` (the ``jax.lax`` attributes, so
  ``lax.psum(...)`` is seen, a name bound by ``from jax.lax import psum`` is not);
* the statistics ``jnp.mean``, ``jnp.var``, ``jnp.std`` and the array methods
  ``.mean()``, ``.var()``, ``.std()`` (through ``jax._src.numpy.reductions``);
* ``jax.grad`` and ``jax.value_and_grad`` (the loss being differentiated);
* the random primitives ``random_bits``, ``random_split`` and
  ``random_fold_in`` (every sampler of ``jax.random`` binds one of them).

With no :class:`Change` the patches only record each call site (a
:class:`Site`: what, the mesh axes in scope, the user's file and line); with
one, they apply it at the sites it names. Only calls inside a mapped region
(``shard_map``, ``pmap``: a non-empty axis environment) are recorded or
changed. The patches reach into ``jax._src`` (JAX 0.10); a JAX without those
names raises :class:`InterposeError`, which the diagnosis reports as such.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

__all__ = ["Site", "Change", "Survey", "InterposeError", "interposed", "COLLECTIVES", "STATISTICS"]

COLLECTIVES = ("psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter")
STATISTICS = ("mean", "var", "std")
_KEY_PRIMITIVES = ("random_bits_p", "random_split_p", "random_fold_in_p")
_KIT_DIR = os.path.dirname(os.path.abspath(__file__))


class InterposeError(RuntimeError):
    """The running JAX lacks a function or primitive the interposition patches."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Site:
    """One call, while tracing, of a patched function inside a mapped region.

    ``kind``: a collective's name, a statistic's (``mean``), ``grad`` or ``key``; ``axes``: the mesh axes it
    reduces over (collectives), else the axes in scope; ``where``: the user's ``file:line``; ``index``: the
    how-manieth call of ``kind`` at ``where`` in this trace; ``dim``: all_gather's ``axis`` argument; ``ndim``:
    the rank of its output; ``constant``: a collective of constants (``psum(1, axis)``, the axis size idiom).
    """

    kind: str
    axes: tuple[str, ...]
    where: str
    index: int = 0
    dim: int | None = None
    ndim: int | None = None
    constant: bool = False

    @property
    def key(self) -> tuple[str, str, int]:
        return self.kind, self.where, self.index

    @property
    def line(self) -> tuple[str, str]:
        """What a source line is: the kind of call and where (a loop's calls from one line share it)."""
        return self.kind, self.where


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """A controlled change applied while re-tracing the parallel function.

    ``what``: ``pmean_statistics`` (every statistic over dim 0 of a value varying over ``axis`` becomes its
    ``pmean`` over it), ``fold_keys`` (every key the shards share is folded with ``axis_index(axis)`` before
    use), ``as_pmean`` / ``as_psum`` (the collective at ``site`` made the other), ``swap_axis`` (the
    collective at ``site`` runs over ``axis``), ``gather_dim`` (the all_gather at ``site`` gathers along
    ``dim``) -- each at every call from the site's source line --, ``scale_loss`` (every differentiated function's output multiplied by ``factor``).
    """

    what: str
    axis: str = ""
    site: Site | None = None
    dim: int | None = None
    factor: float = 1.0

    def __post_init__(self) -> None:
        valid = ("pmean_statistics", "fold_keys", "as_pmean", "as_psum", "swap_axis", "gather_dim", "scale_loss")
        if self.what not in valid:
            raise ValueError(f"Change.what must be one of {valid}, got {self.what!r}")
        if self.what in ("as_pmean", "as_psum", "swap_axis", "gather_dim") and self.site is None:
            raise ValueError(f"Change {self.what!r} needs the site it changes")


@dataclass
class Survey:
    """What one interposed call saw: the call sites (in trace order) and the mapped axes with their sizes."""

    change: Change | None
    sites: list[Site] = field(default_factory=list)
    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    inside: int = 0
    keep: list[Any] = field(default_factory=list)
    env: dict[str, int] = field(default_factory=dict)


_LOCAL = threading.local()


def _caller() -> str:
    """``file:line`` of the innermost frame outside JAX and this kit (the user's code)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if f"{os.sep}jax{os.sep}" not in name and not name.startswith(_KIT_DIR) and "contextlib" not in name:
            return f"{os.path.relpath(name) if not os.path.relpath(name).startswith('..') else name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _axis_env() -> dict[str, int]:
    from jax._src import core

    env = {str(k): int(v) for k, v in dict(core.get_axis_env().axis_sizes).items()}
    state = getattr(_LOCAL, "state", None)
    if state is not None:
        state.env.update(env)
    return env


def _varies(x: Any, axis: str) -> bool | None:
    """Whether ``x`` varies over ``axis`` (shard_map with check_vma tracks it); None where JAX does not know."""
    from jax._src import config, core

    if not config._check_vma.value:
        return None
    varying = getattr(getattr(core.typeof(x), "mat", None), "varying", None)
    return None if varying is None else axis in varying


def _record(state: Survey, kind: str, axes: tuple[str, ...], **extra: Any) -> Site:
    where = _caller()
    index = state.counts.get((kind, where), 0)
    state.counts[(kind, where)] = index + 1
    site = Site(kind=kind, axes=axes, where=where, index=index, **extra)
    state.sites.append(site)
    return site


def _leaves(x: Any) -> list[Any]:
    import jax

    return jax.tree.leaves(x)


def _names(axis_name: Any) -> tuple[str, ...]:
    return tuple(str(a) for a in axis_name) if isinstance(axis_name, (tuple, list)) else (str(axis_name),)


def _collective(state: Survey, kind: str, orig: dict[str, Callable[..., Any]]) -> Callable[..., Any]:
    def patched(x: Any, axis_name: Any, *args: Any, **kwargs: Any) -> Any:
        if state.inside or not _axis_env():
            return orig[kind](x, axis_name, *args, **kwargs)
        dim = kwargs.get("axis", args[0] if args else 0) if kind == "all_gather" else None
        ndim = None if kind != "all_gather" else getattr(x, "ndim", 0) + (0 if kwargs.get("tiled") else 1)
        from jax._src import core

        site = _record(state, kind, _names(axis_name), dim=dim, ndim=ndim,
                       constant=not any(isinstance(v, core.Tracer) for v in _leaves(x)))
        change = state.change
        if change is None or change.site is None or change.site.line != site.line:  # every call from that line
            return orig[kind](x, axis_name, *args, **kwargs)
        if change.what == "as_pmean":
            return orig["pmean"](x, axis_name, **kwargs)
        if change.what == "as_psum":
            return orig["psum"](x, axis_name, **kwargs)
        if change.what == "swap_axis":
            return orig[kind](x, change.axis, *args, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k != "axis"}
        return orig[kind](x, axis_name, *args[1:], axis=change.dim, **kwargs)

    return patched


def _over_batch(a: Any, axis: Any) -> bool:
    """A reduction over dim 0 of an array of rank >= 1 (``axis`` names it; ``None``, every dim, does not count)."""
    if axis is None or not getattr(a, "ndim", 0):
        return False
    dims = axis if isinstance(axis, (tuple, list)) else (axis,)
    return any(int(d) % a.ndim == 0 for d in dims)


def _statistic(state: Survey, kind: str, orig: dict[str, Callable[..., Any]], lax: dict[str, Callable[..., Any]]
               ) -> Callable[..., Any]:
    def patched(a: Any, axis: Any = None, *args: Any, **kwargs: Any) -> Any:
        env = {} if state.inside else _axis_env()
        if env and _over_batch(a, axis):
            _record(state, kind, tuple(env))
        change = state.change
        plain = not args and not any(kwargs.get(k) for k in ("ddof", "correction", "where", "mean", "dtype", "out"))
        if (not env or not _over_batch(a, axis) or change is None or change.what != "pmean_statistics"
                or change.axis not in env or not plain or _varies(a, change.axis) is False):
            state.inside += 1  # jnp.var calls jnp.mean: one site, not two
            try:
                return orig[kind](a, axis, *args, **kwargs)
            finally:
                state.inside -= 1
        keepdims = bool(kwargs.get("keepdims", False))
        state.inside += 1
        try:
            mean = lax["pmean"](orig["mean"](a, axis, keepdims=True), change.axis)
            if kind == "mean":
                out = mean if keepdims else orig["mean"](mean, axis)  # drop the kept dims (a mean over size 1)
            else:
                centered = (a - mean) * (a - mean).conj() if a.dtype.kind == "c" else (a - mean) ** 2
                out = lax["pmean"](orig["mean"](centered, axis, keepdims=keepdims), change.axis)
                out = out ** 0.5 if kind == "std" else out
        finally:
            state.inside -= 1
        return out

    return patched


def _grad(state: Survey, orig: Callable[..., Any], with_value: bool) -> Callable[..., Any]:
    def patched(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        change = state.change
        factor = change.factor if change is not None and change.what == "scale_loss" else None
        has_aux = bool(kwargs.get("has_aux", False))
        where = _caller()

        def scaled(*a: Any, **k: Any) -> Any:
            if _axis_env() and not state.inside:
                state.sites.append(Site(kind="grad", axes=tuple(_axis_env()), where=where))
            out = fun(*a, **k)
            if factor is None:
                return out
            return (out[0] * factor, out[1]) if has_aux else out * factor

        differentiated = orig(scaled, *args, **kwargs)
        if not with_value or factor is None:
            return differentiated

        def unscaled(*a: Any, **k: Any) -> Any:
            value, grads = differentiated(*a, **k)
            value = (value[0] / factor, value[1]) if has_aux else value / factor
            return value, grads

        return unscaled

    return patched


def _key_bind(state: Survey, orig_bind: Callable[..., Any], fold: Callable[[Any, str], Any]) -> Callable[..., Any]:
    def bind(keys: Any, *args: Any, **params: Any) -> Any:
        env = {} if state.inside else _axis_env()
        if not env:
            return orig_bind(keys, *args, **params)
        site_axes = tuple(env)
        if not any(s.kind == "key" and s.where == "entry" for s in state.sites):
            state.sites.append(Site(kind="key", axes=site_axes, where="entry"))
        change = state.change
        if change is not None and change.what == "fold_keys" and change.axis in env and getattr(keys, "shape", 1) == ():
            varies = _varies(keys, change.axis)
            if varies is False or (varies is None and not any(keys is k for k in state.keep)):
                state.inside += 1
                try:
                    keys = fold(keys, change.axis)
                finally:
                    state.inside -= 1
        out = orig_bind(keys, *args, **params)
        state.keep.extend(out if isinstance(out, (list, tuple)) else [out])  # derived keys: never folded again
        return out

    return bind


@contextlib.contextmanager
def interposed(change: Change | None) -> Iterator[Survey]:
    """Patch the traced functions (module doc) for one re-run; yields the :class:`Survey` it records into."""
    import jax
    import jax.numpy as jnp
    from jax._src.numpy import reductions
    from jax._src.random import prng

    try:
        orig_lax = {k: getattr(jax.lax, k) for k in COLLECTIVES}
        orig_stats = {k: getattr(reductions, k) for k in STATISTICS}
        key_prims = [getattr(prng, name) for name in _KEY_PRIMITIVES]
    except AttributeError as err:
        raise InterposeError(f"this JAX ({jax.__version__}) lacks a function the diagnosis patches: {err}") from None
    state = Survey(change=change)
    fold = lambda key, axis: jax.random.fold_in(key, jax.lax.axis_index(axis))  # noqa: E731
    patches = [(jax.lax, k, _collective(state, k, orig_lax)) for k in COLLECTIVES]
    for k in STATISTICS:
        patched = _statistic(state, k, orig_stats, orig_lax)
        patches += [(reductions, k, patched), (jnp, k, patched)]
    patches += [(jax, "grad", _grad(state, jax.grad, False)), (jax, "value_and_grad", _grad(state, jax.value_and_grad, True))]
    patches += [(p, "bind", _key_bind(state, p.bind, fold)) for p in key_prims]
    saved = [(owner, name, owner.__dict__.get(name, _ABSENT) if hasattr(owner, "__dict__") else _ABSENT)
             for owner, name, _ in patches]
    jax.clear_caches()
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        _LOCAL.state = state
        yield state
    finally:
        _LOCAL.state = None
        for owner, name, value in reversed(saved):
            if value is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        jax.clear_caches()


_ABSENT = object()
