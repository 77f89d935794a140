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
from typing import Any

from testbed.errors import InputError
from testbed.fields import check_keys, expect_mapping, get_str
from testbed.plan.runtime_sources import SOURCES

__all__ = ["RuntimeSpec", "PROFILES", "SOURCES", "RECOMPUTE", "GRAD_REDUCE_DTYPES", "MOE_DISPATCH", "ATTENTION_KERNELS",
           "FP8_SCALINGS", "FRAMEWORKS", "STATE_DTYPES", "runner_differences", "runtime_from_dict", "runtime_to_dict", "runtime_fields"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeSpec:
    """The stack's mechanisms (each field: the runner's behaviour by default; :data:`PROFILES` for others)."""

    #: The named profile the fields were filled from (``testbed``: the runner's own behaviour).
    profile: str = "testbed"
    #: How the plan's ``remat`` is carried out (:data:`RECOMPUTE`): ``runner``, full remat reruns each layer's
    #: forward but the MLP's down projection (whose output only feeds the residual add) and selective the
    #: attention scores; ``block``, full remat reruns each block's whole forward, down projection and its
    #: tensor collectives included (a checkpoint around the block: Megatron-LM, DeepSpeed, torch's
    #: ``checkpoint_wrapper``); ``op``, selective remat saves every other matmul's output and attention's
    #: and recomputes the rest of the block (torchtitan's per-op policy; full remat as ``block``); ``save-qkv``,
    #: full remat as the runner's but the Q/K/V projections' outputs are saved (MaxText's ``save_qkv_proj`` and
    #: ``qkv_proj_offloaded``); ``save-attention-dots``, the out projection's too, so the backward reruns only
    #: attention and the MLP's input projections (MaxText's ``save_dot_except_mlpwi``). The two save-policies
    #: change a dense layer's recompute only (an MoE layer's is the runner's) and the FLOPs only (the memory of
    #: the saved outputs and, with a tensor axis, the collectives are priced as the runner's full remat);
    #: ``save-dots``, with selective remat, the block input and every weight matmul's output the backward reads
    #: saved (all but the MLP's down projection, which feeds the residual add only), attention and
    #: the elementwise work recomputed (MaxText's ``minimal``: ``checkpoint_dots_with_no_batch_dims``,
    #: testbed.model.kept.dots_saved_bytes; the FLOPs are selective's, the elementwise recompute priced as its
    #: passes); with full remat it is the runner's.
    recompute: str = "runner"
    #: The tensor-parallel collectives of an action overlap its GEMMs (NeMo's userbuffers ``tp_comm_overlap``)
    #: instead of following them, GEMM by GEMM (testbed.sim.tp_overlap): each block's collectives beside its own
    #: projections, the first chunk of each exposed (an MoE chunk's action takes the longer of its compute and
    #: its tensor collectives).
    tp_comm_overlap: bool = False
    #: Gradients replicated over an axis (ZeRO 0/1 data parallelism) reduce bucket by bucket while the last
    #: microbatch's backward goes on (PyTorch DDP, Megatron's ``--overlap-grad-reduce``, FSDP's post-backward
    #: hooks) instead of once after it (the runner sums replicas in the update). Sharded gradients always do.
    grad_reduce_overlap: bool = False
    #: Bytes of one gradient bucket (0: the runner's, one per layer and at most four per chunk): a chunk's
    #: gradients reduce as ``ceil(bytes / grad_bucket_bytes)`` buckets, at most one per layer.
    grad_bucket_bytes: float = 0.0
    #: The dtype gradients are reduced (all-reduced, reduce-scattered) in (:data:`GRAD_REDUCE_DTYPES`): ``grad``,
    #: their own (bf16 under mixed precision, as the runner reduces them); ``fp32`` (FSDP's
    #: ``MixedPrecision(reduce_dtype=torch.float32)``, Megatron's fp32 main-grad buffers): twice the bytes.
    grad_reduce_dtype: str = "grad"
    #: Without sequence parallelism, a pipeline send carries each tensor rank's ``1/t`` share of the activation
    #: (or its gradient) and the receiving stage all-gathers it over its tensor group (Megatron-LM's
    #: scatter/gather of pipeline tensors) instead of every tensor rank sending the whole tensor.
    pipeline_scatter_gather: bool = False
    #: FSDP/ZeRO-3: blocks (a layer; the embedding, the head) whose parameters are gathered ahead of the one
    #: computing, forward and backward (the backward gathers each block again). The live gathered weights are
    #: ``1 + fsdp_prefetch`` blocks (testbed.model.memory); block ``i``'s gather may start once block
    #: ``i - 1 - fsdp_prefetch`` is done (testbed.sim.program, testbed.explore.analytic); 0: each gather waits
    #: for the previous block's compute. The runner gathers per block inside the layer loop and again in the
    #: backward (testbed.runner.param_shards.ParamShards); how far ahead is XLA's latency-hiding scheduler's (one).
    fsdp_prefetch: int = 1
    #: How an MoE layer moves tokens to its experts' capacity slots and back (:data:`MOE_DISPATCH`):
    #: ``gather``, the runner's index gather and weighted scatter (memory work, testbed.runner.moe);
    #: ``einsum``, one-hot dispatch and combine einsums (MaxText's dropping path, ``sparse_matmul: False``),
    #: whose matmuls testbed.model.dispatch prices; ``megablox``, the gather's token movement with the routed
    #: experts' GEMMs in MaxText's megablox grouped-matmul kernel (its dropless ``sparse_matmul`` path, the
    #: default ``megablox: True``), at the kernel's published rate on the device (testbed.sim.grouped_kernels).
    #: No effect on a dense model.
    moe_dispatch: str = "gather"
    #: The fused attention kernel flash attention's products run in (:data:`ATTENTION_KERNELS`): ``runner``, the
    #: runner's own blockwise attention, priced at the device calibration's ``flash_efficiency`` (or by shape) over
    #: every ``s x s`` product, masked blocks included; ``flash2`` (FlashAttention-2), ``flash3``
    #: (FlashAttention-3), ``cudnn`` (cuDNN's fused attention, Transformer Engine's FusedAttention), ``triton``
    #: (FlashAttention's Triton kernel, flash_attn_triton.py), ``splash`` (TPU splash attention): a kernel that
    #: skips the causally masked tiles (half of a causal block's products),
    #: its forward and backward each at the efficiency published for that kernel on the device
    #: (testbed.sim.attention_kernels; a device without a published figure for the kernel: the runner's pricing).
    #: ``splash`` also sets the layer backward's attention memory (testbed.model.splash: no tiles in HBM).
    attention_kernel: str = "runner"
    #: The precision of fp32 matmuls (:data:`MATMUL_PRECISIONS`): ``default``, the backend's default (JAX's
    #: ``jax.default_matmul_precision`` unset: on a TPU one bf16 pass, priced at the bf16 rate where the device says
    #: so, ``device.fp32_matmuls: bf16``); ``highest``, full fp32 (on a TPU several bf16 passes, priced at the
    #: device's fp32 peak). The runner sets ``jax.default_matmul_precision("highest")`` for it.
    matmul_precision: str = "default"
    #: How an fp8 matmul's operands find their scale (:data:`FP8_SCALINGS`), priced only under fp8-mixed:
    #: ``delayed``, from an amax history, the amax of the tensor being cast found inside the cast kernel (Transformer
    #: Engine's ``DelayedScaling``: one pass, testbed.sim.compute.fp8_cast_bytes); ``current``, from the tensor's own
    #: amax, found by a reduction kernel that reads the tensor before the cast reads it again (Transformer Engine's
    #: ``Float8CurrentScaling``: ``Float8CurrentScalingQuantizer::quantize_impl`` runs ``nvte_compute_amax``, the
    #: optional amax all-reduce, then the quantize); ``blockwise``, a scale per 1 x 128 activation and 128 x 128
    #: weight block, each block's amax found inside the cast (one pass, as ``delayed``) and the scales applied in
    #: the GEMM's main loop, which runs at testbed.sim.compute.FP8_BLOCK_SCALED_SHARE of the per-tensor cap
    #: (Transformer Engine's ``Float8BlockScaling``, Megatron's ``--fp8-recipe blockwise``; DeepSeek-V3's recipe).
    #: The runner has no fp8 matmuls: the default is the simulator's pricing so far.
    fp8_scaling: str = "delayed"
    #: Under fp8-mixed, each linear layer keeps for its weight-gradient GEMM the fp8 cast of its input (1 byte a
    #: value) instead of the compute-dtype input, and a norm feeding a GEMM writes its output in fp8 directly
    #: (Transformer Engine's Linear, LayerNormLinear, LayerNormMLP). False: the compute-dtype inputs are kept and
    #: cast again in the backward (torchao's float8 linear; the runner runs no fp8). Memory only
    #: (testbed.model.kept).
    fp8_saved_inputs: bool = False
    #: The loss is one fused kernel over the compute-dtype logits (flash-attn's Triton cross-entropy): it keeps
    #: them and each row's log-sum-exp and writes their gradient in the compute dtype, with no fp32 copy.
    #: False: the runner's XLA loss, which keeps fp32 logits and writes two fp32 buffers in its backward.
    #: Memory only (testbed.model.kept).
    fused_loss: bool = False
    #: The framework whose autograd decides which buffers a step keeps (:data:`FRAMEWORKS`): ``jax``, XLA's
    #: compiled program (the runner; MaxText), whose buffer assignment keeps what XLA's fusion and scheduling
    #: leave live (testbed.model.kept: gathered sequence-parallel inputs, tensor-parallel backward buffers, the
    #: residual stream's summands under remat, all of a microbatch's sharded gradients until their combined
    #: reduce-scatter); ``pytorch``, autograd's saved tensors (Korthikanti et al. 2022's accounting: sequence
    #: parallelism keeps 1/t shards, sharded gradients reduce-scatter per block in the backward). Memory only.
    framework: str = "jax"
    #: The layers run as one loop over stacked parameters (``jax.lax.scan``, MaxText's ``scan_layers``) instead
    #: of the runner's unrolled Python loop: each layer's output is a materialised loop carry, so XLA cannot keep
    #: the residual stream's summands in its place, nor run the last block's remat beside the loss backward
    #: (testbed.model.kept). Memory only.
    scan_layers: bool = False
    #: Pipeline sends block the sender: a stage's next action starts once its activation or gradient has reached
    #: the next stage (DeepSpeed's PipelineEngine runs each send as a blocking ``dist.send`` between its computes;
    #: Megatron-LM's 1F1B waits on its ``batch_isend_irecv`` requests) instead of leaving on a stream of their own
    #: while the stage computes on (the runner's sends, dispatched beside its next action).
    pipeline_blocking_sends: bool = False
    #: With the optimizer state sharded over data but the gradients not (ZeRO-1), the gradients are all-reduced
    #: whole over data and each rank updates its shard (DeepSpeed's pipeline engine with its BF16_Optimizer)
    #: instead of reduce-scattered to the shard's owner (the runner's ZeRO-1). Sharded gradients (ZeRO >= 2,
    #: fsdp) are reduce-scattered either way.
    grad_all_reduce: bool = False
    #: Under mixed precision, every microbatch's gradients (compute dtype) are cast to fp32 by one kernel and added
    #: into an fp32 accumulator by another, the first microbatch's too (DeepSpeed's BF16_Optimizer: the pipeline
    #: engine calls ``update_hp_grads`` after each backward, ``hp_grad.add_(lp.grad.to(fp32))``, and the next
    #: backward writes fresh gradients): 2 + 4 and 4 + 4 + 4 bytes a parameter per microbatch (testbed.sim.facts
    #: .accumulate_bytes) instead of the runner's add in the gradient dtype from the second microbatch on; the fp32
    #: buffer is held beside the bf16 gradients (testbed.model.memory: 4 more bytes a parameter).
    grad_accumulate_fp32: bool = False
    #: A parameter's gradient buffer is allocated by the step's first backward that writes it and freed after the
    #: step (PyTorch autograd's ``.grad``, created on first accumulation and reset to None by ``zero_grad``, whose
    #: ``set_to_none`` defaults to True since PyTorch 2.0; FSDP's unsharded gradients, freed after their
    #: reduce-scatter) instead of a buffer live through the whole step (the runner's accumulator, Megatron's and
    #: DeepSpeed's contiguous gradient buffers). Under a pipeline a stage's gradients then grow chunk by chunk
    #: with its backwards, so its activation peak holds only the gradients of the chunks that have run a backward
    #: by then (testbed.pipeline.schedules.held_by_gradient_chunks: the first backward's alone when every forward runs
    #: first). Memory only.
    lazy_grads: bool = False
    #: Context parallelism all-gathers K and V over the context group before a layer's attention and
    #: reduce-scatters dK and dV after its backward, the attention waiting for the gather and the layer's backward
    #: for the reduce-scatter (Llama 3's context parallelism: "the all-gather communication latency is exposed in
    #: the critical path"), instead of the runner's ring, whose step ``k + 1`` block travels while step ``k``
    #: computes (testbed.model.ring). Same attention work; no effect without a context axis.
    context_all_gather: bool = False
    #: Context parallelism merges each ring step's partial attention output into an fp32 running output, and the
    #: backward accumulates dQ, dK and dV in fp32, by eager elementwise kernels (PyTorch's ``context_parallel``:
    #: ``_SDPAMerger`` with ``convert_to_f32``), priced as memory passes beside the ring's attention steps
    #: (testbed.model.ring.merge_bytes) instead of the runner's (not priced). No effect without a context axis.
    context_merge_fp32: bool = False
    #: The context axis shards the model state as the fsdp axis does (parameters, gradients, optimizer state: FSDP
    #: over the flattened data-shard x context mesh, torchtitan's ``dp_shard_cp``) instead of replicating it over
    #: the context ranks (the runner's). One rule (testbed.plan.sharding.state_sharding) for memory, the gathers and
    #: reduce-scatters the simulator times, and the runner's shardings.
    shard_context: bool = False
    #: Each layer's saved activations (the remat policy's checkpoints, the layer input included) are offloaded to
    #: host memory in the forward and fetched back for the backward (MaxText's ``remat_policy: custom`` with
    #: ``decoder_layer_input`` and the saved projections set to ``offload``): the device holds two layers' kept
    #: sets in transit (the one leaving, the one coming back) instead of every layer's. Memory only: the host
    #: transfers overlap the compute (XLA's host-offload scheduling) and are not priced.
    offload_activations: bool = False
    #: Under fp8-mixed the model's parameters are fp8 tensors (1 byte) with their fp8 transpose for the backward
    #: (1 byte), the fp32 master copy in the optimizer state, and the parameter all-gather runs in fp8 (Megatron-
    #: Core's ``--fp8-param-gather``, Transformer Engine's ``fp8_model_init``) instead of bf16 parameters plus the
    #: per-step fp8 casts and transposes (2 + 2 bytes). Memory only (testbed.model.memory).
    fp8_params: bool = False
    #: The loss runs over ``vocab_tiles`` tiles of the tokens (MaxText's ``num_vocab_tiling``): each tile's logits,
    #: loss and gradient are computed and dropped in turn, the hidden states kept, and the backward recomputes each
    #: tile's logits (utils/vocabulary_tiling.py, a custom_vjp whose residuals are the hidden states) instead of the
    #: whole ``[tokens, vocab]`` logits kept from the forward (1). Memory only (the backward's recompute of the
    #: logits, one more head forward, is not priced).
    vocab_tiles: int = 1
    #: Under mixed precision, the dtype of the trained weights and the optimizer's moments (:data:`STATE_DTYPES`):
    #: ``fp32``, an fp32 master copy and fp32 moments beside the bf16 parameters and gradients (the runner's,
    #: testbed.runner.precision; MaxText's default ``weight_dtype: float32`` holds the fp32 weights alone:
    #: ``cast_weights``);
    #: ``bf16``, the bf16 weights are the ones the optimizer updates, with no master copy, and the moments are bf16
    #: too (MaxText's ``weight_dtype: bfloat16``: its base.yml ``mu_dtype: ""`` "inherits from weight_dtype if
    #: unset" (pyconfig.py ``set_mu_dtype``), optimizers.py passes it to ``optax.adamw``, and optax's
    #: ``scale_by_adam`` creates ``nu`` as ``zeros_like(params)``): 2 + 2 + 2 x moments bytes a parameter instead of
    #: 2 + 2 + 4 + 4 x moments, in memory (testbed.model.memory) and in the optimizer update's HBM bytes
    #: (testbed.sim.facts); no effect under fp32.
    state_dtype: str = "fp32"
    #: Under mixed precision with ``state_dtype`` fp32, the trained weights are fp32 and each use casts them to the
    #: compute dtype (MaxText's default ``weight_dtype: float32`` with ``dtype: bfloat16``: the TrainState holds fp32
    #: parameters, its layers cast them, e.g. ``DenseGeneral``'s ``jnp.asarray(kernel, self.dtype)``, and
    #: ``jax.grad`` returns gradients in the parameters' dtype) instead of the runner's bf16 parameters beside an fp32
    #: master copy: no kept compute-dtype copy, 4 + 4 + 4 x moments bytes a parameter held (testbed.model.memory)
    #: instead of 2 + 2 + 4 + 4 x moments. The casts are per use, inside the gathered blocks, so the gathers and
    #: gradient reductions move compute-dtype values as before, and the optimizer update moves the same HBM bytes
    #: (4 + 2 x 4 + 2 x 4 x moments against 2 + 2 + 2 x (4 + 4 x moments)): memory only.
    cast_weights: bool = False

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
        for name in ("pipeline_blocking_sends", "grad_all_reduce", "grad_accumulate_fp32", "lazy_grads",
                     "context_all_gather", "context_merge_fp32", "shard_context", "offload_activations", "fp8_params",
                     "cast_weights"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} must be true or false, got {getattr(self, name)!r:.40}",
                                 field=f"runtime.{name}")


#: Values of :attr:`RuntimeSpec.recompute`.
RECOMPUTE = ("runner", "block", "op", "save-qkv", "save-attention-dots", "save-dots")
#: Values of :attr:`RuntimeSpec.framework`.
FRAMEWORKS = ("jax", "pytorch")
#: Values of :attr:`RuntimeSpec.grad_reduce_dtype`.
GRAD_REDUCE_DTYPES = ("grad", "fp32")
#: Values of :attr:`RuntimeSpec.moe_dispatch` (testbed.model.dispatch reads the same names).
MOE_DISPATCH = ("gather", "einsum", "megablox")
#: Values of :attr:`RuntimeSpec.attention_kernel`.
ATTENTION_KERNELS = ("runner", "flash2", "flash3", "cudnn", "triton", "splash")
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
    "xla": {"fsdp_prefetch": 1, "scan_layers": True},
    "megatron": {"recompute": "block", "grad_bucket_bytes": 160e6, "grad_reduce_dtype": "fp32",
                 "pipeline_scatter_gather": True, "attention_kernel": "cudnn", "fp8_saved_inputs": True,
                 "framework": "pytorch", "pipeline_blocking_sends": True},
    "nemo": {"recompute": "block", "grad_bucket_bytes": 160e6, "tp_comm_overlap": True, "grad_reduce_overlap": True,
             "attention_kernel": "cudnn", "fp8_saved_inputs": True, "framework": "pytorch", "fp8_params": True},
    "deepspeed": {"recompute": "block", "grad_bucket_bytes": 1e9, "fsdp_prefetch": 1, "framework": "pytorch",
                  "grad_reduce_dtype": "fp32", "pipeline_scatter_gather": True, "pipeline_blocking_sends": True,
                  "grad_all_reduce": True, "grad_accumulate_fp32": True},
    "fsdp": {"recompute": "block", "grad_reduce_overlap": True, "fsdp_prefetch": 1, "framework": "pytorch"},
    "torchtitan": {"recompute": "op", "grad_reduce_overlap": True, "grad_reduce_dtype": "fp32",
                   "fsdp_prefetch": 1, "attention_kernel": "flash2", "fp8_scaling": "current", "framework": "pytorch",
                   "context_merge_fp32": True, "shard_context": True, "lazy_grads": True},
    "llm-foundry": {"recompute": "block", "grad_reduce_overlap": True, "grad_reduce_dtype": "fp32",
                    "attention_kernel": "triton", "fused_loss": True, "framework": "pytorch"},
    # Meta's Llama 3 stack is not public; of its mechanisms the framework and what the Llama 3 paper states
    # (fp32 gradient reduce-scatter) are stated, and PyTorch FSDP's gradient lifetime (see SOURCES).
    "meta": {"framework": "pytorch", "grad_reduce_dtype": "fp32", "context_all_gather": True, "lazy_grads": True},
}


def runner_differences(spec: RuntimeSpec) -> tuple[str, ...]:
    """The fields of ``spec`` whose values the runner does not execute (it runs its own behaviour, the defaults):
    the simulator prices them, the runner says it runs without them (testbed.runner.train). The runner executes
    ``recompute: save-dots`` (testbed.runner.model.stage_forward; under full remat the value is its own) and
    ``matmul_precision: highest`` (testbed.runner.precision.matmul_precision)."""
    default = RuntimeSpec()
    executed = {"recompute": ("save-dots",), "matmul_precision": ("highest",)}
    return tuple(f.name for f in fields(RuntimeSpec)
                 if f.name != "profile" and getattr(spec, f.name) != getattr(default, f.name)
                 and getattr(spec, f.name) not in executed.get(f.name, ()))


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
