"""An action's spans between two blocking tensor collectives: what each one computes and moves.

Under tensor parallelism an F or B action is not one stretch of compute: each Megatron all-reduce (with
sequence parallelism each all-gather and reduce-scatter), and the vocab-parallel loss's all-reduces, block
what follows them, which needs their result. A device that runs its fusions one at a time, each about its own
roofline (a TPU: no ``elementwise`` calibration), can hide an op's memory traffic under the matmuls of its own
span only, never under another span's across a collective. :func:`action_spans` attributes the plan's bytes
to those spans (testbed.sim.price.compute prices each span as a roofline of its own where there is no
elementwise calibration: the traced program's segments' rule, testbed.sim.graph.traced). Each span is
``(share of the action's matmul FLOPs, HBM bytes)``, forward in program order:

- the embedding lookup (before the embedding's all-reduce): the embedding's parameters and the residual stream
  it writes (``n d c`` for ``n`` tokens);
- per layer, the attention block (its norm, its QKV, scores, values and out projection) and the MLP block (its
  norm and its two or three matrices): each block's weights, its norm's input, output and statistics, and its
  kept activations (testbed.model.activations); a parallel block is one span (one collective a layer); with
  sequence parallelism each norm runs on the sequence shard between a reduce-scatter and an all-gather: a span
  of its own, without matmuls;
- the head (its norm, the output projection and the loss up to the logits' maximum): its weights, its norm's
  bytes, the fp32 logits and their log-sum-exp;
- the loss's sum of exponentials between its two all-reduces: one read of the fp32 logits (no matmul).

The softmax over the ``heads s^2 / t`` scores is counted as the tracer's fusion estimate reads it in the runner's
program (testbed.runner.program, XLA's fusions): :data:`SOFTMAX_PASSES` over the scores, forward (read the
scores, write the probabilities) and backward (read the probabilities and their gradient twice each, write the
scores' gradient), where the plan's byte model counts the kept probabilities once (twice backward). The
backward (B) spans run in reverse, each with twice its forward bytes (the plan's ``backward_bytes``; B split
from W once) and its input gradients' matmuls, the loss's gradient in the head's span (a span of its own before
it where the head's weight is gathered again for the backward, fsdp or ZeRO-3: :func:`_backward`), the
embedding's scatter-add after the first layer's last all-reduce; the weight gradients, which no tensor
collective waits for, in the last span, where the tracer's segments of the runner's program put them (XLA's
scheduler computes them where it likes: the last span is where nothing waits). Without a tensor axis, under MoE,
context parallelism or ``runtime.tp_comm_overlap`` (priced GEMM by GEMM), and for W (no tensor collective):
no spans, the action is one roofline.
"""

from __future__ import annotations

import functools

from testbed.model.activations import (LOSS_BYTES, head_activation_bytes, layer_traffic_bytes, norm_stats, norms,
                                       sequence_share)
from testbed.model.costs import ChunkCost, _layer_matmul_flops, head_forward_flops
from testbed.plan.sharding import gathers_parameters
from testbed.plan.spec import Attention, Plan

__all__ = ["SOFTMAX_PASSES", "Span", "action_spans", "scaled_spans"]

#: Passes over the attention scores' bytes (``c b heads s^2 / t``) the softmax makes, forward and backward, as the
#: tracer's fusion estimate reads the runner's program: forward, read the scores and write the probabilities;
#: backward, read the probabilities and their gradient twice (the row sums of ``P dP``, then ``P (dP - sum)``)
#: and write the scores' gradient.
SOFTMAX_PASSES = {"F": 2, "B": 5}

#: ``(share of the action's matmul FLOPs, HBM bytes)`` of one span.
Span = tuple[float, float]


def action_spans(plan: Plan, cost: ChunkCost, kind: str, split: bool, moe_layers: int = 0) -> tuple[Span, ...]:
    """The spans of one ``kind`` action of a chunk of ``cost`` between its blocking tensor collectives (module
    docstring); empty where the action is one span. FLOPs shares sum to 1."""
    spec, mesh = plan.model, plan.mesh
    t, sp = mesh.tensor, plan.sequence_parallel
    if (t <= 1 or kind == "W" or moe_layers or mesh.context > 1 or plan.runtime.tp_comm_overlap
            or not cost.tensor_allreduce_bytes):
        return ()
    gathered = cost.has_head and kind != "F" and gathers_parameters(plan, "B")
    return _action_spans(spec, t, sp, plan.microbatch_size, plan.precision, cost.layers, cost.has_embedding,
                         cost.has_head, cost.params, kind, split, gathered)


@functools.lru_cache(maxsize=1 << 14)  # the search's bounds ask it of many plans alike in all it reads
def _action_spans(spec, t: int, sp: bool, b: int, precision, layers: int, has_embedding: bool, has_head: bool,
                  params: float, kind: str, split: bool, gathered: bool) -> tuple[Span, ...]:
    """:func:`action_spans` of a dense action from what it reads (``gathered``: the head's weight gathered again
    for the backward)."""
    c = precision.compute_bytes
    n, d = b * spec.seq_len, spec.d_model
    dense, products = (x / t for x in _layer_matmul_flops(spec, b, t))
    mlp_flops = 2 * n * spec.mlp_matrices * d * spec.d_ff / t
    replicated, split_b = layer_traffic_bytes(spec, b, precision, t, sp)
    hidden = c * spec.mlp_matrices * n * spec.d_ff / t
    scores = 0 if spec.attention is Attention.FLASH else c * b * spec.heads * spec.seq_len ** 2 / t
    norm = replicated / norms(spec)
    mlp_w = c * spec.mlp_matrices * d * spec.d_ff / t
    attn_w = c * (d * (spec.q_dim + 2 * spec.kv_dim) + spec.q_dim * d) / t
    head_w = c * d * spec.padded_vocab / t if has_head else 0.0
    embed_w = max(0.0, params * c - layers * (attn_w + mlp_w) - head_w)
    # (what, projection FLOPs, attention products' FLOPs, forward bytes); a block's norm first, a span of its own
    # under sequence parallelism (on the sequence shard, between a reduce-scatter and an all-gather).
    attn = ("attention", dense - mlp_flops, products, attn_w + split_b - hidden + (SOFTMAX_PASSES["F"] - 1) * scores)
    mlp = ("mlp", mlp_flops, 0.0, mlp_w + hidden)
    blocks = [("attention", dense, products, attn[3] + mlp[3])] if spec.parallel_block else [attn, mlp]
    layer = []
    for what, proj, prod, nbytes in blocks:
        layer += [("norm", 0.0, 0.0, norm), (what, proj, prod, nbytes)] if sp else [(what, proj, prod, nbytes + norm)]
    spans = [list(x) for _ in range(layers) for x in layer]
    n_bytes = c * n * d
    if has_embedding:
        spans.insert(0, ["lookup", 0.0, 0.0, embed_w + n_bytes])
    elif spans:
        spans[0][3] += n_bytes  # the chunk's input, read by its first block
    if has_head:
        head_norm = c * n * (2 * d + norm_stats(spec))
        head_norm = float(sequence_share(head_norm, spec.seq_len, t) if sp else head_norm)
        kept = head_activation_bytes(spec, b, precision, t, sp)
        spans += [["norm", 0.0, 0.0, head_norm]] * sp + [
            ["head", head_forward_flops(spec, b, t), 0.0, head_w + kept - head_norm * sp]]
    if kind == "F":
        loss = [["loss", 0.0, 0.0, LOSS_BYTES * n * spec.padded_vocab / t]] if has_head else []
        return _shares([(proj + prod, nbytes) for _, proj, prod, nbytes in spans + loss])
    logits = LOSS_BYTES * n * (spec.padded_vocab // t + 1) if gathered else 0.0
    return _shares(_backward(spans, scores, split, logits))


def _backward(forward: list[list], scores: float, split: bool, logits: float = 0.0) -> list[tuple[float, float]]:
    """B's (FLOPs, bytes) spans from the forward's (the loss's exp-sum left out: its gradient is the head's), in
    reverse: each block's input gradients (the projections' once, the attention products' twice), its bytes twice
    (once split from W) and the softmax's backward passes; the weight gradients, which no tensor collective waits
    for, in the last span (where the runner's traced program computes them, after the last all-reduce).

    ``logits``: the fp32 logits' bytes (with their log-sum-exp) when the head's weight is gathered over fsdp for
    the backward. The head's input-gradient matmul then reads a gather of its own (testbed.model.leaves: the
    head's backward merge is alone), where testbed.sim.graph.traced_graph starts a new segment (a matmul that reads a
    collective's result the segment has not yet read), so the loss's gradient before it is a span of its own,
    without matmuls, with the logits' share of the head's backward bytes. No fusion undoes that split: XLA
    materializes the loss's gradient, which both of the head's gradient matmuls read, as a fusion of its own
    (its ``exp`` is one of the ops xla/service/instruction_fusion.cc ``IsExpensive`` lists, which instruction
    fusion does not duplicate into several consumers), and a TPU runs its fusions one at a time."""
    times = 1 if split else 2
    extra = (SOFTMAX_PASSES["B"] - times * SOFTMAX_PASSES["F"]) * scores
    out = []
    for what, proj, prod, nbytes in reversed(forward):
        if what == "head" and logits:
            out.append([0.0, times * logits])
            nbytes -= logits
        out.append([proj + 2 * prod, times * nbytes + (extra if what == "attention" else 0.0)])
    if out and not split:
        out[-1][0] += sum(proj for _, proj, _, _ in forward)
    return [(f, nbytes) for f, nbytes in out]


def _shares(spans: list[tuple[float, float]]) -> tuple[Span, ...]:
    """Spans as (share of their FLOPs, bytes): an action's FLOPs beyond its blocks' (remat's recompute) are spread
    as its blocks' own."""
    total = sum(f for f, _ in spans)
    if total <= 0:
        return ()
    return tuple((f / total, float(nbytes)) for f, nbytes in spans)


def scaled_spans(spans: tuple[Span, ...], share: float) -> tuple[Span, ...]:
    """``spans`` of ``share`` of an action's work (its FLOPs shares unchanged, its bytes scaled)."""
    return spans if share == 1 else tuple((f, nbytes * share) for f, nbytes in spans)
