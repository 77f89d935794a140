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
from testbed.plan.model import (FLASH_BLOCK, VOCAB_PAD_BASE, Attention, Mlp, ModelSpec, Norm, Position,  # noqa: F401 (re-exported)
                                 positive as _positive)
from testbed.plan.runtime import RuntimeSpec, runtime_fields
from testbed.plan.stages import resolve_layers_per_stage

__all__ = [
    "Axis", "MESH_AXES", "BATCH_AXES", "ScheduleName", "Precision", "Remat", "Mlp", "Norm", "Position", "Attention", "ModelSpec", "BatchSpec", "MeshSpec",
    "ScheduleSpec", "OptimizerSpec", "Plan", "check_plan",
]


class Axis(StrEnum):
    """Mesh axis names (fixed vocabulary)."""

    DATA = "data"
    FSDP = "fsdp"
    TENSOR = "tensor"
    STAGE = "stage"
    #: Expert parallelism: MoE experts split over it (tokens dispatched and combined with all-to-all);
    #: in the dense parts it splits the batch like ``data``.
    EXPERT = "expert"
    #: Context parallelism: every sequence split over it (ring attention; testbed.plan.context).
    CONTEXT = "context"


#: Canonical axis order of every mesh array, outermost first. Placement may
#: permute which devices sit where, never this order of array dims. The same
#: order is the default placement (Megatron's tp-cp-ep-dp-pp, innermost first).
MESH_AXES: tuple[Axis, ...] = (Axis.STAGE, Axis.DATA, Axis.FSDP, Axis.EXPERT, Axis.CONTEXT, Axis.TENSOR)

_AXIS_NAMES = frozenset(a.value for a in Axis)

#: The axes that split the batch (each replica of the dense model sees its own sequences).
BATCH_AXES: tuple[Axis, ...] = (Axis.DATA, Axis.FSDP, Axis.EXPERT)


class ScheduleName(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"
    ZB_H2 = "zb-h2"


class Precision(StrEnum):
    """fp32; bf16-mixed (bf16 params, grads and activations, fp32 master and moments); fp8-mixed.

    fp8-mixed is Transformer Engine's recipe (NVIDIA Transformer Engine docs, "Using FP8 with
    Transformer Engine"): the state is bf16-mixed's (bf16 parameters and gradients, fp32 master
    and moments) and activations stay bf16; only the matmuls run in fp8, their inputs cast per
    step (the casts are transient). The simulator prices matmuls at the device's fp8 peak where it
    has one (``DeviceSpec.flops``: bf16's otherwise).
    """

    FP32 = "fp32"
    BF16_MIXED = "bf16-mixed"
    FP8_MIXED = "fp8-mixed"

    @property
    def compute_dtype(self) -> str:
        """The matmuls' dtype: the device peak the simulator prices them at."""
        return {Precision.BF16_MIXED: "bf16", Precision.FP8_MIXED: "fp8"}.get(self, "fp32")

    @property
    def compute_bytes(self) -> int:
        """Bytes per activation value (bf16 under both mixed precisions)."""
        return 4 if self is Precision.FP32 else 2

    @property
    def mixed(self) -> bool:
        """Whether parameters and gradients are bf16 with an fp32 master in the optimizer state."""
        return self is not Precision.FP32


class Remat(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchSpec:
    global_batch: int
    microbatches: int = 1

    def __post_init__(self) -> None:
        _positive(self.global_batch, "batch.global_batch")
        _positive(self.microbatches, "batch.microbatches")


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshSpec:
    """Degrees of the six mesh axes, the placement order (outermost first) and the MoE layers' expert tensor degree.

    ``expert_tensor`` is Megatron-Core's ``--expert-tensor-parallel-size`` (MoE parallel folding): the tensor
    degree of each routed expert's own matrices. None (or ``tensor``) splits every expert's width over the
    tensor axis like the dense MLP; 1 folds the tensor ranks into expert parallelism in the MoE layers (each
    expert whole on one rank, the experts split over ``expert`` x ``tensor``: testbed.plan.sharding.expert_axes)
    while attention and the dense layers keep the tensor split. Values between would split the tensor axis in
    two, which a mesh of named axes cannot express.

    ``tile`` (one size per topology level, innermost first; empty: none) makes the placement fill the topology
    tile by tile instead of in device-id order, each tile's devices visited in a snake, which on a torus closes
    into a ring when the tile has two rows: MaxText's ``custom_mesh: hybrid_ring_64x4`` (its
    ``reshape_mesh_to_rings``) is tile ``[2, 2]`` with a 4-way innermost axis (testbed.plan.placement).
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    stage: int = 1
    expert: int = 1
    context: int = 1
    order: tuple[Axis, ...] = MESH_AXES
    expert_tensor: int | None = None
    tile: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for axis in Axis:
            _positive(getattr(self, axis.value), f"mesh.{axis.value}")
        object.__setattr__(self, "tile", tuple(self.tile))
        for size in self.tile:
            _positive(size, "mesh.tile")
        if self.expert_tensor is not None:
            _positive(self.expert_tensor, "mesh.expert_tensor")
            if self.expert_tensor not in (1, self.tensor):
                raise InputError(f"must be 1 (experts whole, the tensor ranks folded into expert parallelism) or "
                                 f"mesh.tensor {self.tensor} (each expert split like the dense MLP), got "
                                 f"{self.expert_tensor}", field="mesh.expert_tensor")
        order = tuple(Axis(a) for a in self.order)
        # An order may leave out axes of degree 1 (an order written before they existed): where they sit
        # places nothing, so they are put outermost.
        missing = tuple(a for a in MESH_AXES if a not in order and self.degree(a) == 1)
        order = missing + order
        if sorted(order) != sorted(Axis):
            raise InputError(f"must list each of {', '.join(a.value for a in MESH_AXES)} once (outermost first; "
                             f"axes of degree 1 may be left out), got {[a.value for a in self.order]}",
                             field="mesh.order")
        object.__setattr__(self, "order", order)

    def degree(self, axis: Axis | str) -> int:
        # An Axis is a str equal to its field's name: read it directly (a search asks millions of times).
        return getattr(self, axis if axis in _AXIS_NAMES else Axis(axis).value)

    @property
    def expert_tensor_degree(self) -> int:
        """The tensor degree of the routed experts' matrices: ``expert_tensor``, else ``tensor``."""
        return self.tensor if self.expert_tensor is None else self.expert_tensor

    @property
    def expert_parallel(self) -> int:
        """Ranks the routed experts are split over in the MoE layers: ``expert`` x ``tensor / expert_tensor``."""
        return self.expert * self.tensor // self.expert_tensor_degree

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
    #: Megatron sequence parallelism (Korthikanti et al. 2022): the norm, dropout and residual regions of every
    #: layer sharded over the sequence on the tensor axis; all-gather + reduce-scatter instead of all-reduce.
    sequence_parallel: bool = False
    #: Layers per pipeline stage (``testbed.plan.stages``): None is the even split, else a rule name
    #: (``balanced-ends``) or one count per stage; :attr:`stage_layers` is the resolved counts.
    layers_per_stage: tuple[int, ...] | str | None = None
    #: Simulator parameter of MoE plans: the busiest expert rank's tokens over the mean (1.0: uniform routing).
    expert_imbalance: float = 1.0
    #: How the program behind the plan runs (``testbed.plan.runtime``): the runner's own behaviour by default.
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    #: :attr:`stage_layers`, resolved once on construction (the models read it millions of times in a search).
    _stage_layers: tuple[int, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", Precision(self.precision))
        object.__setattr__(self, "remat", Remat(self.remat))
        if isinstance(self.zero, bool) or not isinstance(self.zero, int) or not 0 <= self.zero <= 3:
            raise InputError(f"must be 0, 1, 2 or 3, got {self.zero!r}", field="zero")
        m, mesh, b = self.model, self.mesh, self.batch
        multiple = m.vocab_multiple_for(mesh.tensor)
        if m.vocab_multiple != multiple:  # the padding rule resolved for this mesh
            m = replace(m, vocab_multiple=multiple)
            object.__setattr__(self, "model", m)
        replicas = mesh.data * mesh.fsdp * mesh.expert
        if b.global_batch % (replicas * b.microbatches):
            raise InputError(
                f"global_batch {b.global_batch} must be divisible by data x fsdp x expert x microbatches = "
                f"{mesh.data} x {mesh.fsdp} x {mesh.expert} x {b.microbatches} = {replicas * b.microbatches}",
                field="batch.global_batch")
        self._check_axes()
        if isinstance(self.layers_per_stage, list):
            object.__setattr__(self, "layers_per_stage", tuple(self.layers_per_stage))
        object.__setattr__(self, "_stage_layers", resolve_layers_per_stage(self.layers_per_stage, m.layers, mesh.stage,
                                                                           self.schedule.virtual_stages))
        if m.heads % mesh.tensor:
            raise InputError(f"heads {m.heads} must be divisible by mesh.tensor {mesh.tensor}", field="model.heads")
        if m.d_ff % mesh.tensor:
            raise InputError(f"d_ff {m.d_ff} must be divisible by mesh.tensor {mesh.tensor}", field="model.d_ff")
        if m.num_kv_heads % mesh.tensor and mesh.tensor % m.num_kv_heads:
            raise InputError(f"kv_heads {m.num_kv_heads} and mesh.tensor {mesh.tensor}: one must divide the other "
                             "(K/V heads split over the tensor ranks, or each rank holds all of them)",
                             field="model.kv_heads")
        if m.padded_vocab % mesh.tensor:
            raise InputError(f"vocab {m.vocab} padded to {m.padded_vocab} (pad_vocab_to {m.pad_vocab_to}) must be "
                             f"divisible by mesh.tensor {mesh.tensor} (vocab-parallel head)", field="model.vocab")
        if not isinstance(self.sequence_parallel, bool):
            raise InputError(f"must be true or false, got {self.sequence_parallel!r}", field="sequence_parallel")
        if self.sequence_parallel and mesh.tensor == 1:
            raise InputError("sequence_parallel shards the norm and dropout regions over the tensor axis, so it needs "
                             "mesh.tensor > 1 (got 1); set mesh.tensor to 2 or more, or sequence_parallel: false",
                             field="sequence_parallel")
        if self.sequence_parallel and m.seq_len % mesh.tensor and not self.runtime.pad_sequence_shards:
            raise InputError(f"sequence_parallel splits the sequence over the tensor ranks: model.seq_len "
                             f"{m.seq_len} must be divisible by mesh.tensor {mesh.tensor} (or set "
                             "runtime.pad_sequence_shards: true, as XLA pads uneven shards)", field="model.seq_len")
        if self.schedule.name is ScheduleName.INTERLEAVED and mesh.stage > 1 and b.microbatches % mesh.stage:
            raise InputError(f"interleaved needs microbatches ({b.microbatches}) divisible by mesh.stage ({mesh.stage})",
                             field="batch.microbatches")

    def _check_axes(self) -> None:
        """The context and expert axes against the model."""
        m, mesh = self.model, self.mesh
        if mesh.context > 1 and m.seq_len % (2 * mesh.context):
            raise InputError(f"context parallelism cuts each sequence into 2 x context chunks (two per rank, "
                             f"load-balanced): model.seq_len {m.seq_len} must be divisible by 2 x mesh.context = "
                             f"{2 * mesh.context}", field="mesh.context")
        if self.sequence_parallel and (m.seq_len // mesh.context) % mesh.tensor and not self.runtime.pad_sequence_shards:
            raise InputError(f"sequence_parallel splits each rank's {m.seq_len // mesh.context} tokens over the tensor "
                             f"ranks: seq_len / context must be divisible by mesh.tensor {mesh.tensor} (or set "
                             "runtime.pad_sequence_shards: true, as XLA pads uneven shards)",
                             field="model.seq_len")
        if mesh.expert > 1 and not m.experts:
            raise InputError(f"mesh.expert {mesh.expert} splits the experts of mixture-of-experts layers, but the "
                             "model is dense (model.experts 0); set model.experts or mesh.expert: 1", field="mesh.expert")
        if mesh.expert_tensor_degree != mesh.tensor and not m.experts:
            raise InputError(f"mesh.expert_tensor {mesh.expert_tensor} sets the tensor degree of mixture-of-experts "
                             "layers' experts, but the model is dense (model.experts 0); set model.experts or leave "
                             "mesh.expert_tensor out", field="mesh.expert_tensor")
        if m.experts and m.experts % mesh.expert_parallel:
            folded = "" if mesh.expert_parallel == mesh.expert else \
                f" x (mesh.tensor {mesh.tensor} / mesh.expert_tensor {mesh.expert_tensor_degree})"
            hint = (f"; with expert_tensor 1 the tensor ranks are expert ranks too, so Megatron-Core's "
                    f"--expert-model-parallel-size EP is mesh.expert x mesh.tensor: for EP {m.experts} write mesh.expert "
                    f"{m.experts // mesh.tensor}" if folded and m.experts % mesh.tensor == 0 else "")
            raise InputError(f"model.experts {m.experts} must be divisible by the expert-parallel degree mesh.expert "
                             f"{mesh.expert}{folded} = {mesh.expert_parallel}{hint}",
                             field="mesh.expert_tensor" if folded else "mesh.expert")
        if m.experts and m.expert_width % mesh.expert_tensor_degree:
            raise InputError(f"expert width {m.expert_width} (expert_d_ff, or d_ff) must be divisible by the experts' "
                             f"tensor degree {mesh.expert_tensor_degree} (mesh.expert_tensor, else mesh.tensor)",
                             field="model.expert_d_ff")
        if m.experts and m.shared_experts * m.expert_width % mesh.tensor:
            raise InputError(f"the shared experts' width {m.shared_experts} x {m.expert_width} must be divisible by "
                             f"mesh.tensor {mesh.tensor} (they split like the dense MLP)", field="model.expert_d_ff")
        imb = self.expert_imbalance
        if isinstance(imb, bool) or not isinstance(imb, (int, float)) or not imb >= 1:
            raise InputError(f"must be a number >= 1 (the busiest expert rank's tokens over the mean; 1 is uniform), "
                             f"got {imb!r}", field="expert_imbalance")

    @property
    def stage_layers(self) -> tuple[int, ...]:
        """Layers each pipeline stage holds (all its chunks): ``layers_per_stage`` resolved (even by default)."""
        return self._stage_layers

    @property
    def replicas(self) -> int:
        """Replicas of the dense model that split the batch: data x fsdp x expert (:data:`BATCH_AXES`)."""
        return self.mesh.data * self.mesh.fsdp * self.mesh.expert

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
        "": ("name", "model", "batch", "mesh", "schedule", "precision", "remat", "optimizer", "zero", "seed", "topology",
             "sequence_parallel", "layers_per_stage", "expert_imbalance", "runtime"),
        "model": ("preset", "kind", "layers", "d_model", "heads", "d_ff", "seq_len", "vocab", "tied_embeddings",
                  "kv_heads", "mlp", "norm", "position", "bias", "dropout", "rope_theta", "pad_vocab_to", "attention",
                  "attention_block", "experts", "top_k", "expert_d_ff", "shared_experts", "moe_every",
                  "first_dense_layers", "capacity_factor", "router_aux_loss", "head_dim", "parallel_block",
                  "sliding_window"),
        "batch": ("global_batch", "microbatches"),
        "mesh": ("data", "fsdp", "tensor", "stage", "expert", "context", "order", "expert_tensor", "tile"),
        "schedule": ("name", "virtual_stages"),
        "optimizer": ("name", "learning_rate", "b1", "b2", "eps", "weight_decay"),
        "runtime": runtime_fields(),
    }
