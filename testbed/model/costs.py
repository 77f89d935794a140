"""Analytic GPT model: parameter counts, FLOPs, bytes and the split over stages.

The parameters are those of ``testbed.model.layout``'s table (the JAX twin, ``testbed/runner/model.py``, builds the
same table): every count here is a sum over it, so the two cannot drift. In short: a token table and a learned
position table (stage 0, chunk 0), ``layers`` pre-LayerNorm blocks (LN1, fused QKV ``d x 3d``, out projection ``d x
d``, LN2, MLP ``d x d_ff`` and ``d_ff x d``, all with biases, GELU), and a head (final LN plus an output projection
``d x vocab`` without bias, omitted when ``tied_embeddings``) on the last stage's last chunk. With tied embeddings
on another chunk than the embedding's, that chunk holds a copy of the token table (its gradient is all-reduced with
stage 0's), so held parameters exceed :func:`param_count`.

Tensor parallelism is Megatron's: the table gives each parameter's split dim (QKV and MLP-in by columns, out
projection and MLP-out by rows, token table and head by vocab; norms, the position table and the row-split biases
replicated on every tensor rank).

The model family options (grouped-query attention, SwiGLU, RMSNorm, RoPE, no biases, dropout, vocab padding;
``testbed.plan.spec.ModelSpec``) change the table's rows and the formulas below: K/V projections ``d x kv_dim``,
three MLP matrices, one norm statistic per token, dropout masks, FLOPs and memory over the padded vocab.
:func:`param_count` is the published count (no padding); :func:`padded_param_count` what the devices hold.

FLOPs count matmuls only (``2*m*n*k``); attention is dense over the full
``seq x seq`` score matrix (causality by masking), as the JAX model computes
it. Softmax, LayerNorm, GELU and the loss are memory bound and appear in the
byte estimates instead.

Flash attention (``model.attention: flash``, ``testbed/runner/attention.py``) has the
same forward FLOPs; its backward recomputes the scores ``Q K^T`` (FlashAttention-2:
2.5x the forward's attention FLOPs, counted as recompute, not as model FLOPs)
and it keeps no ``seq x seq`` tensor: only the fp32 log-sum-exp of every score
row beside Q, K, V and its output (:func:`activation_bytes_per_layer`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from testbed.errors import InputError
from testbed.model import dispatch, gemm, layout, moe, ring
from testbed.model.activations import (  # noqa: F401  (re-exported: costs is their historical home)
    DROPOUT_MASK_BYTES, FLASH_BYTES, LOSS_BYTES, activation_bytes_per_layer, head_activation_bytes, layer_traffic_bytes,
    megatron_activation_bytes_per_layer, norm_stats as _norm_stats, norms as _norms, xla_only_bytes_per_layer)
from testbed.model.layout import chunk_layers
from testbed.plan.spec import Attention, ModelSpec, Norm, Plan, Position, Precision, Remat

__all__ = [
    "embedding_param_count", "layer_param_count", "head_param_count", "param_count", "padded_param_count", "chunk_layers",
    "stage_param_count", "device_stage_params", "layer_forward_flops", "head_forward_flops", "recompute_flops_per_layer",
    "activation_bytes_per_layer", "xla_only_bytes_per_layer", "megatron_activation_bytes_per_layer",
    "layer_traffic_bytes", "head_activation_bytes", "ChunkCost", "chunk_cost",
    "model_flops_per_step", "step_flops_per_device",
]



# -- parameters ---------------------------------------------------------------------

def embedding_param_count(spec: ModelSpec) -> int:
    """Token table plus learned position table."""
    return sum(p.size for p in layout.embedding_params(spec))


def layer_param_count(spec: ModelSpec) -> int:
    """One block: two LayerNorms, QKV and out projections, two MLP matrices, all with biases."""
    return sum(p.size for p in layout.layer_params(spec))


def head_param_count(spec: ModelSpec) -> int:
    """Final LayerNorm plus the output projection (0 extra when tied to the token table)."""
    return sum(p.size for p in layout.head_params(spec))


def padded_param_count(spec: ModelSpec) -> int:
    """Parameters the model holds: :func:`param_count` plus the padded vocab rows of the token table and head."""
    layers = sum(p.size * n for p, n in layout.layers_params(spec, range(spec.layers)))  # MoE layers differ
    return embedding_param_count(spec) + layers + head_param_count(spec)


@functools.lru_cache(maxsize=1024)
def param_count(spec: ModelSpec) -> int:
    """Distinct trainable parameters of the whole model, as published: the vocab padding not counted.

    (Padded rows count in memory and FLOPs, which come from the held shapes.)
    """
    return padded_param_count(replace(spec, pad_vocab_to=None, vocab_multiple=1))


def _layer_params_per_tensor_rank(spec: ModelSpec, tensor: int) -> int:
    return sum(p.device_elements(tensor) for p in layout.layer_params(spec))


@functools.lru_cache(maxsize=65536)  # pure; a plan search counts the same chunks for thousands of plans
def _chunk_params(spec: ModelSpec, stage: int, chunk: int, stages: int, virtual: int, tensor: int,
                  ways: int = 1, stage_layers: tuple[int, ...] | None = None, expert: int = 1,
                  experts_only: bool | None = None, expert_tensor: int | None = None) -> int:
    held = layout.chunk_params(spec, stage, chunk, stages, virtual, stage_layers=stage_layers)
    return layout.held_elements(held, tensor, ways, expert, experts_only, expert_tensor)


def stage_param_count(spec: ModelSpec, stage: int, stages: int, virtual: int = 1,
                      stage_layers: tuple[int, ...] | None = None) -> int:
    """Parameters held by pipeline stage ``stage`` (all its chunks, no tensor split).

    Includes the tied token-table copy on the last stage when ``stages > 1``
    (so the stages sum to :func:`param_count` plus ``vocab * d_model`` then;
    likewise with ``virtual > 1`` on one stage). ``stage_layers``: layers per
    stage (``Plan.stage_layers``; None: the even split).
    """
    if not 0 <= stage < stages:
        raise InputError(f"must be in 0..{stages - 1}, got {stage}", field="stage")
    return sum(_chunk_params(spec, stage, c, stages, virtual, 1, stage_layers=stage_layers) for c in range(virtual))


def device_stage_params(plan: Plan, stage: int, ways: int = 1, experts_only: bool | None = None) -> int:
    """Parameters one device of ``stage`` holds after the tensor and expert splits and, with ``ways`` > 1,
    fsdp/ZeRO sharding (``experts_only``: True the routed experts' weights only, False the others only).

    The sharding is the layout's one rule (``testbed.model.layout.shard_dim``,
    as the runner's): a parameter no free dim of which ``ways`` divides stays whole.
    """
    mesh = plan.mesh
    return _stage_params(plan.model, stage, mesh.stage, plan.schedule.virtual_stages, mesh.tensor, ways,
                         plan.stage_layers, mesh.expert, experts_only, mesh.expert_tensor)


@functools.lru_cache(maxsize=65536)  # pure: the memory bounds ask it for every stage of thousands of plans
def _stage_params(spec: ModelSpec, stage: int, stages: int, virtual: int, tensor: int, ways: int,
                  stage_layers: tuple[int, ...] | None, expert: int, experts_only: bool | None,
                  expert_tensor: int | None) -> int:
    """:func:`device_stage_params` of a plan's values, its chunks' :func:`_chunk_params` summed."""
    return sum(_chunk_params(spec, stage, c, stages, virtual, tensor, ways, stage_layers, expert, experts_only,
                             expert_tensor) for c in range(virtual))


# -- FLOPs ----------------------------------------------------------------------------

def _layer_matmul_flops(spec: ModelSpec, batch: int, tensor: int = 1) -> tuple[int, int]:
    """(projection + MLP FLOPs, attention score + value FLOPs) of one layer, summed over the tensor ranks.

    Q and the out projection are ``d x q`` (``q = heads x head_dim``, ``d`` by default), K and V ``d x kv_dim``
    each (grouped-query attention shrinks them), the MLP has 2 (GELU) or 3 (SwiGLU) ``d x d_ff`` matrices;
    scores and values are per query head (``q`` wide in all), over :attr:`ModelSpec.score_rows` query rows. When the tensor degree does not divide ``kv_heads``, every
    rank projects all K/V heads (the layout keeps ``wkv`` whole), so the ranks together do the K/V
    projection ``tensor`` times: the sum divided by ``tensor`` is then one rank's work.
    """
    n, d, f, s, kv, q = batch * spec.seq_len, spec.d_model, spec.d_ff, spec.seq_len, spec.kv_dim, spec.q_dim
    dense = 2 * n * (d * (q + 2 * kv) + q * d + spec.mlp_matrices * d * f)
    if tensor > 1 and not spec.kv_split(tensor):
        dense += (tensor - 1) * 2 * n * d * 2 * kv
    attention = 2 * 2 * batch * spec.score_rows * s * q  # a sliding window under flash: fewer rows per K/V block
    return dense, attention


def layer_forward_flops(spec: ModelSpec, batch: int, tensor: int = 1) -> int:
    """Forward matmul FLOPs of one layer for ``batch`` sequences on one tensor rank."""
    dense, attention = _layer_matmul_flops(spec, batch, tensor)
    return (dense + attention) // tensor


def head_forward_flops(spec: ModelSpec, batch: int, tensor: int = 1) -> int:
    """Forward FLOPs of the output projection (the embedding lookup is a gather: 0)."""
    return 2 * batch * spec.seq_len * spec.d_model * spec.padded_vocab // tensor


def recompute_flops_per_layer(spec: ModelSpec, batch: int, remat: Remat | str, tensor: int = 1) -> int:
    """Extra forward FLOPs one layer redoes in its backward pass.

    selective: the attention scores ``Q K^T`` (the softmax output is dropped;
    ``P V`` need not be redone: its output is kept as the out projection's input).
    full: the whole block forward except the MLP down projection (and a parallel block's out projection), whose
    output only feeds the residual add, which needs nothing saved for its backward.
    With flash attention the backward always recomputes ``Q K^T`` (block by block), with
    or without remat; selective then adds nothing, full the block forward besides.
    """
    remat = Remat(remat)
    n, d, f, s = batch * spec.seq_len, spec.d_model, spec.d_ff, spec.seq_len
    scores = 2 * batch * s * spec.score_rows * spec.q_dim // tensor
    flash = scores if spec.attention is Attention.FLASH else 0
    if remat is Remat.NONE:
        return flash
    if remat is Remat.SELECTIVE:
        return scores
    dense, attention = _layer_matmul_flops(spec, batch, tensor)
    unused = 2 * n * f * d + (2 * n * spec.q_dim * d if spec.parallel_block else 0)  # a parallel block's wo too
    return (dense + attention - unused) // tensor + flash


# -- one chunk on one device --------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkCost:
    """Work and traffic of one pipeline chunk for ONE microbatch on ONE device.

    FLOPs are after the tensor split (fsdp and ZeRO do not change them).
    ``backward_input_flops`` (B) + ``backward_weight_flops`` (W) = 2 x forward;
    attention score/value products have no weights, so both their gradients
    are in B. Bytes are an HBM-traffic estimate for a roofline: forward reads
    the chunk's parameters and writes its kept activations; backward reads
    parameters and activations and writes gradients (about twice forward).

    ``forward_traffic`` is (replicated, split) bytes of the activations the
    forward writes (:func:`layer_traffic_bytes` per layer; the embedding's
    output and the head's LayerNorm are replicated, its fp32 logits split);
    ``recompute_traffic`` what the backward's remat writes again (full: the
    layers' forward; selective: the softmax outputs; flash's recomputed score
    blocks stay inside its kernel: none). ``tensor_bytes`` is one
    ``[tokens, d_model]`` activation of the microbatch: the size an
    elementwise pass over the residual stream streams, which decides how much
    of it runs from cache (``Calibration.cached_fraction``).

    Tensor-parallel all-reduces (each ``tensor_allreduce_bytes``; 0 when
    tensor is 1): 2 per layer forward (after the out projection and the MLP) and 2 per layer backward (gradients
    into QKV and MLP-in), 1 each for a parallel block (its two partial sums added first), plus 1 forward
    for the vocab-parallel embedding and 1 backward for the head's input
    gradient. With ``sequence_parallel`` each becomes an all-gather and a
    reduce-scatter (:meth:`tensor_collectives`), the residual stream's traffic
    and ``activation_out_bytes`` are ``1/t`` per rank. The loss's and the position
    table's tensor collectives: testbed.sim.step.action_work.tensor_transfers.
    """

    layers: int
    forward_flops: int
    backward_input_flops: int
    backward_weight_flops: int
    recompute_flops: int
    forward_bytes: int
    backward_bytes: int
    params: int
    activation_out_bytes: int
    forward_traffic: tuple[int, int]
    recompute_traffic: tuple[int, int]
    tensor_bytes: int
    tensor_allreduce_bytes: int
    tensor_allreduces_forward: int
    tensor_allreduces_backward: int
    has_embedding: bool
    has_head: bool
    sequence_parallel: bool = False
    loss_allreduce_bytes: int = 0
    position_gather_bytes: int = 0
    parallel_block: bool = False
    recompute_block: bool = False  #: full remat reruns the whole block, MLP out projection too (runtime.recompute)

    @property
    def backward_flops(self) -> int:
        return self.backward_input_flops + self.backward_weight_flops

    @property
    def total_flops(self) -> int:
        """Forward + backward + recompute."""
        return self.forward_flops + self.backward_flops + self.recompute_flops

    def tensor_collectives(self, kind: str, remat: Remat | str) -> tuple[tuple[str, int], ...]:
        """``(op, count)`` of the tensor-axis collectives one ``F``, ``B`` or ``W`` action runs, each over a
        ``tensor_allreduce_bytes`` buffer: the one decision the task graph (testbed.sim.graph.program) and the
        analytic tier (testbed.explore.analytic) both read.

        Without sequence parallelism, the all-reduces above (``B`` also redoes, under full remat, the
        out projections'). With it (Megatron SP, Korthikanti et al. 2022) an all-gather of the sequence
        before each column-parallel matmul (QKV, MLP-in, head), a reduce-scatter after each row-parallel
        one (out projection, MLP-out, vocab-parallel embedding); the backward transposes them, full
        remat's forward adds its gathers and the redone scatters. Either way a chunk moves the same bytes
        (all-gather and reduce-scatter ``(t-1)/t`` of the buffer, all-reduce ``2(t-1)/t``). ``W`` none."""
        if not self.tensor_allreduce_bytes or kind == "W":
            return ()
        layers, full, one = self.layers, Remat(remat) is Remat.FULL, self.parallel_block
        per = layers if one else 2 * layers  # a parallel block: one collective where a serial block has two
        # Full remat redoes the out projections' collectives: the attention's (a parallel block's none: JAX drops
        # it), and the MLP's too when the whole block is rerun (runtime.recompute: a parallel block's one).
        redo = 0 if not full else (int(self.recompute_block) if one else 1 + int(self.recompute_block)) * layers
        if not self.sequence_parallel:
            count = self.tensor_allreduces_forward if kind == "F" else self.tensor_allreduces_backward + redo
            return (("all_reduce", count),)
        embed, head = int(self.has_embedding), int(self.has_head)
        if kind == "F":
            return (("all_gather", per + head), ("reduce_scatter", per + embed))
        return (("all_gather", per + embed + (per if full else 0)), ("reduce_scatter", per + head + redo))


def chunk_cost(plan: Plan, stage: int, chunk: int = 0) -> ChunkCost:
    """Cost of virtual chunk ``chunk`` on pipeline stage ``stage`` for one microbatch on one device.

    With context parallelism the device holds ``seq_len / context`` tokens: the per-token work is
    :func:`testbed.model.ring.rank_spec`'s, plus the ring's attention steps after the first.
    """
    spec, p, v, t = ring.rank_spec(plan), plan.mesh.stage, plan.schedule.virtual_stages, plan.mesh.tensor
    if not 0 <= stage < p:
        raise InputError(f"must be in 0..{p - 1}, got {stage}", field="stage")
    if not 0 <= chunk < v:
        raise InputError(f"must be in 0..{v - 1}, got {chunk}", field="chunk")
    b, c = plan.microbatch_size, plan.precision.compute_bytes
    split = plan.stage_layers
    span = chunk_layers(spec, p, v, split)[stage][chunk]
    layers, moe_layers = len(span), moe.moe_layers(spec, span)
    embed, head = layout.holds(stage, chunk, p, v)
    flops = _chunk_flops(plan, spec, layers, moe_layers, head)
    params = _chunk_params(plan.model, stage, chunk, p, v, t, 1, split, plan.mesh.expert, None, plan.mesh.expert_tensor)
    sp = plan.sequence_parallel  # the residual stream split over the sequence on the tensor ranks
    kept = layers * activation_bytes_per_layer(spec, b, plan.precision, Remat.NONE, t, sp)
    kept += moe_layers * moe.activation_bytes_swap(plan, t) if moe_layers else 0
    if head:
        kept += head_activation_bytes(spec, b, plan.precision, t, sp)
    n_bytes = b * spec.seq_len * spec.d_model * c
    if sp and spec.seq_len % t:  # uneven sequence shards (runtime.pad_sequence_shards): the collectives move the padded
        n_bytes = b * -(-spec.seq_len // t) * t * spec.d_model * c  # sequence, t shards of ceil(seq / t) tokens
    forward_bytes = params * c + kept + n_bytes
    forward_traffic, recompute_traffic = _chunk_traffic(plan, spec, layers, embed, head, n_bytes, moe_layers)
    tp = t > 1
    return ChunkCost(
        layers=layers, forward_flops=flops.forward, backward_input_flops=flops.backward_input,
        backward_weight_flops=flops.backward_weight, recompute_flops=flops.recompute,
        forward_bytes=forward_bytes, backward_bytes=2 * forward_bytes, params=params,
        activation_out_bytes=0 if head else (n_bytes // t if sp else n_bytes), forward_traffic=forward_traffic,
        recompute_traffic=recompute_traffic, tensor_bytes=n_bytes, tensor_allreduce_bytes=n_bytes if tp else 0,
        tensor_allreduces_forward=(_norms(spec) * layers + int(embed)) if tp else 0,
        tensor_allreduces_backward=(_norms(spec) * layers + int(head)) if tp else 0,
        has_embedding=embed, has_head=head, sequence_parallel=sp,
        loss_allreduce_bytes=LOSS_BYTES * b * spec.seq_len if tp and head else 0,
        position_gather_bytes=spec.seq_len * spec.d_model * c
        if tp and sp and embed and spec.position is Position.LEARNED else 0, parallel_block=spec.parallel_block,
        recompute_block=plan.remat is Remat.FULL and plan.runtime.recompute in ("block", "op"))


@dataclass(frozen=True, slots=True)
class _ChunkFlops:
    """A chunk's FLOPs for one microbatch on one device: forward, backward (input and weight gradients) and the
    recompute its remat policy adds."""

    forward: int
    backward_input: int
    backward_weight: int
    recompute: int


def _chunk_flops(plan: Plan, spec: ModelSpec, layers: int, moe_layers: int, head: bool) -> _ChunkFlops:
    """The :class:`_ChunkFlops` of ``layers`` layers (``moe_layers`` of them MoE) at the rank's shape ``spec``, with
    the head's when the chunk holds it; context parallelism adds its ring's attention steps after the first."""
    b, t = plan.microbatch_size, plan.mesh.tensor
    dense, attention = _layer_matmul_flops(spec, b, t)
    swap = round(moe_layers * moe.mlp_flops_swap(plan)) if moe_layers else 0  # MoE blocks for dense MLPs
    einsum = dispatch.einsum_flops(plan, moe_layers)  # runtime.moe_dispatch: (forward, backward, recompute)
    forward = layers * (dense + attention) // t + swap + einsum[0]
    b_flops = layers * (dense + 2 * attention) // t + swap + einsum[1]
    w_flops = layers * dense // t + swap
    steps = layers * ring.extra_attention_flops(plan)  # context parallelism: ring steps 1..c-1 (0 otherwise)
    forward, b_flops = forward + steps, b_flops + 2 * steps
    if head:
        hf = head_forward_flops(spec, b, t)
        forward, b_flops, w_flops = forward + hf, b_flops + hf, w_flops + hf
    recompute = layers * recompute_flops_per_layer(spec, b, plan.remat, t) + steps // 2 + (
        steps if plan.remat is Remat.FULL else 0) + (
        round(moe_layers * moe.recompute_flops_swap(plan)) if moe_layers and plan.remat is Remat.FULL else 0) \
        + gemm.policy_recompute_flops(plan, spec, layers, moe_layers) + einsum[2]
    return _ChunkFlops(forward=forward, backward_input=b_flops, backward_weight=w_flops, recompute=recompute)


def _chunk_traffic(plan: Plan, spec: ModelSpec, layers: int, embed: bool, head: bool, n_bytes: int,
                   moe_layers: int = 0) -> tuple[tuple[int, int], tuple[int, int]]:
    """((replicated, split) elementwise bytes of the chunk's forward, (replicated, split) of its recompute):
    the layers' traffic (``moe_layers`` of them MoE layers), the embedding's output and the head's norm and loss;
    the recompute's by remat policy."""
    b, c, t, sp = plan.microbatch_size, plan.precision.compute_bytes, plan.mesh.tensor, plan.sequence_parallel
    replicated, split = (layers * x for x in layer_traffic_bytes(spec, b, plan.precision, t, sp))
    if moe_layers:  # an MoE layer's own activations for the dense MLP's (testbed.model.moe.layer_traffic_swap)
        replicated, split = (x + moe_layers * y for x, y in zip((replicated, split), moe.layer_traffic_swap(plan, t)))
    scores = 0 if spec.attention is Attention.FLASH else b * spec.heads * spec.seq_len ** 2 // t
    dropped = (DROPOUT_MASK_BYTES + c) * scores if spec.dropout > 0 else 0
    recompute = {Remat.NONE: (0, 0), Remat.FULL: (replicated, split),
                 Remat.SELECTIVE: (0, layers * (c * scores + dropped))}[plan.remat]
    if plan.remat is Remat.SELECTIVE and plan.runtime.recompute == "op":  # per-op: the block's elementwise work
        recompute = (replicated, split // 2)  # again, and about half the projections' outputs (those recomputed)
    if plan.remat is Remat.SELECTIVE and plan.runtime.recompute in ("save-dots", "save-dots-flash"):  # the norms
        recompute = (replicated, recompute[1] + layers * c * b * spec.seq_len * (spec.d_ff // t))  # and activation
    replicated += (n_bytes // t if sp else n_bytes) if embed else 0
    if head:
        n = b * spec.seq_len
        replicated += c * n * (2 * spec.d_model + _norm_stats(spec)) // (t if sp else 1)
        split += LOSS_BYTES * n * (spec.padded_vocab // t + 1)
    return (replicated, split), recompute


def model_flops_per_step(plan: Plan) -> float:
    """Useful training FLOPs of one step over all devices: 3 x forward, no recompute (for MFU)."""
    spec, batch = plan.model, plan.batch.global_batch
    forward = spec.layers * layer_forward_flops(spec, batch) + head_forward_flops(spec, batch)
    forward += moe.model_flops_swap(spec, batch * spec.seq_len)  # MoE layers' active FLOPs for dense MLPs'
    return float(3 * forward)


def step_flops_per_device(plan: Plan, stage: int = 0) -> int:
    """FLOPs one device of ``stage`` executes in a step: all its chunks x microbatches, with recompute."""
    return plan.batch.microbatches * sum(chunk_cost(plan, stage, c).total_flops
                                         for c in range(plan.schedule.virtual_stages))
