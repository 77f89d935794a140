"""How the training program behind a plan runs: the stack's mechanisms, stated rather than fitted.

Two programs with the same parallel layout can differ in time and memory by how they are written:
whether gradient reduction overlaps the backward and in what buckets, whether FSDP gathers one block
at a time and how far ahead, how pipeline sends travel over the tensor group, what is recomputed,
which elementwise work is fused. A plan states these under ``runtime:``; a named profile
(``megatron``, ``deepspeed``, ``fsdp``, ``torchtitan``, ``xla``) fills every field with the value that
stack uses, each value citing the stack's source or documentation in :data:`PROFILES`. Fields given
beside the profile override it. The default profile, ``testbed``, is what testbed's own runner does,
so a plan without ``runtime:`` prices the program the runner executes.

Every mechanism is one field of :class:`RuntimeSpec` with the runner's behaviour as its default;
both interpreters read the same field (the simulator prices it; where the runner can execute the
alternative it does, and where it cannot the runner says so).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from testbed.errors import InputError
from testbed.fields import check_keys, expect_mapping, get_str

__all__ = ["RuntimeSpec", "PROFILES", "SOURCES", "runtime_from_dict", "runtime_to_dict", "runtime_fields"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeSpec:
    """The stack's mechanisms (each field: the runner's behaviour by default; :data:`PROFILES` for others)."""

    #: The named profile the fields were filled from (``testbed``: the runner's own behaviour).
    profile: str = "testbed"

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise InputError(f"unknown runtime profile `{self.profile}`; valid: {', '.join(PROFILES)}",
                             field="runtime.profile")


#: Field values of each named profile that differ from the runner's defaults: ``{profile: {field: value}}``.
#: Every value has its source in :data:`SOURCES` under the same (profile, field).
PROFILES: dict[str, dict[str, Any]] = {
    "testbed": {},
}

#: ``{(profile, field): "where the value comes from"}`` (a file and line of the stack, or its docs).
SOURCES: dict[tuple[str, str], str] = {}


def runtime_fields() -> tuple[str, ...]:
    """Valid keys of the ``runtime`` section."""
    return tuple(f.name for f in fields(RuntimeSpec))


def runtime_from_dict(data: Any) -> RuntimeSpec:
    """The ``runtime`` section: a profile's values updated by the keys beside it."""
    if data is None:
        return RuntimeSpec()
    if isinstance(data, str):
        data = {"profile": data}
    data = expect_mapping(data, "runtime")
    check_keys(data, runtime_fields(), "runtime")
    profile = get_str(data, "profile", "runtime", default="testbed", choices=list(PROFILES))
    spec = RuntimeSpec(profile=profile, **PROFILES[profile])
    overrides = {k: v for k, v in data.items() if k != "profile"}
    return replace(spec, **_typed(overrides)) if overrides else spec


def _typed(values: Mapping[str, Any]) -> dict[str, Any]:
    """Each override checked against its field's default type (the dataclass validates ranges)."""
    defaults = RuntimeSpec()
    out: dict[str, Any] = {}
    for key, value in values.items():
        want = type(getattr(defaults, key))
        ok = isinstance(value, want) and not (want is not bool and isinstance(value, bool))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise InputError(f"expected {want.__name__}, got {value!r:.80}", field=f"runtime.{key}")
        out[key] = value
    return out


def runtime_to_dict(spec: RuntimeSpec) -> dict[str, Any] | None:
    """The YAML mapping (None for the default): the profile and the fields that differ from it."""
    base = RuntimeSpec(profile=spec.profile, **PROFILES[spec.profile])
    diff = {f.name: getattr(spec, f.name) for f in fields(RuntimeSpec)
            if f.name != "profile" and getattr(spec, f.name) != getattr(base, f.name)}
    if spec.profile == "testbed" and not diff:
        return None
    return {"profile": spec.profile, **diff}
