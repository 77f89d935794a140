"""The matmul precision a backend computes float32 products at, and the tolerance it implies.

By default JAX leans toward speed: float32 dot products are computed with
reduced-precision arithmetic inside, bfloat16 passes on TPU and TensorFloat32
on recent GPUs; ``jax_default_matmul_precision`` (or ``precision=`` per op)
asks for more (JAX docs, "Matmul precision",
https://docs.jax.dev/en/latest/201/precision.html). XLA:CPU computes float32.
:func:`matmul_precision` reads the backend and the setting and names the
significand the inputs of a product are rounded to:

============================  ==========  ==========  ==========
setting                       TPU         GPU         CPU
============================  ==========  ==========  ==========
unset, default, bfloat16      bf16 (8)    tf32 (11)   fp32 (24)
high, tensorfloat32           bf16x3 (16) tf32 (11)   fp32 (24)
highest, float32              fp32 (24)   fp32 (24)   fp32 (24)
============================  ==========  ==========  ==========

(bits of significand, the implicit bit included; bf16x3 is three bf16 passes of
a float32 split into a high and a low bf16 part, about 16 bits). Arguments
already in a narrower float type (bf16, fp16) cap it at their own.

The bound (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.:
rounding fl(x) = x(1 + d), |d| <= u, eq. (2.4); dot products, sec. 3.1, eq.
(3.4)): with inputs rounded to unit roundoff u = 2^-bits and products summed in
float32 (u32 = 2^-24) over a contraction of length k, each output element errs
by at most ``(2u + u^2 + gamma_k) * (|A| |B|)_ij``, gamma_k = k u32 / (1 - k u32).
The parallel run and the reference each err by that much, so they may differ by
twice it. :meth:`MatmulPrecision.tolerance` is that relative bound, times the
number of matmuls chained (``depth``). Measured against |C| rather than |A||B| it
is exact where there is no cancellation; where terms cancel the kit's absolute
tolerance (the bound times the leaf's largest magnitude) stands in for |A||B|.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["MatmulPrecision", "matmul_precision", "highest_removes", "FP32_BITS"]

#: float32's significand bits (implicit bit included): u32 = 2^-24, the accumulation's unit roundoff.
FP32_BITS = 24
_BITS = {"tpu": {"default": 8, "high": 16, "highest": 24}, "gpu": {"default": 11, "high": 11, "highest": 24},
         "cpu": {"default": 24, "high": 24, "highest": 24}}
_LEVEL = {None: "default", "default": "default", "fastest": "default", "bfloat16": "default", "bf16": "default",
          "high": "high", "tensorfloat32": "high", "bfloat16_3x": "high", "highest": "highest", "float32": "highest"}
_NAMES = {8: "bf16", 11: "tf32", 16: "bf16x3", 24: "fp32"}


@dataclass(frozen=True, slots=True, kw_only=True)
class MatmulPrecision:
    """What float32 matmuls compute at: ``backend`` (cpu, gpu, tpu), the ``setting`` read
    (``jax_default_matmul_precision``, "default" when unset) and the input significand ``bits``."""

    backend: str
    setting: str
    bits: int
    #: Whether arguments in a narrower float type than float32 were seen (no precision setting widens them).
    narrowed: bool = False

    def __post_init__(self) -> None:
        if self.backend not in _BITS:
            raise ValueError(f"MatmulPrecision.backend must be one of {sorted(_BITS)}, got {self.backend!r}")
        if not 2 <= self.bits <= FP32_BITS:
            raise ValueError(f"MatmulPrecision.bits must be 2..{FP32_BITS} (significand bits), got {self.bits}")

    @property
    def unit_roundoff(self) -> float:
        return 2.0 ** -self.bits

    @property
    def reduced(self) -> bool:
        """Whether products are computed below float32 (then default tolerances of 1e-5 cannot hold)."""
        return self.bits < FP32_BITS

    def bound(self, contraction: int) -> float:
        """Relative error bound of one output element of one matmul, against (|A||B|)_ij (module doc)."""
        if contraction < 1:
            raise ValueError(f"contraction must be >= 1, got {contraction}")
        u, u32 = self.unit_roundoff, 2.0 ** -FP32_BITS
        if contraction * u32 >= 1:
            raise ValueError(f"contraction {contraction} too long for a float32 accumulation bound")
        gamma = contraction * u32 / (1 - contraction * u32)
        return (2 * u + u * u if self.reduced else 0.0) + gamma

    def tolerance(self, contraction: int, depth: int = 1) -> float:
        """rtol for comparing two runs (each within the bound): 2 x depth x :meth:`bound`."""
        return 2 * max(1, depth) * self.bound(contraction)

    def describe(self) -> str:
        return (f"{self.backend} matmuls at precision {self.setting!r}: products of "
                f"{_NAMES.get(self.bits, f'{self.bits}-bit')} inputs (u = 2^-{self.bits}) summed in fp32")


def _backend_of(backend: str | None) -> str:
    if backend is not None:
        return str(backend).lower()
    import jax

    return str(jax.default_backend()).lower()


def matmul_precision(backend: str | None = None, setting: str | None = None,
                     args: Sequence[Any] = ()) -> MatmulPrecision:
    """The precision float32 matmuls run at (module table).

    ``backend``: "cpu", "gpu" or "tpu" (default: JAX's default backend; name one to see what another would
    do); ``setting``: a ``jax_default_matmul_precision`` value (default: the current config); ``args``:
    arrays whose narrower float dtypes (bf16: 8 bits, fp16: 11) cap the bits.
    """
    import jax
    import numpy as np

    name = _backend_of(backend)
    name = "gpu" if name in ("cuda", "rocm") else name
    if name not in _BITS:
        raise ValueError(f"backend must be one of {sorted(_BITS)} (or cuda/rocm), got {name!r}")
    raw = setting if setting is not None else jax.config.jax_default_matmul_precision
    text = None if raw is None else str(raw).lower().replace("precision.", "")
    if text not in _LEVEL:
        raise ValueError(f"matmul precision setting {raw!r} is not one of {sorted(k for k in _LEVEL if k)}")
    bits, narrowed = _BITS[name][_LEVEL[text]], False
    for leaf in jax.tree.leaves(list(args)):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jax.numpy.issubdtype(dtype, jax.numpy.floating) and np.dtype(dtype).itemsize < 4:
            bits, narrowed = min(bits, int(jax.numpy.finfo(dtype).nmant) + 1), True
    return MatmulPrecision(backend=name, setting=text or "default", bits=bits, narrowed=narrowed)


def highest_removes(precision: MatmulPrecision) -> bool:
    """Whether computing at ``jax.default_matmul_precision("highest")`` here would remove ``precision``'s rounding:
    it is reduced, it is this backend's (not one simulated by name) and its bits are the setting's own (not capped
    by arguments already in a narrower float type, which no setting widens)."""
    name = _backend_of(None)
    name = "gpu" if name in ("cuda", "rocm") else name
    return precision.reduced and precision.backend == name and not precision.narrowed


def contraction_of(args: Sequence[Any]) -> int:
    """The contraction length assumed when none is given: the largest dim of any floating argument (a step's
    matmuls contract over features, and its weight gradients over the batch rows)."""
    import jax
    import numpy as np

    dims = [int(d) for leaf in jax.tree.leaves(list(args))
            if getattr(leaf, "dtype", None) is not None and jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating)
            for d in np.shape(leaf)]
    return max(dims, default=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Tolerance:
    """The comparison's tolerances: ``rtol``, and per leaf ``max(atol, scale * max|reference leaf|)``.

    ``precision``, ``contraction`` and ``bound`` (:meth:`MatmulPrecision.tolerance`) say where they came from;
    ``auto`` whether the kit set them from the precision (rtol/atol left unset under reduced precision).
    """

    rtol: float
    atol: float
    scale: float = 0.0
    precision: MatmulPrecision | None = None
    contraction: int = 1
    bound: float = 0.0
    auto: bool = False

    def atol_for(self, reference: Any) -> float:
        import numpy as np

        if not self.scale or getattr(reference, "size", 0) == 0:
            return self.atol
        finite = np.abs(reference[np.isfinite(reference)]) if reference.dtype.kind in "fc" else np.zeros(1)
        return max(self.atol, self.scale * float(finite.max(initial=0.0)))

    def note(self, pairs: Sequence[tuple[Any, Any]]) -> str | None:
        """Where every differing element of the ``(parallel, reference)`` float leaves is within what the
        precision explains (rtol = atol scale = ``bound``): a line saying so, and what to pass."""
        import numpy as np

        if self.precision is None or self.auto or not pairs:
            return None
        for p, r in pairs:
            scale = self.bound * float(np.abs(r[np.isfinite(r)]).max(initial=0.0))
            if not np.all(np.isclose(p, r, rtol=self.bound, atol=max(scale, self.atol), equal_nan=True)):
                return (f"beyond precision: the differences exceed what {self.precision.describe()} explains for a "
                        f"contraction of {self.contraction} (rtol {self.bound:.3g}; Higham 2002 sec. 3.1), so "
                        f"rounding does not explain them") if self.precision.reduced else None
        return (f"within precision: every difference is within what {self.precision.describe()} explains for a "
                f"contraction of {self.contraction} (relative {self.bound:.3g} = 2 x (2u + u^2 + gamma_k), Higham 2002 "
                f"sec. 3.1; absolute: that times the leaf's largest magnitude) -- compare at rtol={self.bound:.3g} "
                f"(leave rtol/atol unset and the kit sets them from the precision), or compute at "
                f"jax.default_matmul_precision('highest')")


def resolve_tolerance(rtol: float | None, atol: float | None, precision: Any, contraction: int | None,
                      depth: int, args: Sequence[Any]) -> Tolerance:
    """The tolerances of one comparison: given ones kept; unset ones 1e-5/1e-6, or, where the backend's matmuls run
    below float32 (``precision``: a :class:`MatmulPrecision`, a backend name to simulate, or None for this one),
    the precision's bound for ``contraction`` (default :func:`contraction_of` the arguments) and ``depth`` chained
    matmuls."""
    prec = precision if isinstance(precision, MatmulPrecision) else matmul_precision(backend=precision, args=args)
    k = int(contraction) if contraction is not None else contraction_of(args)
    bound = prec.tolerance(k, depth)
    auto = prec.reduced and (rtol is None or atol is None)
    return Tolerance(rtol=rtol if rtol is not None else (max(1e-5, bound) if prec.reduced else 1e-5),
                     atol=atol if atol is not None else 1e-6,
                     scale=bound if prec.reduced and atol is None else 0.0,
                     precision=prec, contraction=k, bound=bound, auto=auto)
