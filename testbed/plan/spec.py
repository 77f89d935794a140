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
from testbed.plan.stages import resolve_layers_per_stage

__all__ = [
    "Axis", "MESH_AXES", "ScheduleName", "Precision", "Remat", "Mlp", "Norm", "Position", "Attention", "ModelSpec", "BatchSpec", "MeshSpec",
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


def _positive(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"must be a positive whole number, got {value!r}", field=name)


class Mlp(StrEnum):
    """The MLP: GPT's ``gelu(x W1) W2``, or Llama's ``(silu(x W1) * x W3) W2`` (three matrices)."""

    GELU = "gelu"
    SWIGLU = "swiglu"


class Norm(StrEnum):
    """LayerNorm (scale and, with biases, a bias), or RMSNorm (scale only)."""

    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


class Position(StrEnum):
    """A learned position table, or rotary embeddings of Q and K (no parameters)."""

    LEARNED = "learned"
    ROPE = "rope"


class Attention(StrEnum):
    """Dense attention (the ``seq x seq`` scores materialised), or blockwise "flash" attention (FlashAttention-2:
    online softmax over K/V blocks, the backward recomputes the block scores; no ``seq x seq`` buffer)."""

    PLAIN = "plain"
    FLASH = "flash"


#: The largest K/V block of flash attention (FlashAttention-2's typical tile); see :attr:`ModelSpec.flash_block`.
FLASH_BLOCK = 128


#: Megatron's ``make-vocab-size-divisible-by``: an indivisible vocab is padded to a multiple of this x tensor.
VOCAB_PAD_BASE = 128


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer: embedding, ``layers`` pre-norm blocks, final norm, head.

    The defaults are GPT-2's architecture (MHA, GELU MLP, LayerNorm, learned
    positions, biases). ``kv_heads`` < ``heads`` is grouped-query attention
    (``kv_heads`` 1: multi-query); ``mlp``, ``norm``, ``position`` and
    ``bias`` choose the Llama family's pieces; ``attention`` plain or flash
    (``attention_block``: flash's K/V block, default :attr:`flash_block`'s rule). ``dropout`` is a rate the
    memory model counts masks for (the runner trains at rate 0).

    ``vocab`` is the tokenizer's vocabulary; the token table and head have
    :attr:`padded_vocab` rows. ``pad_vocab_to`` None is the automatic rule
    (:meth:`vocab_multiple_for`): pad only when the tensor degree does not
    divide ``vocab``, then to a multiple of ``128 x tensor`` (Megatron);
    a number pads to a multiple of it (1: never). :class:`Plan` resolves
    the rule for its mesh into ``vocab_multiple``; a ModelSpec on its own
    has ``vocab_multiple`` = ``pad_vocab_to`` or 1.
    """

    kind: str = "gpt"
    layers: int
    d_model: int
    heads: int
    d_ff: int
    seq_len: int
    vocab: int
    tied_embeddings: bool = False
    kv_heads: int | None = None
    mlp: Mlp = Mlp.GELU
    norm: Norm = Norm.LAYERNORM
    position: Position = Position.LEARNED
    bias: bool = True
    dropout: float = 0.0
    rope_theta: float = 10000.0
    attention: Attention = Attention.PLAIN
    attention_block: int | None = None
    pad_vocab_to: int | None = None
    vocab_multiple: int = 0

    def __post_init__(self) -> None:
        if self.kind != "gpt":
            raise InputError(f"unknown model kind `{self.kind}`; valid: gpt", field="model.kind")
        for name in ("layers", "d_model", "heads", "d_ff", "seq_len", "vocab"):
            _positive(getattr(self, name), f"model.{name}")
        if self.d_model % self.heads:
            raise InputError(f"d_model {self.d_model} must be divisible by heads {self.heads}", field="model.heads")
        if self.kv_heads is not None:
            _positive(self.kv_heads, "model.kv_heads")
            if self.heads % self.kv_heads:
                raise InputError(f"heads {self.heads} must be divisible by kv_heads {self.kv_heads}",
                                 field="model.kv_heads")
            if self.kv_heads == self.heads:  # multi-head attention: stored as unset, so `replace(heads=)` keeps MHA
                object.__setattr__(self, "kv_heads", None)
        for name, enum in (("mlp", Mlp), ("norm", Norm), ("position", Position), ("attention", Attention)):
            value = getattr(self, name)
            if value not in {e.value for e in enum}:
                raise InputError(f"unknown {name} `{value}`; valid: {', '.join(e.value for e in enum)}",
                                 field=f"model.{name}")
            object.__setattr__(self, name, enum(value))
        if not isinstance(self.dropout, (int, float)) or isinstance(self.dropout, bool) or not 0 <= self.dropout < 1:
            raise InputError(f"must be in [0, 1), got {self.dropout!r}", field="model.dropout")
        if not isinstance(self.rope_theta, (int, float)) or isinstance(self.rope_theta, bool) or not self.rope_theta > 0:
            raise InputError(f"must be positive, got {self.rope_theta!r}", field="model.rope_theta")
        if self.position is Position.ROPE and self.head_dim % 2:
            raise InputError(f"rope needs an even head_dim, got d_model / heads = {self.head_dim}",
                             field="model.position")
        if self.attention_block is not None:
            _positive(self.attention_block, "model.attention_block")
            if self.seq_len % self.attention_block:
                raise InputError(f"must divide seq_len {self.seq_len} (flash attention's K/V blocks tile the "
                                 f"sequence), got {self.attention_block}", field="model.attention_block")
        if self.pad_vocab_to is not None:
            _positive(self.pad_vocab_to, "model.pad_vocab_to")
            object.__setattr__(self, "vocab_multiple", self.pad_vocab_to)
        elif not self.vocab_multiple:
            object.__setattr__(self, "vocab_multiple", 1)
        _positive(self.vocab_multiple, "model.vocab_multiple")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def flash_block(self) -> int:
        """Flash attention's K/V block (both interpreters read it): ``attention_block``, or the largest divisor
        of ``seq_len`` not above :data:`FLASH_BLOCK` (``seq_len`` itself up to 128)."""
        if self.attention_block is not None:
            return self.attention_block
        return max(b for b in range(1, min(self.seq_len, FLASH_BLOCK) + 1) if self.seq_len % b == 0)

    @property
    def num_kv_heads(self) -> int:
        """K/V heads: ``kv_heads``, or ``heads`` when unset (multi-head attention; ``kv_heads`` equal to
        ``heads`` is stored unset)."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): ``kv_heads x head_dim`` (``d_model`` without GQA)."""
        return self.num_kv_heads * self.head_dim

    @property
    def grouped(self) -> bool:
        """Grouped-query (or multi-query) attention: fewer K/V heads than query heads."""
        return self.num_kv_heads != self.heads

    @property
    def padded_vocab(self) -> int:
        """Rows of the token table and the head: ``vocab`` rounded up to ``vocab_multiple``."""
        return -(-self.vocab // self.vocab_multiple) * self.vocab_multiple

    def vocab_multiple_for(self, tensor: int) -> int:
        """The padding multiple at tensor degree ``tensor`` (``pad_vocab_to``, or the automatic rule)."""
        if self.pad_vocab_to is not None:
            return self.pad_vocab_to
        return VOCAB_PAD_BASE * tensor if tensor > 1 and self.vocab % tensor else 1

    def kv_split(self, tensor: int) -> bool:
        """Whether the tensor axis splits the K/V heads (it divides ``kv_heads``); else each rank holds all of them."""
        return self.num_kv_heads % tensor == 0

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of the MLP: 2 (GELU), 3 (SwiGLU)."""
        return 3 if self.mlp is Mlp.SWIGLU else 2


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
    #: Megatron sequence parallelism (Korthikanti et al. 2022): the norm, dropout and residual regions of every
    #: layer sharded over the sequence on the tensor axis; all-gather + reduce-scatter instead of all-reduce.
    sequence_parallel: bool = False
    #: Layers per pipeline stage (``testbed.plan.stages``): None is the even split, else a rule name
    #: (``balanced-ends``) or one count per stage; :attr:`stage_layers` is the resolved counts.
    layers_per_stage: tuple[int, ...] | str | None = None

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
        replicas = mesh.data * mesh.fsdp
        if b.global_batch % (replicas * b.microbatches):
            raise InputError(
                f"global_batch {b.global_batch} must be divisible by data x fsdp x microbatches = "
                f"{mesh.data} x {mesh.fsdp} x {b.microbatches} = {replicas * b.microbatches}",
                field="batch.global_batch")
        if isinstance(self.layers_per_stage, list):
            object.__setattr__(self, "layers_per_stage", tuple(self.layers_per_stage))
        resolve_layers_per_stage(self.layers_per_stage, m.layers, mesh.stage, self.schedule.virtual_stages)
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
        if self.sequence_parallel and m.seq_len % mesh.tensor:
            raise InputError(f"sequence_parallel splits the sequence over the tensor ranks: model.seq_len "
                             f"{m.seq_len} must be divisible by mesh.tensor {mesh.tensor}", field="model.seq_len")
        if self.schedule.name is ScheduleName.INTERLEAVED and mesh.stage > 1 and b.microbatches % mesh.stage:
            raise InputError(f"interleaved needs microbatches ({b.microbatches}) divisible by mesh.stage ({mesh.stage})",
                             field="batch.microbatches")

    @property
    def stage_layers(self) -> tuple[int, ...]:
        """Layers each pipeline stage holds (all its chunks): ``layers_per_stage`` resolved (even by default)."""
        return resolve_layers_per_stage(self.layers_per_stage, self.model.layers, self.mesh.stage,
                                        self.schedule.virtual_stages)

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
        "": ("name", "model", "batch", "mesh", "schedule", "precision", "remat", "optimizer", "zero", "seed", "topology",
             "sequence_parallel", "layers_per_stage"),
        "model": ("preset", "kind", "layers", "d_model", "heads", "d_ff", "seq_len", "vocab", "tied_embeddings",
                  "kv_heads", "mlp", "norm", "position", "bias", "dropout", "rope_theta", "pad_vocab_to", "attention",
                  "attention_block"),
        "batch": ("global_batch", "microbatches"),
        "mesh": ("data", "fsdp", "tensor", "stage", "order"),
        "schedule": ("name", "virtual_stages"),
        "optimizer": ("name", "learning_rate", "b1", "b2", "eps", "weight_decay"),
    }
