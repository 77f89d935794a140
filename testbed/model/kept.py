"""What one microbatch's forward keeps for its backward under the plan's stack: per layer, the head, the loss.

``testbed.model.activations`` counts what the runner's XLA program keeps per remat mode. A stack's mechanisms
(``plan.runtime``, testbed.plan.runtime) change that set, and the memory model (testbed.model.memory) reads
them here, one rule per mechanism:

- ``recompute: op`` with selective remat (torchtitan's per-op policy): the block's input, the outputs of every
  other matmul in the block's order, the attention kernel's output and row log-sum-exp and, under sequence
  parallelism, the reduce-scatters' outputs (:func:`op_saved_bytes`); the rest of the block is recomputed in
  its backward (:func:`recompute_workspace_bytes`).
- ``recompute: save-dots`` with selective remat (MaxText's ``minimal``): the block's input and every weight
  matmul's output the backward reads, all but the MLP's down projection (:func:`dots_saved_bytes`); attention
  and the elementwise work are recomputed.
- ``fp8_saved_inputs`` with fp8-mixed (Transformer Engine): each linear keeps the fp8 cast of its input,
  1 byte a value, instead of the compute-dtype tensor (:func:`fp8_input_savings`).
- ``fused_loss`` (flash-attn's cross-entropy kernel): the head keeps compute-dtype logits and their row
  log-sum-exp, and the loss backward writes one compute-dtype gradient (:func:`head_kept_bytes`,
  :func:`loss_workspace_bytes`).
- ``vocab_tiles`` (MaxText's ``num_vocab_tiling``): no logits kept; one tile's recomputed logits and loss buffers
  at a time.
- The runner's XLA program (read from the compiled HLO of ``benchmarks/memory_vs_xla.py``'s steps), one field a
  mechanism: ``sp_gathered_inputs``, the all-gathered input of each column-parallel matmul under sequence
  parallelism (:func:`sp_gathered_bytes`); ``in_place_collectives`` false, both halves of the backward's tensor
  collectives (:func:`tensor_collective_workspace`); ``weight_grads_last``, the operands of the weight gradients
  scheduled after the layers' input-gradient chain (:func:`deferred_backward_bytes`); ``kept_norm_inputs``, each
  layer's LayerNorm-backward normalised input under a tensor axis (:func:`normalized_input_bytes`);
  ``fused_residual_adds``, the residual stream's summands and the last block's recompute beside the loss backward
  under full remat (:func:`residual_summand_bytes`, :func:`loss_instant_recompute`); ``kept_layout_copies``, the
  head-major Q and K copies under the runner's selective remat (:func:`selective_copies_bytes`). The PyTorch values
  keep Korthikanti et al. (2022)'s accounting.
"""

from __future__ import annotations

from testbed.model.activations import (FLASH_BYTES, LOSS_BYTES, activation_bytes_per_layer, head_activation_bytes,
                                       sequence_share,
                                       norms, xla_only_bytes_per_layer)
from testbed.model.ring import rank_spec
from testbed.plan.spec import Attention, ModelSpec, Plan, Precision, Remat

__all__ = ["layer_kept_bytes", "op_saved_bytes", "fp8_input_savings", "recompute_workspace_bytes", "head_kept_bytes",
           "saves_dots", "saves_flash_residuals", "keeps_flash_under_full", "flash_kept_bytes", "dots_policy", "dots_saved_bytes", "loss_workspace_bytes", "block_matmul_outputs", "sp_gathered_bytes", "xla_program",
           "normalized_input_bytes", "tensor_collective_workspace", "residual_summand_bytes",
           "loss_instant_recompute", "device_layer_sets", "selective_copies_bytes", "weight_grads_deferred",
           "deferred_backward_bytes"]


def layer_kept_bytes(plan: Plan) -> int:
    """Bytes one layer keeps from its forward until its backward, one microbatch, one device of the plan."""
    spec, b, t, sp = rank_spec(plan), plan.microbatch_size, plan.mesh.tensor, plan.sequence_parallel
    if plan.remat is Remat.SELECTIVE and plan.runtime.recompute == "op":
        return op_saved_bytes(plan)
    if saves_dots(plan):
        return dots_saved_bytes(plan)
    kept = activation_bytes_per_layer(spec, b, plan.precision, plan.remat, t, sp)
    kept += residual_summand_bytes(plan) if plan.remat is Remat.FULL else _xla_layer_extra(plan)
    kept += selective_copies_bytes(plan) + (flash_kept_bytes(plan) if keeps_flash_under_full(plan) else 0)
    if plan.precision is Precision.FP8_MIXED and plan.runtime.fp8_saved_inputs and plan.remat is not Remat.FULL:
        kept -= fp8_input_savings(plan)
    return kept


def device_layer_sets(plan: Plan, sets: int) -> int:
    """How many of ``sets`` layer kept sets (one layer, one microbatch) are in device memory at once.

    All of them, unless ``runtime.offload_activations`` sends them to host memory: then the one being offloaded
    in the forward (or fetched back for the backward) and the next one, in transit, at most two."""
    return min(sets, 2) if plan.runtime.offload_activations else sets


def block_matmul_outputs(spec: ModelSpec, tokens: int, tensor: int) -> tuple[int, ...]:
    """Values of each matmul output of one block on one tensor rank, in the forward's order: Q, K, V, the out
    projection, then the MLP's (SwiGLU: gate, up, down; GELU: in, out). Column-parallel outputs are split over
    the tensor ranks; a row-parallel output (out projection, MLP down) is the whole ``[tokens, d_model]`` partial
    sum before its reduction."""
    n, t = tokens, tensor
    kv = n * spec.kv_dim // t if spec.kv_split(t) else n * spec.kv_dim
    mlp_in = (n * spec.d_ff // t,) * (spec.mlp_matrices - 1)
    return (n * spec.q_dim // t, kv, kv, n * spec.d_model, *mlp_in, n * spec.d_model)


def op_saved_bytes(plan: Plan) -> int:
    """One layer's kept bytes under torchtitan's per-op selective recompute (``runtime.recompute: op``).

    torchtitan's policy (torchtitan/distributed/activation_checkpoint.py ``_get_custom_policy``) saves the
    outputs of the attention kernel (its output and fp32 row log-sum-exp), of the tensor-parallel
    reduce-scatters, and of every other ``mm`` (the 1st, 3rd, ...: Q, V, the MLP's first matrix, and SwiGLU's
    down projection); the checkpointed block keeps its input besides. Everything else (norms, RoPE, the
    activation function, the other matmuls) is recomputed in the backward.
    """
    spec, b, t, sp = rank_spec(plan), plan.microbatch_size, plan.mesh.tensor, plan.sequence_parallel
    c, n = plan.precision.compute_bytes, b * spec.seq_len
    residual = sequence_share(n * spec.d_model, spec.seq_len, t) if sp else n * spec.d_model  # SP: its shard
    saved = sum(block_matmul_outputs(spec, n, t)[::2])
    attention = n * spec.q_dim // t
    scatters = norms(spec) * residual if sp and t > 1 else 0  # one reduce-scatter per row-parallel matmul
    lse = FLASH_BYTES * b * spec.heads * spec.seq_len // t
    return c * (residual + saved + attention + scatters) + lse


#: ``runtime.recompute`` values checkpointing each block with a JAX dots policy: ``save-dots`` (the dots alone) and
#: ``save-dots-flash`` (the dots and the flash kernel's output and row log-sum-exp, :func:`dots_saved_bytes`).
DOTS_POLICIES = ("save-dots", "save-dots-flash")


def saves_dots(plan: Plan) -> bool:
    """Whether each block is checkpointed with ``checkpoint_dots_with_no_batch_dims`` (``runtime.recompute:
    save-dots`` or ``save-dots-flash`` under selective remat; under full remat the value is the runner's full
    remat): the memory model here and the runner (testbed.runner.model.stage_forward) both read it."""
    return plan.remat is Remat.SELECTIVE and plan.runtime.recompute in DOTS_POLICIES


def saves_flash_residuals(plan: Plan) -> bool:
    """Whether the dots policy also keeps flash attention's output and row log-sum-exp, saved by name
    (``runtime.recompute: save-dots-flash`` of a flash model: MaxText's ``minimal_with_context``), so the backward
    does not rerun the kernel's forward: :func:`dots_saved_bytes` counts them, testbed.runner.model.stage_forward
    keeps them."""
    return (saves_dots(plan) and plan.runtime.recompute == "save-dots-flash"
            and plan.model.attention is Attention.FLASH)


def keeps_flash_under_full(plan: Plan) -> bool:
    """Whether each fully rematerialised block keeps its flash kernel's output and row log-sum-exp
    (``runtime.recompute: save-flash`` of a flash model under full remat: AXLearn's
    ``save_or_offload_flash_attention_policy`` alone, axlearn/common/flash_attention/remat.py; MaxText's
    ``remat_policy: custom`` with ``context: device``), the backward not rerunning the kernel's forward
    (:func:`flash_kept_bytes`; testbed.model.gemm.recompute_gemms)."""
    return (plan.remat is Remat.FULL and plan.runtime.recompute == "save-flash"
            and plan.model.attention is Attention.FLASH)


def flash_kept_bytes(plan: Plan) -> int:
    """One layer's flash kernel output (compute dtype) and fp32 row log-sum-exp on one tensor rank."""
    spec, t = rank_spec(plan), plan.mesh.tensor
    n = plan.microbatch_size * spec.seq_len
    return plan.precision.compute_bytes * n * spec.q_dim // t + FLASH_BYTES * n * spec.heads // t


def dots_policy(plan: Plan) -> str | None:
    """The checkpoint policy the runner gives each block beyond its remat: ``"save-dots-flash"`` where
    :func:`saves_flash_residuals`, ``"save-dots"`` where :func:`saves_dots` alone, ``"save-flash"`` where
    :func:`keeps_flash_under_full`, else None."""
    if saves_flash_residuals(plan):
        return "save-dots-flash"
    if keeps_flash_under_full(plan):
        return "save-flash"
    return "save-dots" if saves_dots(plan) else None


def dots_saved_bytes(plan: Plan) -> int:
    """One layer's kept bytes under MaxText's ``remat_policy: minimal`` (``runtime.recompute: save-dots``).

    MaxText maps ``minimal`` to ``jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims`` (maxtext
    MaxText/layers/models.py ``Decoder.get_remat_policy``): a ``dot_general`` without batch dimensions may be
    saved, i.e. each weight matmul's output, and everything else is recomputed in the backward: the norms, RoPE,
    the activation function and attention (the score and value matmuls have batch dimensions; the splash kernel
    is no dot). A policy only says what may be saved: JAX's partial evaluation saves the allowed values the
    backward reads, so the MLP's down projection, whose output only feeds the residual add (an add's backward
    reads no value), is not kept, nor a parallel block's out projection (``model.parallel_block``: no norm reads
    it). Kept: Q, K and V (GQA's narrower K/V included), the out projection of a sequential block (the
    recomputed second norm's input is the block input plus it) and the MLP's input projections, SwiGLU's two;
    the scanned layer loop keeps the block input, its carry (``jax.ad_checkpoint.print_saved_residuals`` of the
    runner's block under the policy: tests/test_saved_dots.py). Column-parallel outputs are split over the tensor ranks;
    GSPMD reduces the row-parallel out projection before the policy sees it, so it is kept as the residual
    stream's layout keeps it (its sequence shard under sequence parallelism). An MoE layer is counted as a dense
    one of its ``d_ff``.
    """
    spec, t = rank_spec(plan), plan.mesh.tensor
    outputs = block_matmul_outputs(spec, plan.microbatch_size * spec.seq_len, t)
    columns = sum(outputs[:3]) + sum(outputs[4:-1])  # Q, K, V; the MLP's input projections
    # The input, and a sequential block's out projection: one residual-stream tensor per norm.
    kept = plan.precision.compute_bytes * (columns + norms(spec) * _residual_values(plan))
    if saves_flash_residuals(plan):  # the kernel's residuals
        kept += flash_kept_bytes(plan)
    return kept


def fp8_input_savings(plan: Plan) -> int:
    """Bytes one layer keeps fewer when each linear keeps the fp8 cast of its input (``runtime.fp8_saved_inputs``).

    The norms feeding the QKV and MLP-in GEMMs write fp8 outputs (a parallel block's one norm feeds both),
    and the MLP's down projection keeps its input in fp8: each ``compute - 1`` bytes a value fewer. The out
    projection keeps an fp8 copy of the attention output, which the attention kernel keeps in the compute
    dtype for its own backward: 1 byte a value more.
    """
    spec, t, sp = rank_spec(plan), plan.mesh.tensor, plan.sequence_parallel
    c, n = plan.precision.compute_bytes, plan.microbatch_size * spec.seq_len
    norm_outputs = norms(spec) * (sequence_share(n * spec.d_model, spec.seq_len, t) if sp else n * spec.d_model)
    down_input = n * spec.d_ff // t
    return (c - 1) * (norm_outputs + down_input) - n * spec.q_dim // t


def recompute_workspace_bytes(plan: Plan) -> int:
    """What a layer's backward recomputes and holds besides the kept set: full remat the whole block forward,
    per-op recompute the part its policy did not save; 0 otherwise."""
    spec, b, t, sp = rank_spec(plan), plan.microbatch_size, plan.mesh.tensor, plan.sequence_parallel
    whole = activation_bytes_per_layer(spec, b, plan.precision, Remat.NONE, t, sp) + _xla_layer_extra(plan)
    if plan.remat is Remat.FULL:
        return whole
    if plan.remat is Remat.SELECTIVE and plan.runtime.recompute == "op":
        return max(whole - op_saved_bytes(plan), 0)
    if saves_dots(plan):
        return max(whole - dots_saved_bytes(plan), 0)
    return 0


def xla_program(plan: Plan) -> bool:
    """Whether XLA's buffer assignment places the program's buffers (``runtime.compiler_buffers``), for a
    compiler's own rules (testbed.model.xla_tpu); the kept terms here each read their own runtime field."""
    return plan.runtime.compiler_buffers


def _residual_values(plan: Plan) -> int:
    """Values of one ``[tokens, d_model]`` residual-stream tensor on one device (its sequence shard under SP)."""
    spec = rank_spec(plan)
    n = plan.microbatch_size * spec.seq_len * spec.d_model
    return sequence_share(n, spec.seq_len, plan.mesh.tensor) if plan.sequence_parallel else n


def selective_copies_bytes(plan: Plan) -> int:
    """Bytes of one layer's head-major Q and K copies XLA keeps under the runner's selective remat.

    The runner checkpoints the core attention only (``jax.checkpoint(plain_attention)`` on q, k and v:
    testbed.runner.model), and XLA's layout assignment writes q, k and v head-major where the QKV projection's
    output is split, outside the checkpoint. The copies are then the checkpoint's saved inputs, kept from the
    forward to the layer's backward as without remat (XLA:CPU's scheduled ``small-b32-selective`` step in
    ``benchmarks/memory_vs_xla.py``, ``--xla_dump_to``: each layer's ``[b, heads, head_dim, seq]`` and
    ``[b, heads, seq, head_dim]`` reshape copies live from its forward to its backward), and selective drops the
    softmax output alone. The no-remat set's copies (testbed.model.activations' ``xla_only_bytes_per_layer``);
    0 for flash attention (it makes none), the per-op and save-dots policies (their own sets) and PyTorch."""
    if plan.remat is not Remat.SELECTIVE or plan.runtime.recompute in ("op", *DOTS_POLICIES) \
            or not plan.runtime.kept_layout_copies:
        return 0
    return xla_only_bytes_per_layer(rank_spec(plan), plan.microbatch_size, plan.precision, Remat.NONE,
                                    plan.mesh.tensor)


def _xla_layer_extra(plan: Plan) -> int:
    """What XLA keeps of one layer beyond :func:`activation_bytes_per_layer`'s no-remat and selective sets."""
    return norms(rank_spec(plan)) * sp_gathered_bytes(plan) + normalized_input_bytes(plan)


def sp_gathered_bytes(plan: Plan) -> int:
    """Bytes one column-parallel matmul's gathered input keeps beyond its sequence shard.

    Under sequence parallelism the runner all-gathers the sequence before each column-parallel matmul (QKV,
    MLP-in, the head) and XLA keeps the all-gather's output, the whole ``[tokens, d_model]``, as the
    weight-gradient matmul's operand; Megatron-LM and Transformer Engine keep the shard and gather it again in
    the backward (``runtime.sp_gathered_inputs`` false, Korthikanti et al. 2022: ``1/t`` each). 0 without SP."""
    t = plan.mesh.tensor
    if not plan.sequence_parallel or t == 1 or not plan.runtime.sp_gathered_inputs:
        return 0
    return plan.precision.compute_bytes * (t - 1) * _residual_values(plan)


def normalized_input_bytes(plan: Plan) -> int:
    """Bytes of one layer's LayerNorm-backward operand ``(x - mean) * rstd`` that XLA computes in the forward.

    With a tensor axis the norm's input arrives from a collective (the all-reduce or reduce-scatter of the
    previous row-parallel matmul), and XLA materialises one normalised input per layer in the forward, kept
    until that layer's backward (``(x - mean) * rstd`` fusions in the compiled step; without a tensor axis
    the backward recomputes it from the kept input). One residual-stream tensor, its shard under SP."""
    if plan.mesh.tensor == 1 or not plan.runtime.kept_norm_inputs:
        return 0
    return plan.precision.compute_bytes * _residual_values(plan)


def tensor_collective_workspace(plan: Plan) -> int:
    """Bytes a layer's backward holds for its tensor-axis collectives of the input gradients.

    Each of the layer's column-parallel matmuls (QKV, MLP-in; a parallel block's one) writes a whole-sequence
    partial input gradient that is reduced over the tensor axis (all-reduce; reduce-scatter under SP, whose
    row-parallel side all-gathers the output gradient whole). XLA's collectives are out of place: the operand
    and the result are both live, two whole ``[tokens, d_model]`` buffers per collective. 0 without a tensor
    axis or with ``runtime.in_place_collectives`` (PyTorch's NCCL all-reduces)."""
    if plan.mesh.tensor == 1 or plan.runtime.in_place_collectives:
        return 0
    spec = rank_spec(plan)
    return norms(spec) * 2 * plan.precision.compute_bytes * plan.microbatch_size * spec.seq_len * spec.d_model


def residual_summand_bytes(plan: Plan) -> int:
    """Bytes XLA keeps per layer under the runner's full remat beside the block input.

    The residual stream is a chain of adds (``x + attention + mlp``); XLA fuses each add into its consumers
    instead of writing the sum, so the summands, each block's attention and MLP outputs (one per norm), stay
    live until the backward's recompute of every later block has read them. PyTorch's checkpoint (``runtime.
    recompute`` block/op) keeps the block input only, and so does a scanned layer loop (``runtime.scan_layers``:
    each layer's output is a materialised carry)."""
    if not _unrolled_runner_remat(plan):
        return 0
    return norms(rank_spec(plan)) * plan.precision.compute_bytes * _residual_values(plan)


def loss_instant_recompute(plan: Plan) -> int:
    """Bytes of the last block's recompute live during the loss backward under the runner's full remat.

    The last block's rematerialisation depends only on its kept input, so XLA's scheduler runs it next to the
    loss backward rather than after it: one block's recomputed activations beside the loss workspace."""
    if not _unrolled_runner_remat(plan):
        return 0
    return recompute_workspace_bytes(plan)


def _unrolled_runner_remat(plan: Plan) -> bool:
    """Full remat as the runner's ``jax.checkpoint`` per block over an unrolled layer loop, compiled by XLA."""
    return (plan.remat is Remat.FULL and plan.runtime.recompute in ("runner", "save-flash", *DOTS_POLICIES)
            and plan.runtime.fused_residual_adds and not plan.runtime.scan_layers)


def head_kept_bytes(plan: Plan) -> int:
    """Bytes the final norm and the loss keep per microbatch: fp32 logits (the runner's loss), or with
    ``runtime.fused_loss`` compute-dtype logits; their per-row log-sum-exp either way."""
    spec, b, t, sp = rank_spec(plan), plan.microbatch_size, plan.mesh.tensor, plan.sequence_parallel
    kept = head_activation_bytes(spec, b, plan.precision, t, sp) + sp_gathered_bytes(plan)
    if plan.runtime.fused_loss:
        kept -= (LOSS_BYTES - plan.precision.compute_bytes) * _logits(plan)
    if plan.runtime.vocab_tiles > 1:  # the tiled loss keeps the hidden states; the backward recomputes the logits
        kept -= _kept_logit_bytes(plan) * _logits(plan)
    return kept


def _kept_logit_bytes(plan: Plan) -> int:
    """Bytes a logit the head keeps for the loss backward: fp32, or the compute dtype under ``fused_loss``."""
    return plan.precision.compute_bytes if plan.runtime.fused_loss else LOSS_BYTES


def loss_workspace_bytes(plan: Plan) -> int:
    """The loss backward's transient buffers besides the kept logits.

    The runner's XLA loss: ``exp(logits - lse)`` and the logits gradient in fp32, and under bf16 the
    compute-dtype logits the projection wrote before the fp32 cast. ``runtime.fused_loss``: the logits
    gradient in the compute dtype only (the kernel reads the kept logits and lse).
    """
    c = plan.precision.compute_bytes
    if plan.runtime.fused_loss:
        per_logit = c
    else:
        per_logit = 2 * LOSS_BYTES + (c if c != LOSS_BYTES else 0)
    tiles = plan.runtime.vocab_tiles
    if tiles > 1:  # one tile at a time: its recomputed logits beside its loss backward's buffers
        return -(-_logits(plan) * (per_logit + _kept_logit_bytes(plan)) // tiles)
    return _logits(plan) * per_logit


def _logits(plan: Plan) -> int:
    """Logits one tensor rank holds for one microbatch (the padded vocabulary split over the tensor ranks)."""
    spec = rank_spec(plan)
    return plan.microbatch_size * spec.seq_len * spec.padded_vocab // plan.mesh.tensor


def weight_grads_deferred(plan: Plan) -> bool:
    """Whether the step's XLA program computes every weight gradient only after the whole input-gradient chain.

    Read from XLA:CPU's scheduled steps (``benchmarks/memory_vs_xla.py``, ``--xla_dump_to``: the live-range
    reports): whenever the step reduces its gradients or its loss over devices (data, fsdp, expert, tensor or
    context ranks; the gradients feed one combined all-reduce), no weight gradient is live at any layer's
    backward instant; the single-device step interleaves them. ``runtime.weight_grads_last`` false (autograd's
    order, PyTorch stacks): never."""
    return plan.runtime.weight_grads_last and plan.replicas * plan.mesh.tensor * plan.mesh.context > 1


def deferred_backward_bytes(plan: Plan, holds_head: bool) -> int:
    """Bytes held through every layer's backward for weight gradients XLA computes after the input gradients.

    The head's weight gradient reads the loss's softmax ``exp(logits - lse)``, an fp32 logits-sized buffer
    (the compute-dtype logits gradient under ``runtime.fused_loss``; nothing under ``vocab_tiles``, whose tiles
    recompute), and XLA runs it after the layers' backward in every step it compiles (live from the loss
    backward to the end of the backward in the single-device ``long-b4-flash`` as in ``long-b8-flash-dp8``).
    When the weight gradients are deferred (:func:`weight_grads_deferred`) the step also keeps the kept logits
    until the loss value, reduced over the ranks, is taken (``long-b8-flash-dp8``, ``long-b4-tp4``,
    ``long-b4-cp4``; not ``long-b4-cp2``), and during a layer's attention backward the MLP's input-matrix
    output gradients (``[tokens, d_ff / t]`` each: the first matrices' weight-gradient operands). 0 without
    ``runtime.weight_grads_last`` (PyTorch stacks)."""
    if not plan.runtime.weight_grads_last:
        return 0
    head = 0
    if holds_head and plan.runtime.vocab_tiles == 1:
        softmax = plan.precision.compute_bytes if plan.runtime.fused_loss else LOSS_BYTES
        head = _logits(plan) * (softmax + (_kept_logit_bytes(plan) if weight_grads_deferred(plan) else 0))
    if not weight_grads_deferred(plan):
        return head
    spec = rank_spec(plan)
    tokens = plan.microbatch_size * spec.seq_len
    mlp_in = (spec.mlp_matrices - 1) * tokens * spec.d_ff // plan.mesh.tensor
    return head + plan.precision.compute_bytes * mlp_in
