"""XLA:TPU's heap of one training step's temporaries as testbed lays them out: the step's buffers in schedule
order, placed by testbed.model.heap, and the fragmentation libtpu reports twice.

libtpu's ``memory_analysis()`` reports ``temp`` as the heap plus its fragmentation, the heap being the highest
offset a temporary reaches and the fragmentation that heap less the most bytes live at once
(testbed.model.heap, from ``xla/service/buffer_assignment.cc`` and ``xla/service/heap_simulator.cc``); the memory
model's instants price the live peak, so a step's reported memory is that peak plus twice the fragmentation.
Placing a step's buffers in schedule order at the best-fitting free gap (:func:`testbed.model.heap.place`)
reproduces XLA:TPU's heap on most recorded fsdp steps (benchmarks/xla_tpu_heap.py, replaying the dumped buffers).

The buffers (:func:`step_buffers`) are the ones the memory model's instants hold (testbed.model.memory), each
live from the instant that writes it to the last that reads it, on the step's timeline: the embedding, each
layer's forward, the head, the loss, the head's backward, each layer's backward (last to first), the update.

- under fsdp/ZeRO-3 each parameter's gathered copy (one all-gather a parameter: the recorded compiles' gathers,
  benchmarks/xla_tpu/; a weight matrix in bf16 under fp32, testbed.model.gathered.matmul_element_bytes),
  gathered ahead by ``runtime.fsdp_prefetch`` blocks, forward and again backward (the head's forward copy in
  the compute dtype: testbed.model.blocks.narrowed); the head's gathered block lives from the head's forward
  through its backward (testbed.model.gathered);
- each layer's kept set, from its forward to its backward (testbed.model.xla_tpu.layer_kept_bytes); the head's
  norm input and logits, from the head's forward to its backward; under XLA:TPU's kept residual summands (one
  device, one sequence a microbatch, full remat: testbed.model.xla_tpu.keeps_residual_summands) each layer's two
  summands from its forward to one fusion at the forward's end (the first layer's to the instruction before), which
  writes the block inputs of the layers after the first, and the head's norm input from the last layer's forward;
- the loss's fp32 buffer at the loss, one layer backward's workspace at each layer's backward;
- the gradients, each block's written at its backward and held to the update (or written at the update where
  the memory model has none live before it), and the data reduction's buffer at the update.

This applies to the step the one-microbatch instants price (one microbatch, one stage); the gradient
accumulation loop and a pipeline's programs are not laid out (no fragmentation counted).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from testbed.model import heap, layout, xla_tpu
from testbed.model.activations import norms
from testbed.model.blocks import narrowed
from testbed.model.gathered import matmul_element_bytes
from testbed.model.ring import rank_spec
from testbed.plan.sharding import gathered_blocks
from testbed.plan.spec import Attention, Plan, Remat

__all__ = ["StepTerms", "step_buffers", "buffer_kinds", "fragmentation"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTerms:
    """The memory model's terms of a one-microbatch step, bytes on one device: a layer's kept set, the head's
    kept buffers, the loss's and a layer backward's workspace, one layer's and the head's gradients (the sharded
    bytes the device holds), whether no gradient is live before the update (``late_grads``), and the data
    reduction's buffer."""

    per_layer: int
    head: tuple[int, ...]
    loss: int
    layer: int
    layer_grads: int
    head_grads: int
    late_grads: bool
    reduction: int

    def __post_init__(self) -> None:
        sizes = (self.per_layer, *self.head, self.loss, self.layer, self.layer_grads, self.head_grads, self.reduction)
        if any(s < 0 for s in sizes):
            raise ValueError(f"a step's terms are >= 0 bytes, got {sizes}")


def _gathered(plan: Plan) -> tuple[tuple[int, ...], list[tuple[int, ...]], tuple[int, ...], tuple[int, ...]]:
    """Bytes of each gathered parameter (whole over the shard axes, tensor split) of the embedding, of each layer
    and of the head forward and backward, in the compute dtype but the weight matrices XLA:TPU gathers in bf16
    (testbed.model.gathered.matmul_element_bytes, testbed.model.blocks.narrowed); empty when nothing is sharded."""
    if not gathered_blocks(plan):
        return (), [()] * plan.model.layers, (), ()
    spec, mesh, c = plan.model, plan.mesh, plan.precision.compute_bytes
    m = matmul_element_bytes(plan, True)

    def sizes(params, piece: str, kind: str = "B") -> tuple[int, ...]:
        return tuple((m if narrowed(p, piece, kind) else c) * layout.held_elements(
            ((p, 1),), mesh.tensor, 1, mesh.expert, expert_tensor=mesh.expert_tensor) for p in params)

    head = (*layout.head_params(spec), *((layout.tied_table(spec),) if spec.tied_embeddings else ()))
    layers = [sizes(layout.layer_params(spec, i), "layer") for i in range(spec.layers)]
    return sizes(layout.embedding_params(spec), "embedding"), layers, sizes(head, "head", "F"), sizes(head, "head")


def _tensors(plan: Plan) -> dict[str, int]:
    """Bytes of one layer's tensors on one device, one microbatch, compute dtype: the residual stream (its sequence
    shard under SP), Q, K and V together, one MLP hidden, one score matrix (0 under flash attention)."""
    spec, t, c = rank_spec(plan), plan.mesh.tensor, plan.precision.compute_bytes
    n = plan.microbatch_size * spec.seq_len
    residual = n * spec.d_model // (t if plan.sequence_parallel else 1)
    kv = 2 * n * spec.kv_dim // (t if spec.kv_split(t) else 1)
    scores = 0 if spec.attention is Attention.FLASH else plan.microbatch_size * spec.heads * spec.score_rows \
        * spec.seq_len // t
    return {"residual": c * residual, "q": c * n * spec.q_dim // t, "kv": c * kv, "hidden": c * n * spec.d_ff // t,
            "scores": c * scores}


def _pieces(total: int, parts: list[int]) -> list[int]:
    """``total`` bytes as the buffers ``parts`` lists, in order while they fit, and what is left as one buffer."""
    out = []
    for part in parts:
        if 0 < part <= total:
            out.append(part)
            total -= part
    return [*out, total] if total else out


def _layer_buffers(plan: Plan, kept: int, work: int) -> tuple[list[int], list[int]]:
    """A layer's kept set and its backward's workspace as buffers: the kept set's residual-stream inputs, Q, K and
    V, the MLP's hidden values and the probabilities (full remat: the block input); the workspace's score-sized
    or MLP-hidden buffers and, under full remat, the recomputed set (testbed.model.xla_tpu): beside the
    score-sized buffer the attention's (the MLP's hidden values freed with the MLP's backward,
    testbed.model.workspace.layer_workspace)."""
    spec, x = plan.model, _tensors(plan)
    every = [x["q"], x["kv"], *[x["hidden"]] * (spec.mlp_matrices - 1), x["scores"]]
    full = plan.remat is Remat.FULL
    kept_parts = [x["residual"]] if full else [*[x["residual"]] * norms(spec), *every]
    hidden = [*[x["residual"]] * 2, *[x["hidden"]] * spec.mlp_matrices]
    attention = [x["scores"]] * (2 if plan.remat is Remat.SELECTIVE else 1)
    if not full:
        return _pieces(kept, kept_parts), _pieces(work, attention if sum(attention) >= sum(hidden) else hidden)
    # The larger of the MLP's backward (the whole recompute) and the attention's (the MLP's recompute freed).
    paths = ([*hidden, *every, x["residual"]], [*attention, x["q"], x["q"], x["kv"], x["scores"], x["residual"]])
    return _pieces(kept, kept_parts), _pieces(work, max(paths, key=sum))


def step_buffers(plan: Plan, terms: StepTerms) -> tuple[heap.Buffer, ...]:
    """The one-microbatch step's temporaries on one device in schedule order (the module docstring's list)."""
    return tuple(b for b, _ in buffer_kinds(plan, terms))


def buffer_kinds(plan: Plan, terms: StepTerms) -> tuple[tuple[heap.Buffer, str], ...]:
    """:func:`step_buffers` each with what it holds: ``gathered`` (a parameter's gathered copy), ``kept`` (a layer's
    or the head's kept buffers), ``workspace`` (the loss's, a layer backward's) or ``gradients`` (the gradients and
    the data reduction's buffer)."""
    layers = plan.stage_layers[0]
    ahead = plan.runtime.fsdp_prefetch
    summands = xla_tpu.keeps_residual_summands(plan)
    fused = layers + 1  # the forward's end: under kept summands the fusion that writes the block inputs
    head_at = layers + 1 + summands
    loss_at = head_at + 1
    update = 2 * layers + 5 + summands
    forward, backward = (lambda i: 1 + i), (lambda i: loss_at + 2 + layers - 1 - i)
    embed_w, layer_w, head_w, head_back = _gathered(plan)
    kept, work = _layer_buffers(plan, terms.per_layer, terms.layer)
    out = [(heap.Buffer(0, 0, s), "gathered") for s in embed_w]
    out += [(heap.Buffer(max(head_at - ahead, 0), head_at, s), "gathered") for s in head_w]
    out += [(heap.Buffer(loss_at, loss_at + 1, s), "gathered") for s in head_back]
    # Under kept summands the head's norm input is the last layer's output, written with it.
    out += [(heap.Buffer(layers if summands and k == 0 else head_at, loss_at + 1, s), "kept")
            for k, s in enumerate(terms.head)]
    out.append((heap.Buffer(loss_at, loss_at, terms.loss), "workspace"))
    grads_from = (lambda at: update) if terms.late_grads else (lambda at: at)
    out.append((heap.Buffer(grads_from(loss_at + 1), update, terms.head_grads), "gradients"))
    for i in range(layers):
        out += [(heap.Buffer(max(forward(i) - ahead, 0), forward(i), s), "gathered") for s in layer_w[i]]
        out += [(heap.Buffer(max(backward(i) - ahead, loss_at + 1), backward(i), s), "gathered") for s in layer_w[i]]
        # The first kept buffer, the block's input (the residual stream), is the block before's output, or under
        # kept summands the forward-end fusion's (layer 0's the embedding's); the summands live to that fusion.
        first = fused if summands and i else forward(i) - 1
        out += [(heap.Buffer(first if k == 0 else forward(i), backward(i), s), "kept") for k, s in enumerate(kept)]
        out += [(heap.Buffer(forward(i), fused - (i == 0), _tensors(plan)["residual"]), "kept")] * 2 * summands
        out += [(heap.Buffer(backward(i), backward(i), s), "workspace") for s in work]
        out.append((heap.Buffer(grads_from(backward(i)), update, terms.layer_grads), "gradients"))
    out.append((heap.Buffer(update, update, terms.reduction), "gradients"))
    return tuple((b, what) for b, what in out if b.size)


@functools.lru_cache(maxsize=1024)  # pure; a search asks it of a plan's stage bound, then of its breakdown
def fragmentation(plan: Plan, terms: StepTerms) -> int:
    """The heap's fragmentation when :func:`step_buffers` are placed in schedule order (testbed.model.heap):
    its size beyond the most bytes live at once."""
    return heap.heap(step_buffers(plan, terms)).fragmentation
