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
    #: FSDP/ZeRO-3: blocks (a layer; the embedding, the head) whose parameters are gathered ahead of the one
    #: computing, forward and backward (the backward gathers each block again). The live gathered weights are
    #: ``1 + fsdp_prefetch`` blocks (testbed.model.memory); block ``i``'s gather may start once block
    #: ``i - 1 - fsdp_prefetch`` is done (testbed.sim.program, testbed.explore.analytic); 0: each gather waits
    #: for the previous block's compute. The runner gathers per block inside the layer loop and again in the
    #: backward (testbed.runner.parallel.ParamShards); how far ahead is XLA's latency-hiding scheduler's (one).
    fsdp_prefetch: int = 1

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise InputError(f"unknown runtime profile `{self.profile}`; valid: {', '.join(PROFILES)}",
                             field="runtime.profile")
        if isinstance(self.fsdp_prefetch, bool) or not isinstance(self.fsdp_prefetch, int) \
                or not 0 <= self.fsdp_prefetch <= 64:
            raise InputError("fsdp_prefetch must be a whole number of blocks from 0 to 64, "
                             f"got {self.fsdp_prefetch!r:.40}", field="runtime.fsdp_prefetch")


#: Field values of each named profile that differ from the runner's defaults: ``{profile: {field: value}}``.
#: Every value has its source in :data:`SOURCES` under the same (profile, field).
PROFILES: dict[str, dict[str, Any]] = {
    "testbed": {},
    "fsdp": {"fsdp_prefetch": 1},
    "torchtitan": {"fsdp_prefetch": 1},
    "deepspeed": {"fsdp_prefetch": 1},
    "xla": {"fsdp_prefetch": 1},
}

#: ``{(profile, field): "where the value comes from"}`` (a file and line of the stack, or its docs).
SOURCES: dict[tuple[str, str], str] = {
    ("fsdp", "fsdp_prefetch"):
        "PyTorch FSDP (FullyShardedDataParallel) defaults limit_all_gathers=True (pytorch/pytorch#104900): the "
        "rate limiter keeps two consecutive FSDP units' all-gathers in flight, the computing one and the "
        "prefetched next; backward_prefetch=BACKWARD_PRE issues the next unit's gather before the current "
        "gradient computation (torch.distributed.fsdp docs; docs/notes/fsdp 'FSDP Prefetch Nuances': implicit "
        "forward prefetching overlaps layer i+1's all-gather with layer i's compute)",
    ("torchtitan", "fsdp_prefetch"):
        "torchtitan applies FSDP2 fully_shard per transformer block; FSDP2's defaults 'allow two all-gather "
        "output tensors to be alive at once' in forward (implicit prefetching) and prefetch the next block in "
        "backward by the reverse post-forward order (pytorch/pytorch#128884, which added "
        "set_modules_to_forward_prefetch / set_modules_to_backward_prefetch to change it)",
    ("deepspeed", "fsdp_prefetch"):
        "DeepSpeed ZeRO-3 prefetches the next sub-modules' parameters up to stage3_prefetch_bucket_size "
        "(default 5e7 elements, deepspeed/runtime/zero/config.py) within stage3_max_live_parameters (1e9): "
        "less than one block of a model of 2B+ parameters (a 7B block is ~2e8), so one block ahead; smaller "
        "blocks prefetch further (not modelled: the field counts blocks)",
    ("xla", "fsdp_prefetch"):
        "XLA's latency-hiding scheduler (xla/service/latency_hiding_scheduler.cc; on by default on TPU, "
        "--xla_gpu_enable_latency_hiding_scheduler on GPU) starts a layer's async all-gather during the "
        "previous layer's compute, bounded by its memory limit: the next block's weights, one ahead",
}


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
