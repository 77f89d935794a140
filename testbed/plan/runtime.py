"""How the training program behind a plan runs: the stack's mechanisms, stated rather than fitted.

Two programs with the same parallel layout can differ in time and memory by how they are written:
whether gradient reduction overlaps the backward and in what buckets, whether FSDP gathers one block
at a time and how far ahead, how pipeline sends travel over the tensor group, what is recomputed,
which elementwise work is fused. A plan states these under ``runtime:``; a named profile
(``megatron``, ``deepspeed``, ``fsdp``, ``torchtitan``, ``xla``) fills every field with the value that
stack uses, each value citing the stack's source or documentation in :data:`SOURCES`. Fields given
beside the profile override it. The default profile, ``testbed``, is what testbed's own runner does,
so a plan without ``runtime:`` prices the program the runner executes.

Every mechanism is one field of :class:`RuntimeSpec` with the runner's behaviour as its default;
both interpreters read the same field (the simulator prices it; where the runner can execute the
alternative it does, and where it cannot the runner says so).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from testbed.errors import InputError
from testbed.fields import check_keys, expect_mapping, get_str
from testbed.plan.runtime_sources import SOURCES

if TYPE_CHECKING:
    from testbed.plan.spec import Plan

__all__ = ["RuntimeSpec", "PROFILES", "SOURCES", "RECOMPUTE", "GRAD_REDUCE_DTYPES", "MOE_DISPATCH", "ATTENTION_KERNELS",
           "FP8_SCALINGS", "FRAMEWORKS", "STATE_DTYPES", "XLA_COMBINE_BYTES", "PYTORCH_PROGRAM", "runner_differences", "runner_refusal", "runtime_from_dict", "runtime_to_dict", "runtime_fields"]

#: XLA's default all-gather and reduce-scatter combine thresholds (xla/service/collective_utils.h:
#: ``kDefaultAllGatherCombineThreshold``, ``kDefaultReduceScatterCombineThreshold``, ``30 * 1024 * 1024 + 7`` bytes).
XLA_COMBINE_BYTES = 30 * 1024 * 1024 + 7


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeSpec:
    """The stack's mechanisms: each field the runner's behaviour by default, :data:`PROFILES` for the stacks'; what each
    value does: docs/plan-format.md, ``runtime``."""

    #: The named profile the fields were filled from (``testbed``: the runner's own behaviour).
    profile: str = "testbed"
    #: How the plan's ``remat`` is carried out (:data:`RECOMPUTE`: which outputs are saved, which recomputed).
    recompute: str = "runner"
    #: Tensor-parallel collectives overlap their action's GEMMs (NeMo's userbuffers; testbed.sim.step.tp_overlap).
    tp_comm_overlap: bool = False
    #: Replicated gradients (ZeRO 0/1) reduce bucket by bucket during the last backward, not after it.
    grad_reduce_overlap: bool = False
    #: Bytes of one gradient bucket (0: the runner's, one per layer and at most four per chunk).
    grad_bucket_bytes: float = 0.0
    #: The dtype gradients are reduced in (:data:`GRAD_REDUCE_DTYPES`: their own, or fp32).
    grad_reduce_dtype: str = "grad"
    #: Without SP, a pipeline send carries each tensor rank's ``1/t`` share, all-gathered on arrival.
    pipeline_scatter_gather: bool = False
    #: FSDP/ZeRO-3 blocks gathered ahead of the one computing (live gathered weights: ``1 + fsdp_prefetch``).
    fsdp_prefetch: int = 1
    #: How an MoE layer moves tokens to its experts and back (:data:`MOE_DISPATCH`).
    moe_dispatch: str = "gather"
    #: The fused kernel flash attention runs in (:data:`ATTENTION_KERNELS`; testbed.sim.price.attention_kernels).
    attention_kernel: str = "runner"
    #: The precision of fp32 matmuls (:data:`MATMUL_PRECISIONS`): the backend's default (a TPU's one bf16 pass,
    #: priced at the bf16 rate where ``device.fp32_matmuls: bf16``) or ``highest`` (the runner sets it in JAX).
    matmul_precision: str = "default"
    #: How an fp8 matmul's operands find their scale (:data:`FP8_SCALINGS`), priced under fp8-mixed only.
    fp8_scaling: str = "delayed"
    #: Under sequence and expert parallelism each tensor rank dispatches its own sequence shard over the expert group
    #: and the experts' tensor ranks all-gather what arrives (Megatron-Core's MoEAlltoAllTokenDispatcher), instead of
    #: every tensor rank dispatching the whole sequence (testbed.model.moe.sequence_dispatch).
    moe_sequence_dispatch: bool = False
    #: Without a capacity factor (dropless) every expert still has ``seq_len`` slots per sequence, and the dispatch,
    #: the experts' GEMMs and their activations run over all of them (the runner's routing into
    #: testbed.model.moe.expert_capacity's slots), not over the routed tokens alone (testbed.model.moe.expert_load).
    moe_padded_dropless: bool = True
    #: Sequence parallelism over a tensor degree that does not divide the sequence pads each rank's shard to
    #: ``ceil(seq / t)`` tokens (XLA's GSPMD: an uneven shard rounded up, the last padded) instead of refusing the plan
    #: (Megatron-LM's split_tensor_along_first_dim needs the sequence divisible).
    pad_sequence_shards: bool = False
    #: Under fp8-mixed the output layer (the LM head) runs in fp8 too; by default it stays in bf16, as every stack's
    #: fp8 recipe leaves it (Megatron-Core's output_layer is a plain ColumnParallelLinear outside Transformer
    #: Engine's fp8_autocast; torchtitan's Llama configs filter ``output`` from Float8; llm-foundry's MPT head is
    #: the tied embedding's F.linear, not a te.Linear).
    fp8_head: bool = False
    #: Under fp8-mixed each linear keeps the fp8 cast of its input for the weight gradient. Memory only.
    fp8_saved_inputs: bool = False
    #: The loss is one fused kernel over the compute-dtype logits, with no fp32 copy. Memory only.
    fused_loss: bool = False
    #: Whose compiler or autograd runs the program (:data:`FRAMEWORKS`). Memory only.
    framework: str = "jax"
    #: The program's buffers are placed by XLA's buffer assignment (one compiled program), so a device's compiler
    #: rules apply (``device.buffer_rules``: testbed.model.xla_tpu's on XLA:TPU). Memory only.
    compiler_buffers: bool = True
    #: With a tensor axis each layer's normalised input ``(x - mean) * rstd`` is kept from its forward to its
    #: backward (XLA's fusions; testbed.model.kept). Memory only.
    kept_norm_inputs: bool = True
    #: Under the runner's selective remat, attention's head-major Q and K copies are kept to the backward (XLA's
    #: layout assignment; testbed.model.kept). Memory only.
    kept_layout_copies: bool = True
    #: Under the runner's full remat over unrolled layers, the residual stream's summands stay live to the backward
    #: (XLA fuses the adds into their consumers; testbed.model.kept). Memory only.
    fused_residual_adds: bool = True
    #: Under SP a column-parallel matmul keeps its all-gathered input, not its shard (testbed.model.kept). Memory only.
    sp_gathered_inputs: bool = True
    #: A layer's backward tensor collectives write their input's buffer, not a second one. Memory only.
    in_place_collectives: bool = False
    #: A microbatch's gradients reach the accumulator as the backward writes them (autograd's hooks). Memory only.
    grad_hooks: bool = False
    #: Every weight gradient is computed after the backward's whole input-gradient chain. Memory only.
    weight_grads_last: bool = True
    #: The program is compiled against the device's memory limit (testbed.model.floors). Memory only.
    limit_aware_compile: bool = True
    #: The layers run as one ``lax.scan`` over stacked parameters (MaxText's ``scan_layers``). Memory only.
    scan_layers: bool = False
    #: A pipeline send blocks its sender until it has arrived (DeepSpeed, Megatron-LM's 1F1B).
    pipeline_blocking_sends: bool = False
    #: ZeRO-1 gradients are all-reduced whole over data, each rank updating its shard (DeepSpeed).
    grad_all_reduce: bool = False
    #: Under mixed precision every microbatch's gradients are cast to fp32 and added into an fp32 buffer.
    grad_accumulate_fp32: bool = False
    #: A gradient buffer exists from the step's first backward that writes it (PyTorch's ``.grad``). Memory only.
    lazy_grads: bool = False
    #: Context parallelism all-gathers K and V before attention (Llama 3's), instead of the runner's ring.
    context_all_gather: bool = False
    #: Context parallelism merges ring steps and accumulates dQ/dK/dV in fp32 by eager kernels.
    context_merge_fp32: bool = False
    #: The context axis shards the model state as fsdp does (torchtitan's ``dp_shard_cp``).
    shard_context: bool = False
    #: Each layer's saved activations are offloaded to host memory and fetched back. Memory only.
    offload_activations: bool = False
    #: Under fp8-mixed the parameters are fp8 with their fp8 transpose, gathered in fp8. Memory only.
    fp8_params: bool = False
    #: The loss runs over this many tiles of the tokens (MaxText's ``num_vocab_tiling``). Memory only.
    vocab_tiles: int = 1
    #: Under mixed precision, the dtype of the trained weights and the optimizer's moments (:data:`STATE_DTYPES`).
    state_dtype: str = "fp32"
    #: Under mixed precision the fp32 weights are the only copy, cast per use (MaxText's default). Memory only.
    cast_weights: bool = False
    #: Without stages, the microbatches run as one compiled loop (``lax.scan``; testbed.sim.step.grad_bytes).
    microbatch_scan: bool = True
    #: Independent all-reduces of one kind and group merge (XLA's AllReduceCombiner).
    allreduce_combiner: bool = True
    #: Bytes a combined all-gather or reduce-scatter stays within (:data:`XLA_COMBINE_BYTES`; ``.inf``: none).
    gather_combine_bytes: float = float(XLA_COMBINE_BYTES)
    #: Under FSDP the embedding and the head are blocks of their own (testbed.model.blocks.own_blocks).
    fsdp_edge_blocks: bool = True
    #: The gradient all-reduces run beside the backward's compute where the device's compiler holds them in program
    #: order (XLA:TPU by default, DeviceSpec.held_collectives): the flags a run sets to overlap them
    #: (``xla_tpu_enable_data_parallel_all_reduce_opt`` with ``..._different_sized_ops``, or a SparseCore offload).
    async_all_reduce: bool = False

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise InputError(f"unknown runtime profile `{self.profile}`; valid: {', '.join(PROFILES)}",
                             field="runtime.profile")
        if self.recompute not in RECOMPUTE:
            raise InputError(f"unknown recompute `{self.recompute}`; valid: {', '.join(RECOMPUTE)}",
                             field="runtime.recompute")
        if self.moe_dispatch not in MOE_DISPATCH:
            raise InputError(f"unknown moe_dispatch `{self.moe_dispatch}`; valid: {', '.join(MOE_DISPATCH)}",
                             field="runtime.moe_dispatch")
        if self.framework not in FRAMEWORKS:
            raise InputError(f"unknown framework `{self.framework}`; valid: {', '.join(FRAMEWORKS)}",
                             field="runtime.framework")
        if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise InputError(f"unknown grad_reduce_dtype `{self.grad_reduce_dtype}`; valid: "
                             f"{', '.join(GRAD_REDUCE_DTYPES)}", field="runtime.grad_reduce_dtype")
        if not 0 <= self.grad_bucket_bytes < float("inf"):
            raise InputError(f"must be a finite number >= 0 (0: the runner's buckets), got {self.grad_bucket_bytes}",
                             field="runtime.grad_bucket_bytes")

        if isinstance(self.fsdp_prefetch, bool) or not isinstance(self.fsdp_prefetch, int) \
                or not 0 <= self.fsdp_prefetch <= 64:
            raise InputError("fsdp_prefetch must be a whole number of blocks from 0 to 64, "
                             f"got {self.fsdp_prefetch!r:.40}", field="runtime.fsdp_prefetch")
        if isinstance(self.vocab_tiles, bool) or not isinstance(self.vocab_tiles, int) \
                or not 1 <= self.vocab_tiles <= 4096:
            raise InputError(f"vocab_tiles must be a whole number of tiles from 1 to 4096, got {self.vocab_tiles!r:.40}",
                             field="runtime.vocab_tiles")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise InputError(f"unknown attention_kernel `{self.attention_kernel!s:.40}`; valid: "
                             f"{', '.join(ATTENTION_KERNELS)}", field="runtime.attention_kernel")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise InputError(f"unknown matmul_precision `{self.matmul_precision!s:.40}`; valid: "
                             f"{', '.join(MATMUL_PRECISIONS)}", field="runtime.matmul_precision")
        if self.state_dtype not in STATE_DTYPES:
            raise InputError(f"unknown state_dtype `{self.state_dtype!s:.40}`; valid: {', '.join(STATE_DTYPES)}",
                             field="runtime.state_dtype")
        if self.fp8_scaling not in FP8_SCALINGS:
            raise InputError(f"unknown fp8_scaling `{self.fp8_scaling!s:.40}`; valid: {', '.join(FP8_SCALINGS)}",
                             field="runtime.fp8_scaling")
        if not self.gather_combine_bytes >= 0:  # NaN fails too; .inf is valid
            raise InputError(f"must be a number of bytes >= 0 (.inf: no bound), got {self.gather_combine_bytes}",
                             field="runtime.gather_combine_bytes")
        for name in ("pipeline_blocking_sends", "grad_all_reduce", "grad_accumulate_fp32", "lazy_grads",
                     "context_all_gather", "context_merge_fp32", "shard_context", "offload_activations", "fp8_params",
                     "fp8_head", "pad_sequence_shards", "moe_sequence_dispatch", "moe_padded_dropless", "cast_weights",
                     "microbatch_scan", "allreduce_combiner", "fsdp_edge_blocks", "sp_gathered_inputs",
                     "in_place_collectives", "grad_hooks", "weight_grads_last", "limit_aware_compile",
                     "kept_norm_inputs", "kept_layout_copies", "fused_residual_adds", "compiler_buffers", "async_all_reduce"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} must be true or false, got {getattr(self, name)!r:.40}",
                                 field=f"runtime.{name}")


#: The fields of every PyTorch stack's profile that say its program is eager PyTorch rather than one XLA program.
PYTORCH_PROGRAM = {"framework": "pytorch", "compiler_buffers": False, "microbatch_scan": False,
                   "allreduce_combiner": False, "gather_combine_bytes": float("inf"), "fsdp_edge_blocks": False,
                   "sp_gathered_inputs": False, "in_place_collectives": True, "grad_hooks": True,
                   "weight_grads_last": False, "limit_aware_compile": False, "kept_norm_inputs": False,
                   "kept_layout_copies": False, "fused_residual_adds": False}
#: Every stack's dropless MoE runs the routed tokens alone (grouped GEMMs over per-expert token counts), where the
#: runner pads each expert's buffer to the sequence (:attr:`RuntimeSpec.moe_padded_dropless`).
ROUTED_DROPLESS = {"moe_padded_dropless": False}
#: Values of :attr:`RuntimeSpec.recompute`.
RECOMPUTE = ("runner", "block", "op", "save-qkv", "save-attention-dots", "save-dots", "save-dots-flash", "save-flash")
#: Values of :attr:`RuntimeSpec.framework`.
FRAMEWORKS = ("jax", "pytorch")
#: Values of :attr:`RuntimeSpec.grad_reduce_dtype`.
GRAD_REDUCE_DTYPES = ("grad", "fp32")
#: Values of :attr:`RuntimeSpec.moe_dispatch` (testbed.model.dispatch reads the same names).
MOE_DISPATCH = ("gather", "einsum", "megablox")
#: Values of :attr:`RuntimeSpec.attention_kernel`.
ATTENTION_KERNELS = ("runner", "flash2", "flash3", "cudnn", "triton", "splash", "tpu-flash")
#: Values of :attr:`RuntimeSpec.matmul_precision`.
MATMUL_PRECISIONS = ("default", "highest")
#: Values of :attr:`RuntimeSpec.fp8_scaling`.
FP8_SCALINGS = ("delayed", "current", "blockwise")
#: Values of :attr:`RuntimeSpec.state_dtype`.
STATE_DTYPES = ("fp32", "bf16")


#: Field values of each named profile that differ from the runner's defaults: ``{profile: {field: value}}``.
#: Every value has its source in :data:`SOURCES` under the same (profile, field).
PROFILES: dict[str, dict[str, Any]] = {
    "testbed": {},
    # testbed's runner is a JAX program compiled by XLA: an XLA program's mechanisms are the runner's own.
    "xla": {**ROUTED_DROPLESS, "fsdp_prefetch": 1, "scan_layers": True, "pad_sequence_shards": True},
    "megatron": {**ROUTED_DROPLESS, "recompute": "block", "grad_bucket_bytes": 160e6, "grad_reduce_dtype": "fp32",
                 "pipeline_scatter_gather": True, "attention_kernel": "cudnn", "fp8_saved_inputs": True,
                 **PYTORCH_PROGRAM, "pipeline_blocking_sends": True, "moe_sequence_dispatch": True},
    "nemo": {**ROUTED_DROPLESS, "recompute": "block", "grad_bucket_bytes": 160e6, "tp_comm_overlap": True,
             "grad_reduce_overlap": True, "attention_kernel": "cudnn", "fp8_saved_inputs": True, **PYTORCH_PROGRAM,
             "fp8_params": True, "moe_sequence_dispatch": True},
    "deepspeed": {**ROUTED_DROPLESS, "recompute": "block", "grad_bucket_bytes": 1e9, "fsdp_prefetch": 1,
                  **PYTORCH_PROGRAM, "grad_reduce_dtype": "fp32", "pipeline_scatter_gather": True,
                  "pipeline_blocking_sends": True, "grad_all_reduce": True, "grad_accumulate_fp32": True},
    "fsdp": {**ROUTED_DROPLESS, "recompute": "block", "grad_reduce_overlap": True, "fsdp_prefetch": 1,
             **PYTORCH_PROGRAM},
    "torchtitan": {**ROUTED_DROPLESS, "recompute": "op", "grad_reduce_overlap": True, "grad_reduce_dtype": "fp32",
                   "fsdp_prefetch": 1, "attention_kernel": "flash2", "fp8_scaling": "current", **PYTORCH_PROGRAM,
                   "context_merge_fp32": True, "shard_context": True, "lazy_grads": True},
    "llm-foundry": {**ROUTED_DROPLESS, "recompute": "block", "grad_reduce_overlap": True, "grad_reduce_dtype": "fp32",
                    "attention_kernel": "triton", "fused_loss": True, **PYTORCH_PROGRAM},
    # Meta's Llama 3 stack is not public; of its mechanisms the framework and what the Llama 3 paper states
    # (fp32 gradient reduce-scatter) are stated, and PyTorch FSDP's gradient lifetime (see SOURCES).
    "meta": {**ROUTED_DROPLESS, **PYTORCH_PROGRAM, "grad_reduce_dtype": "fp32", "context_all_gather": True,
             "lazy_grads": True},
}


def runner_differences(spec: RuntimeSpec) -> tuple[str, ...]:
    """The fields of ``spec`` whose values the runner does not execute (it runs its own behaviour, the defaults):
    the simulator prices them, the runner says it runs without them (testbed.runner.train). The runner executes
    ``recompute: save-dots``, ``save-dots-flash`` and ``save-flash`` (testbed.runner.model.stage_forward; under
    a remat they do not act on the value is its own) and
    ``matmul_precision: highest`` (testbed.runner.precision.matmul_precision)."""
    default = RuntimeSpec()
    executed = {"recompute": ("save-dots", "save-dots-flash", "save-flash"), "matmul_precision": ("highest",)}
    return tuple(f.name for f in fields(RuntimeSpec)
                 if f.name != "profile" and getattr(spec, f.name) != getattr(default, f.name)
                 and getattr(spec, f.name) not in executed.get(f.name, ()))


def runner_refusal(plan: Plan) -> str | None:
    """Why the runner refuses ``plan``, which the simulator prices, or None: tied embeddings across pipeline stages
    (priced as Megatron-LM runs them, testbed.sim.step.grad_bytes.tied_copy_bytes; the runner's pipeline keeps no copy of
    the token table on the last stage). The runner's pipeline trainer refuses with this message; the search says it
    of a best plan it finds so."""
    if plan.model.tied_embeddings and plan.mesh.stage > 1:
        return ("tied embeddings across pipeline stages are not supported by the runner yet (the simulator prices "
                "them as Megatron-LM runs them: a copy of the token table on the last stage, its gradient all-reduced "
                "with the first stage's each step); set model.tied_embeddings false or mesh.stage 1")
    return None


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
