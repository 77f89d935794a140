"""What every calibration group shares: validation that names ``calibration.GROUP.FIELD``, and plain values.

testbed.topology.calibration's groups (and testbed.topology.host_calibration's host-side ones) derive from
:class:`_Group`; each field's ceiling follows its unit (:func:`_ceiling`), so no calibration value can overflow
the model's sums.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, ClassVar

from testbed.errors import InputError

__all__: list[str] = []


def _ceiling(name: str) -> tuple[float, str]:
    """The largest value a non-negative calibration field may take, by its unit (its name's suffix)."""
    if name.endswith("_s"):
        return 3600.0, " seconds"
    if name.endswith("passes"):
        return 1000.0, " passes"
    return 1e21, ""  # bytes, FLOPs, GEMM sizes: far above any device, far below overflow


class _Group:
    """Shared by the groups: validation helpers naming ``calibration.GROUP.FIELD``, and plain values."""

    __slots__ = ()
    GROUP: ClassVar[str] = ""

    def _path(self, name: str) -> str:
        return f"calibration.{self.GROUP}.{name}"

    def _nonnegative(self, *names: str) -> None:
        """Each field in ``[0, ceiling]``: finite, so no calibration value can overflow the model's sums."""
        for name in names:
            value = getattr(self, name)
            ceiling, unit = _ceiling(name)
            if not 0 <= value <= ceiling:
                raise InputError(f"must be non-negative and at most {ceiling:g}{unit}, got {value}",
                                 field=self._path(name))

    def _fraction(self, name: str) -> None:
        value = getattr(self, name)
        if not 0 < value <= 1.5:
            raise InputError(f"must be in (0, 1.5], got {value}", field=self._path(name))

    def as_dict(self, full: bool = False) -> dict[str, Any]:
        """Plain values: every field (``full``) or those that differ from the defaults (for YAML)."""
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if full or value != f.default:
                out[f.name] = {n: t for n, t in value} if f.name in ("throughput", "programs", "skew_s") \
                    else value
        return out
