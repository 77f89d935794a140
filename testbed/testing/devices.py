"""Emulated host devices, the reference device and pmap helpers; JAX is imported only inside functions."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

FLAG = "--xla_force_host_platform_device_count"
_FLAG_RE = re.compile(re.escape(FLAG) + r"=(\d+)")

#: The most emulated host devices the kit asks XLA for: 4096 start in about 20 s and 0.6 GB; far more crash
#: XLA's host client (100,000 segfaults, 2^31 and over overflow its int).
MAX_HOST_DEVICES = 4096


def parse_device_count(text: object, where: str) -> int:
    """A device count ``0..MAX_HOST_DEVICES`` from an option or ini value (0: leave XLA_FLAGS alone).

    Raises ValueError with a one-line message naming ``where`` the value came from and the valid range.
    """
    raw = str(text).strip()
    try:
        n = int(raw, 10)
    except ValueError:
        n = None
    if n is None or not 0 <= n <= MAX_HOST_DEVICES:
        shown = raw if len(raw) <= 40 else raw[:37] + "..."
        raise ValueError(f"{where} must be a whole number of emulated host devices from 0 to {MAX_HOST_DEVICES} "
                         f"(0 leaves XLA_FLAGS alone), got {shown!r}")
    return n


def backend_started() -> bool:
    """Whether JAX's backend is initialised in this process (then XLA_FLAGS no longer changes the devices)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if started is not None else bool(getattr(xla_bridge, "_backends", {}))


def flagged_device_count(env: dict[str, str] | None = None) -> int | None:
    """The host device count XLA_FLAGS asks for, or None when it names none."""
    found = _FLAG_RE.search((os.environ if env is None else env).get("XLA_FLAGS", ""))
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class DeviceRequest:
    """What :func:`request_host_devices` did: ``action`` is "set", "kept", "late" or "off"; ``count`` the count
    XLA_FLAGS now asks for (None: none named)."""

    requested: int
    action: str
    count: int | None
    message: str = ""


def request_host_devices(n: int, *, override: bool = True) -> DeviceRequest:
    """Ask XLA for ``n`` emulated host devices before JAX's backend starts (idempotent).

    The flag already present with the same count is left alone; a different count is replaced when
    ``override`` (else kept, and reported). Once the backend has started nothing can change: the
    answer is "late" with a message saying why. ``n`` 0 does nothing ("off").
    """
    if n <= 0:
        return DeviceRequest(n, "off", flagged_device_count())
    present = flagged_device_count()
    if backend_started():
        import jax

        have = len(jax.devices())
        msg = "" if have >= n else (
            f"testbed: {n} emulated devices requested, but JAX's backend had already started with {have} "
            f"device(s) (something initialised JAX before the testbed plugin could set XLA_FLAGS "
            f"{FLAG}={n}); tests needing {n} devices will be skipped")
        return DeviceRequest(n, "late", present, msg)
    if present == n:
        return DeviceRequest(n, "kept", n)
    if present is not None and not override:
        return DeviceRequest(n, "kept", present, f"testbed: XLA_FLAGS already asks for {present} host devices; "
                                                 f"keeping it (pass --testbed-devices to change it)")
    flags = _FLAG_RE.sub("", os.environ.get("XLA_FLAGS", "")).split()
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{FLAG}={n}"])
    return DeviceRequest(n, "set", n)


class ReferenceDevice:
    """One device for the single-device reference: ``with reference_device: ...`` makes it JAX's default device;
    ``reference_device(fn, *args)`` runs ``fn`` there with the arguments moved to the host first."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self._contexts: list[Any] = []

    def __enter__(self) -> Any:
        import jax

        context = jax.default_device(self.device)
        context.__enter__()
        self._contexts.append(context)
        return self.device

    def __exit__(self, *exc: Any) -> None:
        self._contexts.pop().__exit__(*exc)

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self:
            return fn(*to_host(args), **to_host(kwargs))

    def __repr__(self) -> str:
        return f"ReferenceDevice({self.device})"


def is_key(x: Any) -> bool:
    """Whether ``x`` is a typed random key array (``jax.random.key``), whose data numpy cannot take as it is."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or "jax" not in sys.modules:
        return False
    import jax

    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


def to_host(tree: Any) -> Any:
    """Every jax.Array leaf as a numpy array (so a reference does not inherit the parallel run's shardings);
    a typed key as a typed key of the same implementation over host data."""
    import jax
    import numpy as np

    def move(x: Any) -> Any:
        if is_key(x):
            return jax.random.wrap_key_data(np.asarray(jax.random.key_data(x)), impl=jax.random.key_impl(x))
        return np.asarray(x) if isinstance(x, jax.Array) else x

    return jax.tree_util.tree_map(move, tree)


def replicate(tree: Any, n: int) -> Any:
    """Each leaf stacked ``n`` times on a new leading axis: the per-device copies ``jax.pmap`` takes."""
    import jax
    import numpy as np

    return jax.tree_util.tree_map(lambda x: np.broadcast_to(np.asarray(x), (n, *np.shape(x))).copy(), tree)


def shard_batch(tree: Any, n: int) -> Any:
    """Each leaf's leading (batch) axis split into ``n`` equal parts: shape (B, ...) -> (n, B/n, ...)."""
    import jax
    import numpy as np

    def split(x: Any) -> Any:
        x = np.asarray(x)
        if x.ndim == 0 or x.shape[0] % n:
            raise ValueError(f"batch dimension {x.shape[:1]} is not divisible by {n} devices")
        return x.reshape(n, x.shape[0] // n, *x.shape[1:])

    return jax.tree_util.tree_map(split, tree)


def unreplicate(tree: Any, *, check: bool = True) -> Any:
    """Device 0's copy of each leaf of a ``jax.pmap`` output; with ``check``, an AssertionError when the
    replicas disagree (naming the leaf and the first device that differs)."""
    import jax
    import numpy as np

    __tracebackhide__ = True

    def first(path: Any, x: Any) -> Any:
        __tracebackhide__ = True
        x = np.asarray(x)
        if check:
            for d in range(1, x.shape[0]):
                if not np.array_equal(x[d], x[0], equal_nan=x.dtype.kind in "fc"):
                    raise AssertionError(
                        f"replicas disagree at leaf {jax.tree_util.keystr(path) or '<root>'}: device {d}'s copy "
                        f"differs from device 0's (a value that should be reduced across devices -- "
                        f"pmean/psum -- is left per device?)")
        return x[0]

    return jax.tree_util.tree_map_with_path(first, tree)
