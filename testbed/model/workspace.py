"""One layer's backward transients: attention (score, flash or splash tiles, the ring's messages), the MLP, what
remat recomputes and the tensor collectives' buffers (the memory model's "layer backward" workspace term,
testbed.model.memory)."""

from __future__ import annotations

from testbed.model import costs, kept, moe, xla_tpu
from testbed.model.activations import norms, sequence_share
from testbed.model.ring import rank_spec, ring_attention_workspace
from testbed.model.splash import splash_kernel, splash_workspace
from testbed.plan.spec import Attention, Plan, Remat

__all__ = ["attention_workspace", "flash_workspace", "flash_tile", "layer_workspace", "sublayer_workspace"]

#: Bytes of an fp32 value.
FP32_BYTES = 4


def attention_workspace(plan: Plan, tpu: bool = False) -> int:
    """Transient score-sized buffers of one layer's attention backward.

    The softmax is not fused into one kernel: its backward materialises the
    gradient of the probabilities and of the scores (2 buffers); selective
    remat first recomputes the scores and probabilities (2 more).

    XLA:TPU (``tpu``, testbed.model.xla_tpu) writes one new score-sized buffer, the probabilities' gradient in
    the compute dtype, and writes the scores' gradient over the probabilities, whose last reader it is, where the
    program owns them: the recorded compiles' buffer assignments (benchmarks/xla_tpu/:
    ``transpose(jvp(bhqk,bkhd->bqhd))/dot_general`` the one score-sized temporary of each layer's backward, bf16
    in gpt1k-tensor4 and llama2k-fsdp8, fp32 in llama2k-fsdp4-fp32, beside the kept probabilities; beside the
    recomputed ones (``rematted_computation``) under full remat in gpt2k-data4-tensor4-full, gpt2k-fsdp256-full,
    llama2k-fsdp64 and both llama4k plans). Under selective remat the recomputed probabilities are a second
    score-sized buffer (under full remat they are counted with the layer's recompute,
    testbed.model.xla_tpu.recompute_workspace_bytes). A pipeline's backward program reads the kept
    probabilities as an argument it does not own, so the scores' gradient is a second buffer too
    (gpt1k-stage2-data2's ``stage0.chunk0.B``: 282 MB of temporaries, two 134 MB score-sized buffers).
    """
    spec, c = rank_spec(plan), plan.precision.compute_bytes
    if spec.attention is Attention.FLASH:
        return splash_workspace(plan) if splash_kernel(plan) else flash_workspace(plan)
    scores = plan.microbatch_size * spec.heads * spec.seq_len ** 2 // plan.mesh.tensor
    if tpu:
        argument = plan.remat is Remat.NONE and plan.mesh.stage > 1
        return c * scores * (2 if plan.remat is Remat.SELECTIVE or argument else 1)
    return c * scores * (4 if plan.remat is Remat.SELECTIVE else 2)


def flash_workspace(plan: Plan) -> int:
    """Flash attention's backward step over one K/V block (``testbed/runner/attention.py``), on one tensor rank.

    Per ``seq x block`` tile of every query head, no ``seq x seq`` buffer. Over
    several blocks (a loop): two fp32 tiles (the recomputed probabilities, whose
    scores XLA fuses in, and the probability gradient), the score gradient in the
    compute dtype, the fp32 dq accumulator ``[tokens, heads x head_dim / t]`` and the dK and dV outputs the loop
    fills block by block (``[tokens, kv_dim / t]`` each, compute dtype). One
    block (``seq <= 128`` by default) is compiled without the loop, and XLA keeps
    scores, probabilities and both gradients as fp32 tiles. Under context
    parallelism the ring is that loop whatever the block (plain attention: one
    ``s_l`` block a ring step): its steps carry the fp32 dq, dK and dV
    accumulators, so a ring step is priced as a loop step (plain ``long-b4-cp2``
    +13.5% -> +8.0%, the ``cp4`` rows +4.6% -> +3.7%). (Measured with XLA:CPU,
    ``benchmarks/memory_vs_xla.py``.)
    """
    spec, c, t = rank_spec(plan), plan.precision.compute_bytes, plan.mesh.tensor
    tile = flash_tile(plan)
    if spec.flash_block == spec.seq_len and plan.mesh.context == 1:
        return 4 * costs.FLASH_BYTES * tile
    n = plan.microbatch_size * spec.seq_len
    kv = n * spec.kv_dim // t if spec.kv_split(t) else n * spec.kv_dim
    # The loop's carry: the fp32 dq accumulator and the whole-sequence dK and dV it fills block by block.
    return tile * (2 * costs.FLASH_BYTES + c) + costs.FLASH_BYTES * n * spec.q_dim // t + 2 * c * kv


def flash_tile(plan: Plan) -> int:
    """Values of one ``seq x block`` score tile over every query head on one tensor rank (a window: fewer rows)."""
    spec = rank_spec(plan)
    return plan.microbatch_size * spec.heads * spec.score_rows * spec.flash_block // plan.mesh.tensor


def layer_workspace(plan: Plan, tpu: bool = False) -> int:
    """One layer's backward: the larger of its attention's and its MLP's transients (:func:`sublayer_workspace`),
    plus what remat recomputes and the collectives' buffers (testbed.model.kept).

    XLA:TPU (``tpu``) runs a tensor collective of an input gradient after the dots of its sublayer's backward
    that free the score-sized and hidden transients, one collective at a time: its operand and result (two
    whole ``[tokens, d_model]`` buffers) are live beside what remat recomputes, never beside those transients
    (benchmarks/xla_tpu/: at the softmax backward of gpt2k-data4-tensor4-full, llama4k-fsdp256-tensor4 and
    llama4k-fsdp64-tensor4-sp one residual-sized buffer, the flowing gradient, beside the two score-sized ones)."""
    tensor = kept.tensor_collective_workspace(plan)
    if tpu and xla_tpu.parallel_branches(plan):  # one branch recomputed and differentiated at a time
        attention = xla_tpu.attention_recompute_bytes(plan) + attention_workspace(plan, tpu)
        return max(attention, _hidden_workspace(plan), tensor // norms(rank_spec(plan))) + moe.dispatch_workspace(plan)
    recompute = xla_tpu.recompute_workspace_bytes(plan) if tpu else kept.recompute_workspace_bytes(plan)
    if tpu and plan.remat is Remat.FULL and not kept.saves_dots(plan):  # the MLP's recompute freed with its backward
        mlp = max(_hidden_workspace(plan), tensor // norms(rank_spec(plan))) + recompute
        attention = attention_workspace(plan, tpu) + xla_tpu.attention_recompute_bytes(plan)
        return max(mlp, attention) + moe.dispatch_workspace(plan)
    if tpu:
        transients = max(sublayer_workspace(plan, tpu), tensor // norms(rank_spec(plan)))
        return transients + recompute + moe.dispatch_workspace(plan)
    return sublayer_workspace(plan, tpu) + recompute + tensor + moe.dispatch_workspace(plan)


def _hidden_workspace(plan: Plan) -> int:
    """The MLP backward's transients: its hidden gradients (``mlp_matrices`` ``[tokens, d_ff / t]`` buffers) and
    two residual-sized ones (the residual stream's shards under SP), or an MoE layer's experts'."""
    spec, t, c = rank_spec(plan), plan.mesh.tensor, plan.precision.compute_bytes
    n = plan.microbatch_size * spec.seq_len
    residual = 2 * n * spec.d_model  # SP: the residual stream's shards
    residual = sequence_share(residual, spec.seq_len, t) if plan.sequence_parallel else residual
    return max(c * (residual + n * spec.mlp_matrices * spec.d_ff // t), moe.hidden_workspace(plan))


def sublayer_workspace(plan: Plan, tpu: bool = False) -> int:
    """The larger of a layer's attention-backward transients (score or flash tiles, the ring's messages) and its
    MLP-backward transients (the hidden and residual gradients): the MLP's backward ends, and frees them, before
    the attention's begins (XLA:CPU's scheduled steps in ``benchmarks/memory_vs_xla.py``: no MLP-backward buffer
    is live in the attention backward but the weight-gradient operands :func:`kept.deferred_backward_bytes`
    counts)."""
    hidden = _hidden_workspace(plan)
    attention = attention_workspace(plan, tpu)
    if plan.mesh.context > 1 and not splash_kernel(plan):  # the ring's messages beside a later step's tiles
        tiles = flash_tile(plan) * (2 * costs.FLASH_BYTES + plan.precision.compute_bytes)
        attention = ring_attention_workspace(plan, attention, tiles)
    return max(attention, hidden)
