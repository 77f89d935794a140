"""Where each named runtime profile's values come from: one source per (profile, field).

A profile in :data:`testbed.plan.runtime.PROFILES` states a stack's mechanisms; each value names here the file
and line of the stack's code, or its documentation, that says the stack does it (tests/test_runtime_spec.py
checks that every value has one). Kept apart from the fields themselves, which say what each mechanism is.
"""

from __future__ import annotations

__all__ = ["SOURCES"]

_MEGATRON_BLOCK = ("Megatron-LM megatron/core/transformer/transformer_block.py `_checkpointed_forward`: "
                   "--recompute-granularity full checkpoints whole TransformerLayers (tensor_parallel.checkpoint), "
                   "so the backward reruns each layer's whole forward with its tensor-parallel collectives")
_MEGATRON_BUCKET = ("Megatron-LM megatron/core/distributed/distributed_data_parallel.py: bucket_size defaults to "
                    "max(40000000, 1000000 * dp_size) parameters; bf16 training reduces fp32 main grads "
                    "(arguments.py forces accumulate_allreduce_grads_in_fp32 for --bf16): 40e6 x 4 bytes")
_TE_CUDNN = ("Transformer Engine transformer_engine/pytorch/attention.py (TE 1.x; "
             "attention/dot_product_attention/utils.py in 2.x) `get_attention_backend`: with both FlashAttention "
             "and FusedAttention (cuDNN, F16_arbitrary_seqlen) available on compute capability >= 9.0, 'Disabling FlashAttention to give FusedAttention preference on "
             "Hopper+ for performance reasons'; Megatron-Core's TEDotProductAttention runs it (--attention-backend "
             "auto). On Ampere TE runs flash-attn 2, for which testbed has no A100 figure (priced as the runner's)")
_FSDP_OVERLAP = ("torch/distributed/fsdp/_runtime_utils.py `_post_backward_hook` (FSDP1) and FSDP2's "
                 "post-backward: each unit's gradients are reduce-scattered (and all-reduced over HSDP replicas) "
                 "as soon as its backward is done, while earlier units' backward runs")

_TE_FP8_INPUTS = ("Transformer Engine transformer_engine/pytorch/module/linear.py `_Linear.forward` (and "
                  "layernorm_linear.py, layernorm_mlp.py): under fp8_autocast the GEMM input is cast to fp8 (the fused "
                  "norm writes its output in fp8) and that fp8 tensor is what save_for_backward keeps for the wgrad "
                  "GEMM; Megatron-Core's TransformerLayer is built of these TE modules (transformer_impl "
                  "'transformer_engine', the default of its GPT layer specs)")

_PYTORCH = "{} is a PyTorch program: autograd's saved tensors and the caching allocator decide what lives"

#: The gradient lifetime of PyTorch stacks that shard data parallelism with FSDP (``{}``: the stack).
_LAZY_GRADS = (
    "{}: autograd's AccumulateGrad creates a parameter's .grad at the first backward that writes it, and "
    "torch.optim.Optimizer.zero_grad(set_to_none=True) (the default since PyTorch 2.0) frees it after the step; FSDP2 "
    "(torch/distributed/fsdp/_fully_shard/_fsdp_param.py) accumulates a microbatch's unsharded gradient into "
    "unsharded_accumulated_grad only from the first backward on (to_accumulated_grad_if_needed) and frees it after "
    "the step's reduce-scatter, so no gradient buffer exists at a step's start")

#: How an eager PyTorch program runs where XLA's compiler would decide (``{}``: the stack), per field of
#: testbed.plan.runtime.PYTORCH_PROGRAM.
_EAGER_SOURCES = {
    "compiler_buffers": (
        "{}: eager kernels allocate their outputs from the CUDA caching allocator and autograd's saved tensors "
        "keep what the backward reads; no compiler assigns the step's buffers (nothing plays XLA's buffer "
        "assignment, whose kept sets testbed.model.xla_tpu states for XLA:TPU)"),
    "microbatch_scan": (
        "{}: gradient accumulation is a Python loop calling forward and backward once per microbatch "
        "(Megatron-Core pipeline_parallel/schedules.py forward_backward_no_pipelining; DDP's no_sync and FSDP's "
        "accumulation likewise), autograd adding each backward's gradients into .grad: no compiled loop, no fusion "
        "of the add into the backward's GEMMs"),
    "allreduce_combiner": (
        "{}: collectives are NCCL calls issued eagerly as hooks and autograd reach them (DDP/Megatron gradient "
        "buckets, FSDP's per-unit reduce-scatter); no compiler pass (XLA's AllReduceCombiner) merges independent ones"),
    "gather_combine_bytes": (
        "{}: a sharded unit's parameters are one flat buffer gathered and reduce-scattered by one collective "
        "whatever its size (FSDP's FlatParameter, FSDP2's one all-gather per fully_shard group, ZeRO-3's "
        "partitioned parameter groups): no combine threshold"),
    "fsdp_edge_blocks": (
        "{}: the FSDP wrapping of the embedding and the head is the stack's auto-wrap policy, not stated per stack "
        "here; testbed.model.blocks.own_blocks lets them ride with the first and the last layer's unit "
        "(Composer's FSDP keeps them in the root unit; a per-stack value is a known limit)"),
    "sp_gathered_inputs": (
        "{}: under sequence parallelism a column-parallel linear saves its sequence shard and all-gathers it again in "
        "the backward for the weight gradient (Megatron-Core tensor_parallel/layers.py "
        "LinearWithGradAccumulationAndAsyncCommunication: ctx.save_for_backward(input) before the forward's "
        "all-gather into the global 'mpu' buffer, dist_all_gather_func again in backward; Korthikanti et al. 2022 "
        "Sec. 4.2.2); the same rule for every PyTorch stack (a per-stack value is a known limit)"),
    "in_place_collectives": (
        "{}: a tensor-parallel collective is a c10d call on the autograd tensor, torch.distributed.all_reduce "
        "reducing it in place (Megatron-Core tensor_parallel/mappings.py _reduce: "
        "torch.distributed.all_reduce(input_, group=group); reduce_scatter_tensor writes a 1/t output)"),
    "grad_hooks": (
        "{}: autograd's AccumulateGrad adds each backward's gradient into the parameter's .grad (or the stack's "
        "gradient buffer) in place, and sharded gradients are reduce-scattered unit by unit by the post-backward hook "
        "(torch/distributed/fsdp/_runtime_utils.py `_post_backward_hook`, FSDP2's post-backward, DeepSpeed ZeRO's "
        "reduce_ready_partitions_and_remove_grads hooks): no microbatch's gradients exist whole beside the accumulator"),
    "weight_grads_last": (
        "{}: autograd runs each node's backward whole: a linear's weight gradient in the same call as its input "
        "gradient (torch's MmBackward/AddmmBackward, tools/autograd/derivatives.yaml; Megatron-Core's "
        "LinearWithGradAccumulationAndAsyncCommunication.backward computes grad_input then grad_weight), layer by "
        "layer, no scheduler moving the weight gradients after the input-gradient chain"),
    "limit_aware_compile": (
        "{}: eager kernels and the CUDA caching allocator hold what autograd saves; no compiler sees the device's "
        "memory limit (nothing plays XLA's HloRematerialization or the latency-hiding scheduler's memory-pressure "
        "policy)"),
    "kept_norm_inputs": (
        "{}: autograd's layer-norm node saves its input with the row mean and rstd and its backward recomputes the "
        "normalised input from them (PyTorch tools/autograd/derivatives.yaml `native_layer_norm`: "
        "native_layer_norm_backward(grad, input, normalized_shape, result1, result2, weight, bias); Apex/Transformer "
        "Engine's fused norms likewise save input, mean and rstd): no normalised copy lives from forward to backward"),
    "kept_layout_copies": (
        "{}: attention's Q and K are the tensors the attention function saves as its own inputs; no compiler layout "
        "pass writes a head-major copy of them outside a checkpoint (nothing plays XLA's layout assignment)"),
    "fused_residual_adds": (
        "{}: the residual add is an eager kernel that writes the sum, and torch.utils.checkpoint (Megatron-Core's "
        "tensor_parallel/random.py CheckpointFunction) saves only the checkpointed block's inputs: the summands are "
        "freed once the add has run (no compiler fuses the add into its consumers)"),
}
_EAGER_STACKS = {"megatron": "Megatron-LM (PyTorch)", "nemo": "Megatron-Bridge (Megatron-Core on PyTorch)",
                 "deepspeed": "DeepSpeed (PyTorch)", "fsdp": "torch.distributed.fsdp",
                 "torchtitan": "torchtitan (PyTorch FSDP2)", "llm-foundry": "llm-foundry (Composer on PyTorch)",
                 "meta": "Meta's Llama 3 stack (PyTorch, arXiv:2407.21783 Sec. 3.3.4)"}

#: ``{(profile, field): "where the value comes from"}`` (a file and line of the stack, or its docs).
_MCORE_DISPATCH = ("Megatron-Core megatron/core/transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher: "
                   "token_dispatch all-to-alls each rank's own tokens (its sequence-parallel shard) over the expert "
                   "group, then dispatch_postprocess gathers them over the tensor group when tp_size > 1 "
                   "(gather_from_sequence_parallel_region(global_input_tokens, group=self.tp_group)); the combine "
                   "reduce-scatters over the tensor group (reduce_scatter_to_sequence_parallel_region) before its "
                   "all-to-all")
SOURCES: dict[tuple[str, str], str] = {
    ("megatron", "recompute"): _MEGATRON_BLOCK,
    ("megatron", "grad_bucket_bytes"): _MEGATRON_BUCKET,
    ("megatron", "grad_reduce_dtype"): (
        "Megatron-LM megatron/training/arguments.py validate_args: with --bf16, "
        "accumulate_allreduce_grads_in_fp32 is set (\"bfloat16 requires gradient accumulation and all-reduce to be "
        "performed in fp32\"); DDP reduces the fp32 main_grad buffers"),
    ("megatron", "pipeline_scatter_gather"): (
        "Megatron-LM megatron/training/arguments.py: --no-scatter-gather-tensors-in-pipeline (dest "
        "scatter_gather_tensors_in_pipeline) defaults to True; p2p_communication.py sends "
        "split_tensor_into_1d_equal_chunks of the tensor and gather_split_1d_tensor rebuilds it on the receiver"),
    ("nemo", "recompute"): _MEGATRON_BLOCK + " (Megatron-Bridge runs Megatron-Core's TransformerBlock)",
    ("nemo", "grad_bucket_bytes"): _MEGATRON_BUCKET + " (Megatron-Bridge's DistributedDataParallelConfig)",
    ("nemo", "tp_comm_overlap"): (
        "Megatron-Bridge scripts/performance/configs/llama/llama3_llm_pretrain.py: "
        "llama3_70b_pretrain_config_h100 sets comm_overlap.tp_comm_overlap_cfg = "
        "userbuffers_{bf16,fp8}_h100_h8192_tp4_mbs1_seqlen8192 (TE userbuffers: TP all-gather/reduce-scatter "
        "overlapped with the GEMMs); the 8B configs set tp_comm_overlap when tensor parallel > 1"),
    ("nemo", "grad_reduce_overlap"): (
        "Megatron-Bridge src/megatron/bridge/recipes/llama/llama3.py: the recipes' "
        "DistributedDataParallelConfig(overlap_grad_reduce=True, overlap_param_gather=True, "
        "use_distributed_optimizer=True)"),
    ("deepspeed", "recompute"): (
        "DeepSpeed deepspeed/runtime/activation_checkpointing/checkpointing.py `checkpoint`: Megatron-DeepSpeed "
        "checkpoints whole transformer layers (--checkpoint-activations, checkpoint_num_layers 1)"),
    ("deepspeed", "grad_bucket_bytes"): (
        "DeepSpeed deepspeed/runtime/zero/config.py: reduce_bucket_size default 5e8 elements (2 bytes each in "
        "bf16/fp16); overlap_comm defaults to False for ZeRO stages 1-2 (ZERO_OPTIMIZATION_OVERLAP_COMM_DEFAULT)"),
    ("fsdp", "recompute"): (
        "torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py: FSDP's activation checkpointing "
        "wraps each block (apply_activation_checkpointing with a block check_fn), rerunning its whole forward"),
    ("fsdp", "grad_reduce_overlap"): _FSDP_OVERLAP,
    ("torchtitan", "recompute"): (
        "torchtitan torchtitan/models/llama3/train_configs/llama3_8b.toml: activation_checkpoint mode "
        "'selective', selective_ac_option 'op'; torchtitan/distributed/activation_checkpoint.py "
        "`_get_custom_policy`: saves the outputs of SDPA and collectives and of every other mm "
        "('Only save every other mm'), recomputing the rest of the block; 'full' is checkpoint_wrapper per block"),
    ("torchtitan", "grad_reduce_overlap"): _FSDP_OVERLAP + " (torchtitan uses FSDP2, fully_shard per block)",
    ("torchtitan", "grad_reduce_dtype"): (
        "torchtitan torchtitan/config/job_config.py: training.mixed_precision_reduce = 'float32' (FSDP2's "
        "MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32))"),
    ("llm-foundry", "recompute"): (
        "llm-foundry llmfoundry/models/mpt/modeling_mpt.py `activation_checkpointing_fn` (True for MPTBlock): "
        "Composer's FSDP wraps each block in checkpoint_wrapper, rerunning its whole forward"),
    ("llm-foundry", "grad_reduce_overlap"): _FSDP_OVERLAP + " (Composer runs PyTorch FSDP FULL_SHARD)",
    ("llm-foundry", "grad_reduce_dtype"): (
        "Composer composer/distributed/mosaic_parallelism.py `get_mixed_precision`: mixed_precision 'DEFAULT' "
        "(the MPT yamls' fsdp_config) is MixedPrecision(param_dtype=autocast dtype, reduce_dtype=torch.float32)"),
    ("megatron", "fp8_saved_inputs"): _TE_FP8_INPUTS,
    ("nemo", "fp8_saved_inputs"): _TE_FP8_INPUTS + " (Megatron-Bridge runs Megatron-Core with TE)",
    ("megatron", "framework"): _PYTORCH.format("Megatron-LM (github.com/NVIDIA/Megatron-LM)"),
    ("nemo", "framework"): _PYTORCH.format("Megatron-Bridge (Megatron-Core on PyTorch)"),
    ("deepspeed", "framework"): _PYTORCH.format("DeepSpeed (github.com/deepspeedai/DeepSpeed)"),
    ("fsdp", "framework"): _PYTORCH.format("torch.distributed.fsdp"),
    ("torchtitan", "framework"): _PYTORCH.format("torchtitan (github.com/pytorch/torchtitan)"),
    ("llm-foundry", "framework"): _PYTORCH.format("llm-foundry (Composer on PyTorch)"),
    ("megatron", "moe_sequence_dispatch"): _MCORE_DISPATCH,
    ("nemo", "moe_sequence_dispatch"): _MCORE_DISPATCH + " (Megatron-Bridge runs Megatron-Core)",
    ("xla", "pad_sequence_shards"): (
        "GSPMD (Xu et al. 2021, arXiv:2105.04663, Sec. 3.3 'Static constraints', uneven partitioning): a dimension "
        "not divisible by its shard count is split into ceil(size / shards) per shard, the last padded, so an "
        "activation sharded over a 12-way model axis at sequence 2048 compiles (171 tokens a shard, 4 padded); "
        "Megatron-LM instead asserts divisibility (megatron/core/tensor_parallel/mappings.py "
        "_split_along_first_dim: 'First dimension of the tensor should be divisible by tensor parallel size')"),
    ("xla", "scan_layers"): (
        "MaxText MaxText/configs/base.yml: scan_layers: True (the decoder's layers run as one nn.scan over stacked "
        "parameters; its runs log 'Config param scan_layers: True')"),
    ("meta", "framework"): _PYTORCH.format(
        "Meta's Llama 3 stack (Llama Team 2024, arXiv:2407.21783, Sec. 3.3.4: its collective tracing is PyTorch's "
        "built-in NCCL flight recorder)"),
    ("llm-foundry", "fused_loss"): (
        "llm-foundry llmfoundry/models/mpt/modeling_mpt.py ComposerMPTCausalLM: loss_fn defaults to "
        "'fused_crossentropy', flash_attn.losses.cross_entropy.CrossEntropyLoss (a Triton kernel that saves the "
        "logits and the per-row lse and writes the logits' gradient in their dtype)"),
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
    ("megatron", "attention_kernel"): _TE_CUDNN,
    ("nemo", "attention_kernel"): _TE_CUDNN + " (Megatron-Bridge's recipes run Megatron-Core with TE)",
    ("torchtitan", "attention_kernel"):
        "torchtitan (end of 2024, torchtitan/utils.py `get_train_context`): with context parallelism the step runs "
        "under sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]) ('currently we only "
        "support these two SDP backends. TODO (xilunwu): support cuDNN backend'); without it Llama's "
        "F.scaled_dot_product_attention(is_causal=True) takes PyTorch's default order (aten/src/ATen/native/"
        "transformers/cuda/sdp_utils.cpp priority_order: flash_attention, efficient_attention, math, "
        "cudnn_attention): PyTorch's vendored FlashAttention-2 either way",
    ("torchtitan", "fp8_scaling"):
        "torchtitan's float8 converter swaps nn.Linear for torchao's Float8Linear with tensorwise dynamic scaling "
        "(its default recipe): torchao/float8/float8_scaling_utils.py hp_tensor_to_float8_dynamic computes the "
        "tensor's amax (tensor_to_scale, max(abs(x)) over the whole tensor) and then casts with that scale "
        "(hp_tensor_and_scale_to_float8): a whole-tensor reduction that must finish before any value is cast, so "
        "the tensor (or, compiled, its producer's inputs) is read twice",
    ("llm-foundry", "attention_kernel"):
        "llm-foundry scripts/train/benchmarking/sweep.sh (the MPT benchmark tables' runs: GIT_COMMIT v0.0.4, "
        "mosaicml/pytorch:2.0.1_cu118) calls submit_benchmarks.py without --attn_impl, whose default is 'triton' "
        "(as the pretrain yamls' attn_config.attn_impl): llm-foundry's flash_attn_triton.py, FlashAttention's Triton "
        "kernel (causal tiles skipped). No published H100 figure for it: priced as the runner's kernel",
    ("megatron", "pipeline_blocking_sends"): (
        "Megatron-LM megatron/core/pipeline_parallel/p2p_communication.py `_communicate`: the 1F1B schedule's "
        "send_forward_recv_backward / send_backward_recv_forward run with wait_on_reqs=True (the batch_isend_irecv "
        "requests are waited on, then torch.cuda.synchronize() with batch_p2p_sync) before the next step's compute; "
        "overlap_p2p_comm, which defers the waits, defaults to False (ModelParallelConfig). The 2021 SC21 code "
        "(megatron/p2p_communication.py at de7dc40f88) waits on every request and synchronizes the same way"),
    ("deepspeed", "pipeline_blocking_sends"): (
        "DeepSpeed deepspeed/runtime/pipe/engine.py: TrainSchedule's SendActivation/SendGrad/RecvActivation/RecvGrad "
        "are instructions run in order between ForwardPass and BackwardPass (_exec_send_activations calls "
        "p2p.send, deepspeed/runtime/pipe/p2p.py: dist.send, or a broadcast in a two-rank group, synchronous)"),
    ("deepspeed", "pipeline_scatter_gather"): (
        "DeepSpeed deepspeed/runtime/pipe/engine.py: is_pipe_partitioned = is_model_parallel and "
        "pipeline['pipe_partitioned'] (default True, deepspeed/runtime/config.py get_pipeline_config, "
        "grad_partitioned too): a stage sends its tensor rank's PartitionedTensor part and the receiver rebuilds "
        "the whole with .full(), an all-gather over the tensor (slice-parallel) group"),
    ("deepspeed", "grad_reduce_dtype"): (
        "DeepSpeed deepspeed/runtime/pipe/engine.py: 'BF16 Optimizer is hardcoded for fp32 gradient "
        "accumulation'; with bf16 (BF16_Optimizer, bf16 + ZeRO-1, as Megatron-DeepSpeed's BLOOM runs) "
        "_exec_reduce_grads calls _bf16_reduce_grads, buffered_allreduce_fallback over the fp32 gradients"),
    ("deepspeed", "grad_all_reduce"): (
        "DeepSpeed deepspeed/runtime/pipe/engine.py `_exec_reduce_grads`: with the BF16_Optimizer (bf16 + ZeRO-1) "
        "`_bf16_reduce_grads` calls buffered_allreduce_fallback(elements_per_buffer=MEMORY_OPT_ALLREDUCE_SIZE): "
        "every gradient all-reduced over the data-parallel group in 5e8-element buffers; the optimizer then "
        "updates the rank's partition and all-gathers the bf16 parameters"),
    ("deepspeed", "grad_accumulate_fp32"): (
        "DeepSpeed deepspeed/runtime/pipe/engine.py `_exec_backward_pass` (since 'bf16+pipeline parallelism', #1801, "
        "2022, the code BLOOM trained with): with the BF16_Optimizer every stage calls clear_lp_grads() before and "
        "optimizer.update_hp_grads(clear_lp_grads=False) after each microbatch's backward (the last stage through "
        "BF16_Optimizer.backward, which does the same); deepspeed/runtime/bf16_optimizer.py `update_hp_grads` runs "
        "hp_grad.data.add_(lp.grad.data.to(hp_grad.dtype)) per parameter: an fp32 copy of the bf16 gradient, then an "
        "add into the fp32 gradient buffer, eager kernels"),
    ("meta", "grad_reduce_dtype"): (
        "Llama Team, The Llama 3 Herd of Models (arXiv:2407.21783) Sec. 3.3.2, 'Numerical stability': FP32 "
        "gradient accumulation over micro-batches, and gradients reduce-scattered in FP32 across the data-parallel "
        "workers in FSDP"),
    ("torchtitan", "context_merge_fp32"): (
        "torchtitan (end of 2024, torchtitan/utils.py create_context_parallel_ctx) runs PyTorch's context_parallel "
        "(torch/distributed/tensor/experimental/_attention.py): _templated_ring_attention merges each step's SDPA "
        "output with _SDPAMerger (convert_to_f32: out.to(float32), then out - sigmoid(block_lse - lse) * "
        "(out - block_out), eager) and its backward adds each step's dq/dk/dv into float32 accumulators"),
    ("meta", "context_all_gather"): (
        "Llama Team, The Llama 3 Herd of Models (arXiv:2407.21783) Sec. 3.3.2, 'Context parallelism': 'we adopt an "
        "all-gather based method where we first all-gather the key (K) and value (V) tensors, and then compute "
        "attention output for the local query (Q) tensor chunk. Although the all-gather communication latency is "
        "exposed in the critical path, we still adopt this approach' (document masks; K and V small under GQA)"),
    ("meta", "lazy_grads"): _LAZY_GRADS.format(
        "Meta's Llama 3 stack (arXiv:2407.21783 Sec. 3.3.2: data parallelism is PyTorch FSDP, whose gradients are "
        "reduce-scattered in fp32)"),
    ("torchtitan", "lazy_grads"): _LAZY_GRADS.format(
        "torchtitan (FSDP2 fully_shard per block; its train step calls optimizers.zero_grad() with PyTorch's default "
        "set_to_none)"),
    ("torchtitan", "shard_context"): (
        "torchtitan torchtitan/parallelisms/parallelize_llama.py (Dec 2024, 82f7387f8) `parallelize_llama`: 'if "
        "parallel_dims.dp_shard_enabled or parallel_dims.cp_enabled: # apply FSDP or HSDP, potentially with Context "
        "Parallel' applies fully_shard over world_mesh['dp_shard_cp'], the dp_shard and cp mesh dims flattened "
        "(parallel_dims.py build_mesh): the parameters, gradients and optimizer state are sharded over data-shard "
        "x context ranks, even with dp_shard 1"),
    ("nemo", "fp8_params"): (
        "Megatron-Bridge src/megatron/bridge/training/mixed_precision.py: the per-tensor FP8 recipes "
        "(bf16_with_fp8_current_scaling_mixed, the FP8-CS performance configs', and "
        "bf16_with_fp8_delayed_scaling_mixed) set fp8_param_gather = True (kept in sync with fp8_param; the "
        "blockwise/subchannel recipes, which testbed does not model, do not): "
        "Megatron-Core builds the model under Transformer Engine's fp8_model_init, so the compute parameters are "
        "Float8Tensors (fp8 data and its transpose), the distributed optimizer keeps the fp32 master and "
        "all-gathers the parameters in fp8"),
    ("xla", "fsdp_prefetch"):
        "XLA's latency-hiding scheduler (xla/service/latency_hiding_scheduler.cc; on by default on TPU, "
        "--xla_gpu_enable_latency_hiding_scheduler on GPU) starts a layer's async all-gather during the "
        "previous layer's compute, bounded by its memory limit: the next block's weights, one ahead",
}
_TITAN_GROUPED = ("torchtitan torchtitan/models/moe/moe.py: GroupedExperts runs torch._grouped_mm over the tokens "
                  "each expert was routed (offsets from num_tokens_per_expert, padded only to the kernel's alignment); "
                  "no capacity, no drop")
#: A dropless MoE over the routed tokens alone (testbed.plan.runtime.ROUTED_DROPLESS), per profile.
_ROUTED_DROPLESS = {
    "xla": ("MaxText src/maxtext/configs/base.yml: megablox: true, sparse_matmul: true, capacity_factor: -1.0 "
            "('no dropping by default'): the routed experts run megablox's grouped matmul (ragged dot) over the "
            "sorted routed tokens (src/maxtext/layers/moe.py sparse_matmul), no capacity buffers"),
    "megatron": ("Megatron-Core megatron/core/transformer/moe/experts.py GroupedMLP/TEGroupedMLP: the grouped GEMM "
                 "over the permuted tokens with tokens_per_expert; moe_expert_capacity_factor None (the default) is "
                 "dropless, no padding to a capacity (moe_pad_expert_input_to_capacity off)"),
    "nemo": ("Megatron-Bridge runs Megatron-Core's MoE layer: experts.py GroupedMLP over tokens_per_expert, dropless "
             "without a capacity factor"),
    "deepspeed": ("DeepSpeed deepspeed/moe/sharded_moe.py top1gating/top2gating: with drop_tokens False the capacity "
                  "is the busiest expert's count (torch.max(exp_counts), all-reduced MAX over the group), the "
                  "plan's expert_imbalance, not the sequence"),
    "fsdp": ("torch.distributed.fsdp shards parameters and moves no tokens: an MoE layer under it is the model's own "
             "PyTorch code, priced as PyTorch's dropless grouped GEMM over the routed tokens (" + _TITAN_GROUPED + ")"),
    "torchtitan": _TITAN_GROUPED,
    "llm-foundry": ("llm-foundry llmfoundry/models/layers/ffn.py build_mb_dmoe: MoE layers are MegaBlocks' dMoE, "
                    "block-sparse grouped matmuls over the routed tokens (Gale et al. 2022, dropless)"),
    "meta": ("Llama 3 is dense (arXiv:2407.21783 Sec. 3.1); the stack's MoE is not published: priced as PyTorch's "
             "dropless grouped GEMM over the routed tokens (" + _TITAN_GROUPED + ")"),
}
SOURCES.update({(profile, "moe_padded_dropless"): text for profile, text in _ROUTED_DROPLESS.items()})
SOURCES.update({(profile, field): text.format(stack) for profile, stack in _EAGER_STACKS.items()
                for field, text in _EAGER_SOURCES.items()})
