"""What XLA:TPU's buffer assignment keeps of the runner's step where it differs from XLA:CPU's.

testbed.model.kept holds the rules read from XLA:CPU's compiled steps. XLA:TPU fuses every elementwise chain into
the matmuls and reductions around it, so a value that is an elementwise function of other kept values is
recomputed inside the backward's fusions instead of kept (read from the buffer assignment and live ranges of the
runner's step compiled deviceless for ``v5e`` slices, ``benchmarks/memory_vs_xla_tpu.py`` and
``benchmarks/xla_tpu/``):

- a layer keeps its norms' inputs, Q, K, V, the attention output, the MLP's input-matrix outputs (the activation
  function's output is recomputed), and without remat the attention probabilities (:func:`layer_kept_bytes`);
  under full remat only the block input at the loss, no residual summands (the unrolled CPU step's extra; with one
  sequence on one device the summands are held through the forward instead, :func:`keeps_residual_summands`,
  which moves the heap's gaps, not its live bytes); under sequence
  parallelism only the sequence shards: the column-parallel matmuls' inputs are gathered again in the backward
  (the records' extra tensor all-gathers; gpt2k-fsdp8-tensor8-sp's buffer assignment holds no whole
  ``[tokens, d_model]`` input at its peak);
- with the splash kernels (one TPU device, testbed.model.flash_kernel) a layer keeps Q, K, V and the attention
  output again in the kernel's heads-first layout (:func:`splash_copies_bytes`); with the runner's scan kernel
  (sharded steps) every layer's backward fp32 buffers are allocated ahead of it (:func:`scan_flash_fp32_bytes`);
- the head keeps its norm's input (its shard under SP) and the logits in the compute dtype; the loss's fp32
  log-softmax is one
  logits-sized fp32 buffer at the loss (:func:`head_kept_bytes`, :func:`loss_workspace_bytes`); no block's
  recompute is scheduled beside it and no logits-sized buffer waits for a deferred weight gradient.

Under full remat a parallel block's backward recomputes and differentiates its attention branch, then its MLP
branch, holding the larger of the two (:func:`parallel_branches`); on one device no weight gradient is held at
the loss's or a layer's backward (each matrix's update runs in its gradient's matmul, the token table's and the
norms' after the backward: testbed.model.memory).

A layer's attention backward writes one score-sized buffer, the probabilities' gradient, and the scores'
gradient over the probabilities it owns (testbed.model.workspace.attention_workspace); its tensor collectives
follow the dots that free those buffers (testbed.model.workspace.layer_workspace); under fsdp the loss holds the
head's gathered block alone (testbed.model.gathered.head_block_bytes). Against the device's limit the
compiler's floors apply as on XLA:CPU (testbed.model.floors): under the loss floor (``fused_loss``) the loss's fp32
buffer is rematerialised and its gradient is one compute-dtype logits buffer.

These rules cover the runner's own mechanisms (``runtime.recompute: runner`` or the dots policies it executes, no
tiled loss, no offloading); any other stack keeps testbed.model.kept's rules (:func:`applies`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from testbed.model.activations import FLASH_BYTES, LOSS_BYTES, norms
from testbed.model.flash_kernel import LANES, AttentionKernel, tpu_kernel, turns_rope
from testbed.model.kept import (DOTS_POLICIES, dots_saved_bytes, flash_kept_bytes, keeps_flash_under_full, saves_dots,
                                saves_flash_residuals, xla_program)
from testbed.model.ring import rank_spec
from testbed.plan.sharding import reduction_axes
from testbed.plan.spec import Attention, Plan, Position, Remat

__all__ = ["applies", "layer_kept_bytes", "kept_flash_bytes", "splash_copies_bytes", "scan_flash_fp32_bytes", "recompute_workspace_bytes",
           "parallel_branches", "attention_recompute_bytes", "head_kept_bytes", "head_kept_buffers", "loss_workspace_bytes",
           "keeps_residual_summands", "packed_merges"]


def applies(plan: Plan, buffer_rules: str) -> bool:
    """Whether the plan's step is priced by XLA:TPU's rules: a ``xla-tpu`` device and the runner's own program
    (its remat, or a JAX dots policy the runner executes, testbed.model.kept.dots_policy)."""
    runtime = plan.runtime
    return (buffer_rules == "xla-tpu" and xla_program(plan) and runtime.recompute in ("runner", "save-flash", *DOTS_POLICIES)
            and runtime.vocab_tiles == 1 and not runtime.offload_activations and not runtime.scan_layers)


def _residual(plan: Plan) -> int:
    """Values of one ``[tokens, d_model]`` residual-stream tensor on one device (its sequence shard under SP)."""
    spec = rank_spec(plan)
    values = plan.microbatch_size * spec.seq_len * spec.d_model
    return values // plan.mesh.tensor if plan.sequence_parallel else values


def turned_rope_bytes(plan: Plan) -> int:
    """One layer's RoPE turns a JAX dots policy keeps on XLA:TPU: under the splash kernel the runner rotates Q and K
    with a signed permutation applied as a dot (testbed.runner.rope.rope_turned), a ``dot_general`` without batch
    dimensions, which ``checkpoint_dots_with_no_batch_dims`` saves beside the projections: a second Q and K (the
    deviceless compile of llama400m-bf16-dotsflash allocates the 14,343,088,640 bytes the chip does, 1.04 GB over
    the set without them). 0 without RoPE or the splash kernel."""
    spec = rank_spec(plan)
    if (spec.attention is not Attention.FLASH or spec.position is not Position.ROPE
            or not turns_rope(tpu_kernel(plan))):
        return 0
    t, n = plan.mesh.tensor, plan.microbatch_size * spec.seq_len
    kv = n * spec.kv_dim // (t if spec.kv_split(t) else 1)
    return plan.precision.compute_bytes * (n * spec.q_dim // t + kv)


def layer_kept_bytes(plan: Plan) -> int:
    """Bytes one dense layer keeps from its forward to its backward, one microbatch, on one device.

    Full remat: the block input (and under ``save-flash`` the flash kernel's output and row log-sum-exp,
    testbed.model.kept.keeps_flash_under_full). Otherwise the norms' inputs (residual stream), Q, K, V and the attention output
    (split over the tensor ranks; GQA's K and V whole where the degree does not divide ``kv_heads``), the MLP's
    ``mlp_matrices - 1`` input-matrix outputs, and the attention's softmax output without remat (plain
    attention) or its fp32 row log-sum-exp (flash). Under SP the residual stream's sequence shards only (XLA:TPU
    gathers the column-parallel matmuls' inputs again in the backward; XLA:CPU keeps them,
    testbed.model.kept.sp_gathered_bytes)."""
    spec, t, c = rank_spec(plan), plan.mesh.tensor, plan.precision.compute_bytes
    if plan.remat is Remat.FULL:
        return c * _residual(plan) + (kept_flash_bytes(plan) if keeps_flash_under_full(plan) else 0)
    if saves_dots(plan):  # the policy's saved set (no splash copies: the transposes are no dots)
        flash = kept_flash_bytes(plan) - flash_kept_bytes(plan) if saves_flash_residuals(plan) else 0
        return dots_saved_bytes(plan) + flash + turned_rope_bytes(plan)
    b = plan.microbatch_size
    n = b * spec.seq_len
    kv = 2 * n * spec.kv_dim // (t if spec.kv_split(t) else 1)
    values = norms(spec) * _residual(plan) + 2 * n * spec.q_dim // t + kv
    values += (spec.mlp_matrices - 1) * n * spec.d_ff // t
    kept = c * values
    if spec.attention is Attention.FLASH:
        lse = FLASH_BYTES * b * spec.heads * spec.seq_len // t
        return kept + lse + splash_copies_bytes(plan) + scan_flash_fp32_bytes(plan)
    if plan.remat is Remat.NONE:
        kept += c * b * spec.heads * spec.score_rows * spec.seq_len // t
    return kept


def kept_flash_bytes(plan: Plan) -> int:
    """One layer's flash output and row log-sum-exp as a policy keeps them by name (``save-flash``,
    ``save-dots-flash``; testbed.model.kept.flash_kept_bytes): under the splash kernels the output in their
    heads-first layout ``[b, heads, s, head_dim]``, whose minor dimension XLA:TPU tiles to :data:`LANES` lanes
    (llama400m-bf16-full-saveflash's buffer assignment on the chip, benchmarks/tpu_chip/runs.json: every layer's
    ``bf16[8,16,2048,64]`` output a 67,108,864-byte buffer, twice its values; the plan's memory 11.89 GB against
    10.24 GB without the policy)."""
    if tpu_kernel(plan) is not AttentionKernel.SPLASH:
        return flash_kept_bytes(plan)
    spec, t = rank_spec(plan), plan.mesh.tensor
    n, lanes = plan.microbatch_size * spec.seq_len, -(-spec.head_size // LANES) * LANES
    return plan.precision.compute_bytes * n * spec.heads * lanes // t + FLASH_BYTES * n * spec.heads // t


def splash_copies_bytes(plan: Plan) -> int:
    """What a layer keeps besides under the splash kernels (testbed.model.flash_kernel: one TPU device): Q, K, V and
    the attention output a second time, in the kernel's heads-first layout ``[b, heads, s, head_dim]`` that the
    runner transposes them to and from, for the kernel's backward (``2 n (q_dim + kv_dim)`` values). XLA:TPU's
    compiled steps, 2 and 4 layers apart (deviceless, v5e): 4.1 ``[n, d]`` buffers a layer for GPT-2's MHA and 3.1
    for GQA 16/4 over the scan kernel's, against 4 and 2.5 here."""
    spec = plan.model
    if tpu_kernel(plan) is not AttentionKernel.SPLASH or plan.remat is Remat.FULL:
        return 0
    n = plan.microbatch_size * spec.seq_len
    return plan.precision.compute_bytes * 2 * n * (spec.q_dim + spec.kv_dim)


def scan_flash_fp32_bytes(plan: Plan) -> int:
    """What a layer holds besides under the runner's scan flash kernel (testbed.runner.attention, sharded steps
    without context parallelism) from its forward, or the backward's start, to its own backward: two
    ``[tokens, q_dim / t]`` fp32 buffers, the backward's dq accumulator (its zeros a ``custom-call
    AllocateBuffer`` XLA:TPU places in the forward) and the attention output cast to fp32 for the row sums
    (``convert_element_type`` scheduled at the backward's start). llama1b-fsdp256-flash of benchmarks/xla_tpu/
    (buffer assignment): one of each per layer, 16 of each live at the head's backward, 537 MB. 0 under full
    remat (the layer's forward runs again in its backward) and for other kernels."""
    spec = rank_spec(plan)
    if spec.attention is not Attention.FLASH or tpu_kernel(plan) is not AttentionKernel.SCAN or plan.mesh.context > 1 \
            or plan.remat is Remat.FULL:
        return 0
    return 2 * FLASH_BYTES * plan.microbatch_size * spec.seq_len * spec.q_dim // plan.mesh.tensor


def keeps_residual_summands(plan: Plan) -> bool:
    """Whether XLA:TPU keeps a full-remat forward's residual summands rather than its block inputs: one device, one
    sequence a microbatch, full remat (no dots policy, serial blocks). Each layer's attention and MLP output
    projections (``[tokens, d_model]`` each, the second outputs of the fusions that add them to the stream) are held
    in HBM through the forward, and one fusion at the forward's end writes the block inputs of layers 1..L-1 from
    them, beside its operands but the first layer's two (moved to VMEM ahead of it); the last layer's output, the
    head's norm input, is written with the last layer. The block inputs' live bytes at the loss are the same; the
    heap's gaps are not (testbed.model.step_heap lays them out). Read from the buffer assignments of
    ho-llama500m-seq8192-full (benchmarks/tpu_chip/heldout/, 8 layers, 8,192 tokens) and of the same plan at 12
    layers and at vocabularies 24,576 and 50,304, compiled deviceless for one v5e chip (libtpu 0.0.42.1); at two
    sequences of 4,096 tokens (the same tensors) and on llama400m-bf16-full (eight sequences) XLA:TPU keeps each
    block input as the forward writes it (docs/xla_tpu.md)."""
    return (plan.mesh.size == 1 and plan.microbatch_size == 1 and plan.remat is Remat.FULL and not saves_dots(plan)
            and not keeps_flash_under_full(plan) and not plan.model.parallel_block)


def recompute_workspace_bytes(plan: Plan) -> int:
    """What a layer's backward recomputes and holds besides its kept set: under full remat the layer's no-remat
    set as XLA:TPU keeps it (:func:`layer_kept_bytes`) but its norms' inputs, with the gradient flowing back beside
    it (one residual-sized buffer): the first norm reads the kept block input and the MLP's norm input is freed
    with the MLP's backward, before the attention's (benchmarks/xla_tpu/: at the softmax backward of
    gpt2k-data4-tensor4-full and llama4k-fsdp256-tensor4 the residual-sized buffers are the kept block inputs
    and the flowing gradient). Selective remat's recomputed scores are the attention workspace's
    (testbed.model.workspace). Under a dots policy what the layer would keep without remat beyond the policy's
    saved set (the norms' outputs, RoPE's and the kernel's layouts, the activation), recomputed in its backward;
    0 otherwise."""
    if saves_dots(plan):
        return max(layer_kept_bytes(replace(plan, remat=Remat.NONE)) - dots_saved_bytes(plan), 0)
    if plan.remat is not Remat.FULL:
        return 0
    norm_inputs = (norms(rank_spec(plan)) - 1) * plan.precision.compute_bytes * _residual(plan)
    return layer_kept_bytes(replace(plan, remat=Remat.NONE)) - norm_inputs


def parallel_branches(plan: Plan) -> bool:
    """Whether a layer's backward under full remat recomputes and differentiates its attention and its MLP one
    after the other: a parallel block (``model.parallel_block``: both branches read the one norm's output and
    their outputs are summed, so neither branch's backward reads the other's values). XLA:TPU's buffer
    assignment of proxy-maxtext16b-v5e-l1 (benchmarks/tpu_chip/proxies/, compiled deviceless for v5e): at the
    splash kernel's backward Q, K, V and the output's gradient in the kernel's layout and the kernel's outputs,
    no MLP-sized buffer; at the MLP's backward its recomputed hidden and the activation's gradient, no
    attention buffer (proxy-maxtext128b-v5e-l2 alike)."""
    return plan.remat is Remat.FULL and plan.model.parallel_block and not saves_dots(plan)


def attention_recompute_bytes(plan: Plan) -> int:
    """What a parallel block's attention branch recomputes for its backward under full remat
    (:func:`parallel_branches`): Q, K, V and the attention output once (split over the tensor ranks, GQA's K and
    V whole where the degree does not divide ``kv_heads``), the flash row log-sum-exp, or plain attention's
    probabilities; the flowing gradient beside them (one residual-sized buffer)."""
    spec, t, c = rank_spec(plan), plan.mesh.tensor, plan.precision.compute_bytes
    b = plan.microbatch_size
    n = b * spec.seq_len
    kv = 2 * n * spec.kv_dim // (t if spec.kv_split(t) else 1)
    values = 2 * n * spec.q_dim // t + kv + _residual(plan)
    if spec.attention is Attention.FLASH:
        return c * values + FLASH_BYTES * b * spec.heads * spec.seq_len // t
    return c * (values + b * spec.heads * spec.score_rows * spec.seq_len // t)


def _logits(plan: Plan) -> int:
    """Logits one tensor rank holds for one microbatch (the padded vocabulary split over the tensor ranks)."""
    spec = rank_spec(plan)
    return plan.microbatch_size * spec.seq_len * spec.padded_vocab // plan.mesh.tensor


def head_kept_bytes(plan: Plan) -> int:
    """Bytes the head keeps per microbatch: its norm's input (under SP its sequence shard) and the logits in the
    compute dtype (:func:`head_kept_buffers`)."""
    return sum(head_kept_buffers(plan))


def head_kept_buffers(plan: Plan) -> tuple[int, int]:
    """The head's kept buffers per microbatch, bytes: its norm's input (under SP its sequence shard) and the
    logits in the compute dtype."""
    c = plan.precision.compute_bytes
    return c * _residual(plan), c * _logits(plan)


def loss_workspace_bytes(plan: Plan) -> int:
    """The loss's transient: one fp32 logits-sized buffer (the log-softmax the loss and its gradient read), or
    under ``runtime.fused_loss`` (the compiler's loss floor, testbed.model.floors) the compute-dtype gradient.
    None where the logits are fp32 already: the loss reads the kept logits, no cast to hold apart (gpt1k-data4-fp32
    of benchmarks/xla_tpu/: one logits-sized buffer, where the bf16 step holds the bf16 logits and an fp32 one)."""
    if plan.runtime.fused_loss:
        return plan.precision.compute_bytes * _logits(plan)
    if plan.precision.compute_bytes >= LOSS_BYTES:
        return 0
    return LOSS_BYTES * _logits(plan)


def updates_in_epilogue(plan: Plan) -> bool:
    """Whether XLA:TPU (DeviceSpec.fused_updates) runs each weight matrix's optimizer update in the epilogue of its
    gradient's matmul: one microbatch, one stage and no gradient summed over devices (the chip's per-op profiles,
    benchmarks/tpu_chip/profiles.json: one output fusion per matrix; the routed experts' stacked matrices too, one
    fusion each, benchmarks/tpu_chip/moe/profiles.json). Then no weight gradient is live at
    the loss's or a layer's backward (the buffer assignments of llama400m-bf16-full, AdamW, and of
    proxy-maxtext16b-v5e-l1, SGD, compiled for v5e). The timing (testbed.sim.step.update_facts.fused_update) and the
    memory (testbed.model.memory) both read this."""
    return plan.batch.microbatches == 1 and plan.mesh.stage == 1 and not reduction_axes(plan)


def packed_merges(order: Sequence[int], size: Callable[[int], float], bound: float,
                  admits: Callable[[list[int], int], bool] = lambda taken, i: True) -> list[list[int]]:
    """The merges XLA:TPU's all-reduce combiner makes of the all-reduces ``order`` lists in its walk order, each of
    ``size(i)`` bytes: every one over ``bound`` alone, then merge after merge, each taking every next one that still
    fits the bound and that ``admits(taken, i)`` (the merge so far), passing over the others (left for the next
    merge) rather than closing at the first misfit (benchmarks/xla_tpu/llama1b-fsdp256-flash.json: 14 merges, seven of
    exactly 120 MiB). The plan's gradients (testbed.model.block_scatters) and a traced program's all-reduces
    (testbed.sim.xla.combine) are merged by it."""
    merges = [[i] for i in order if size(i) > bound]
    rest = [i for i in order if size(i) <= bound]
    while rest:
        taken: list[int] = []
        left: list[int] = []
        total = 0.0
        for i in rest:
            if total + size(i) <= bound and admits(taken, i):
                taken.append(i)
                total += size(i)
            else:
                left.append(i)
        merges.append(taken)
        rest = left
    return merges

