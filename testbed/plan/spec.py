"""The plan: model, batch, mesh, schedule, precision, remat, optimizer, ZeRO.

One frozen :class:`Plan` is what both interpreters read. It is validated on
construction (internal consistency: batch vs mesh and microbatches, layers vs
stages, heads vs tensor degree) and against a topology with
:func:`check_plan` (mesh size vs device count). Change a plan with
``dataclasses.replace``; it holds no runtime state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from testbed.errors import InputError

__all__ = [
    "Axis", "MESH_AXES", "ScheduleName", "Precision", "Remat", "ModelSpec", "BatchSpec", "MeshSpec",
    "ScheduleSpec", "OptimizerSpec", "Plan", "check_plan",
]


class Axis(StrEnum):
    """Mesh axis names (fixed vocabulary)."""

    DATA = "data"
    FSDP = "fsdp"
    TENSOR = "tensor"
    STAGE = "stage"


#: Canonical axis order of every mesh array, outermost first. Placement may
#: permute which devices sit where, never this order of array dims.
MESH_AXES: tuple[Axis, ...] = (Axis.STAGE, Axis.DATA, Axis.FSDP, Axis.TENSOR)


class ScheduleName(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"
    ZB_H2 = "zb-h2"


class Precision(StrEnum):
    FP32 = "fp32"
    BF16_MIXED = "bf16-mixed"

    @property
    def compute_dtype(self) -> str:
        return "bf16" if self is Precision.BF16_MIXED else "fp32"

    @property
    def compute_bytes(self) -> int:
        return 2 if self is Precision.BF16_MIXED else 4


class Remat(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


def _positive(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"must be a positive whole number, got {value!r}", field=name)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A GPT-style decoder: embedding, ``layers`` pre-LN blocks, final norm, head."""

    kind: str = "gpt"
    layers: int
    d_model: int
    heads: int
    d_ff: int
    seq_len: int
    vocab: int
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.kind != "gpt":
            raise InputError(f"unknown model kind `{self.kind}`; valid: gpt", field="model.kind")
        for name in ("layers", "d_model", "heads", "d_ff", "seq_len", "vocab"):
            _positive(getattr(self, name), f"model.{name}")
        if self.d_model % self.heads:
            raise InputError(f"d_model {self.d_model} must be divisible by heads {self.heads}", field="model.heads")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchSpec:
    global_batch: int
    microbatches: int = 1

    def __post_init__(self) -> None:
        _positive(self.global_batch, "batch.global_batch")
        _positive(self.microbatches, "batch.microbatches")


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshSpec:
    """Degrees of the four mesh axes and the placement order (outermost first)."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    stage: int = 1
    order: tuple[Axis, ...] = MESH_AXES

    def __post_init__(self) -> None:
        for axis in Axis:
            _positive(getattr(self, axis.value), f"mesh.{axis.value}")
        order = tuple(Axis(a) for a in self.order)
        if sorted(order) != sorted(Axis):
            raise InputError(f"must list each of {', '.join(a.value for a in MESH_AXES)} once (outermost first), "
                             f"got {[a.value for a in order]}", field="mesh.order")
        object.__setattr__(self, "order", order)

    def degree(self, axis: Axis | str) -> int:
        return getattr(self, Axis(axis).value)

    @property
    def size(self) -> int:
        return math.prod(self.degree(a) for a in Axis)

    @property
    def shape(self) -> tuple[int, ...]:
        """Degrees in canonical MESH_AXES order."""
        return tuple(self.degree(a) for a in MESH_AXES)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleSpec:
    name: ScheduleName = ScheduleName.ONE_F_ONE_B
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", ScheduleName(self.name))
        _positive(self.virtual_stages, "schedule.virtual_stages")
        if self.name is not ScheduleName.INTERLEAVED and self.virtual_stages != 1:
            raise InputError(f"virtual_stages > 1 needs schedule `interleaved`, not `{self.name}`",
                             field="schedule.virtual_stages")


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerSpec:
    name: str = "adamw"
    learning_rate: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "adam", "sgd"):
            raise InputError(f"unknown optimizer `{self.name}`; valid: adamw, adam, sgd", field="optimizer.name")
        if not self.learning_rate > 0:
            raise InputError(f"must be positive, got {self.learning_rate}", field="optimizer.learning_rate")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise InputError(f"must be in [0, 1), got {getattr(self, name)}", field=f"optimizer.{name}")

    @property
    def moments(self) -> int:
        """Optimizer state tensors per parameter (Adam: 2, SGD: 0)."""
        return 0 if self.name == "sgd" else 2


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """One training configuration, read by the simulator and the runner alike."""

    model: ModelSpec
    batch: BatchSpec
    mesh: MeshSpec = field(default_factory=MeshSpec)
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    precision: Precision = Precision.FP32
    remat: Remat = Remat.NONE
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    zero: int = 0
    seed: int = 0
    topology: str | None = None
    name: str = "plan"

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", Precision(self.precision))
        object.__setattr__(self, "remat", Remat(self.remat))
        if isinstance(self.zero, bool) or not isinstance(self.zero, int) or not 0 <= self.zero <= 3:
            raise InputError(f"must be 0, 1, 2 or 3, got {self.zero!r}", field="zero")
        m, mesh, b = self.model, self.mesh, self.batch
        replicas = mesh.data * mesh.fsdp
        if b.global_batch % (replicas * b.microbatches):
            raise InputError(
                f"global_batch {b.global_batch} must be divisible by data x fsdp x microbatches = "
                f"{mesh.data} x {mesh.fsdp} x {b.microbatches} = {replicas * b.microbatches}",
                field="batch.global_batch")
        chunks = mesh.stage * self.schedule.virtual_stages
        if m.layers % chunks:
            raise InputError(f"layers {m.layers} must be divisible by stage x virtual_stages = {chunks}",
                             field="model.layers")
        if m.heads % mesh.tensor:
            raise InputError(f"heads {m.heads} must be divisible by mesh.tensor {mesh.tensor}", field="model.heads")
        if m.d_ff % mesh.tensor:
            raise InputError(f"d_ff {m.d_ff} must be divisible by mesh.tensor {mesh.tensor}", field="model.d_ff")
        if m.vocab % mesh.tensor:
            raise InputError(f"vocab {m.vocab} must be divisible by mesh.tensor {mesh.tensor} (vocab-parallel head)",
                             field="model.vocab")
        if self.schedule.name is ScheduleName.INTERLEAVED and mesh.stage > 1 and b.microbatches % mesh.stage:
            raise InputError(f"interleaved needs microbatches ({b.microbatches}) divisible by mesh.stage ({mesh.stage})",
                             field="batch.microbatches")

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: data x fsdp (the batch is split over both)."""
        return self.mesh.data * self.mesh.fsdp

    @property
    def microbatch_size(self) -> int:
        """Sequences per microbatch on one replica."""
        return self.batch.global_batch // (self.replicas * self.batch.microbatches)

    @property
    def tokens_per_step(self) -> int:
        return self.batch.global_batch * self.model.seq_len

    def with_mesh(self, **degrees: int) -> "Plan":
        return replace(self, mesh=replace(self.mesh, **degrees))


def check_plan(plan: Plan, num_devices: int, where: str = "topology") -> None:
    """Reject a plan whose mesh does not use exactly ``num_devices`` devices."""
    if plan.mesh.size != num_devices:
        shape = " x ".join(f"{a.value} {plan.mesh.degree(a)}" for a in MESH_AXES)
        raise InputError(
            f"the mesh ({shape} = {plan.mesh.size} devices) must use exactly the {num_devices} devices of {where}; "
            f"change the mesh degrees so their product is {num_devices}", field="mesh")


def plan_fields() -> Mapping[str, tuple[str, ...]]:
    """Valid keys of each plan section (for unknown-key suggestions)."""
    return {
        "": ("name", "model", "batch", "mesh", "schedule", "precision", "remat", "optimizer", "zero", "seed", "topology"),
        "model": ("kind", "layers", "d_model", "heads", "d_ff", "seq_len", "vocab", "tied_embeddings"),
        "batch": ("global_batch", "microbatches"),
        "mesh": ("data", "fsdp", "tensor", "stage", "order"),
        "schedule": ("name", "virtual_stages"),
        "optimizer": ("name", "learning_rate", "b1", "b2", "eps", "weight_decay"),
    }
