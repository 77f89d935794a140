"""Mixture-of-experts terms of the cost and memory models: counts, FLOPs, dispatch sizes, activations.

An MoE layer (``ModelSpec.is_moe_layer``; rows of ``testbed.model.layout``) replaces the dense MLP
by a router, ``experts`` routed experts of width ``fe`` (``expert_d_ff``, else ``d_ff``) of which
each token uses ``top_k``, and ``shared_experts`` experts every token uses. Under expert
parallelism of degree ``ep`` each rank holds ``experts / ep`` routed experts; a layer's forward
sends every token's ``top_k`` copies to the ranks holding their experts (the *dispatch*
all-to-all over the expert group), runs its local experts, and returns the outputs (the
*combine* all-to-all); the backward does the same in reverse.

The quantities, per microbatch on one rank (``N`` = microbatch x seq / context tokens):

- :func:`expert_load`: the routed experts' work relative to even routing: the capacity factor
  when set (every expert's buffer is padded to it, Switch/GShard), else the plan's
  ``expert_imbalance`` (dropless: the busiest expert rank's tokens over the mean paces the layer);
- :func:`expert_tokens`: rows of each local expert's grouped GEMM, ``ep N top_k load / E``;
- :func:`dispatch_bytes`: one all-to-all's buffer, ``N top_k load d`` values in the compute
  dtype (nccl-tests' convention: the whole buffer of a rank; ``(ep-1)/ep`` of it leaves the rank);
- FLOPs: the router ``2 N d E`` (fp32 logits), the routed experts ``top_k load`` times a dense
  MLP of width ``fe``, the shared ones a dense MLP of width ``S fe``; model FLOPs (MFU) count
  the active ones, ``load`` 1;
- activations kept for the backward: the router's fp32 logits and probabilities, the dispatched
  tokens and the experts' outputs (``N top_k load d`` each), the experts' and shared experts'
  hidden values; the dispatch send and combine receive buffers are workspace.

MoE parallel folding (``mesh.expert_tensor`` 1 with ``mesh.tensor`` ``t`` > 1, Megatron-Core's
``--expert-tensor-parallel-size 1``): the experts are split over ``ep t`` ranks
(``MeshSpec.expert_parallel``) and each is whole on its rank. The tensor ranks of an expert rank hold the
same tokens (the dense layers' replicas), so each takes the slots of its own ``E / (ep t)`` experts without
moving them; the all-to-alls stay over the expert group, ``1 / t`` of the buffer each
(:func:`routed_rows`); the gate-weighted outputs of each rank's experts are partial sums that the MLP's one
reduction over the tensor ranks completes, as a dense MLP's. Per rank the routed FLOPs are the same (``E /
(ep t)`` experts of width ``fe`` for ``E / ep`` of width ``fe / t``); the dispatched tokens and the
dispatch buffers are ``1 / t`` of them.

Parameters: :func:`active_param_count` is the published "active" count (the routed experts a
token does not use left out); expert weights are split over the expert axis (layout's
``expert_dim``) and their gradients summed over the batch axes but ``expert``
(``testbed.plan.sharding.reduction_axes``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

from testbed.model import layout
from testbed.plan.spec import ModelSpec, Plan, Precision

__all__ = ["moe_layers", "expert_capacity", "active_param_count", "expert_load", "expert_tokens", "local_tokens",
           "dispatch_bytes", "sequence_dispatch", "routed_rows", "mlp_flops_swap", "recompute_flops_swap", "model_flops_swap",
           "activation_bytes_swap", "layer_traffic_swap", "hidden_workspace", "dispatch_workspace", "ROUTER_BYTES"]

#: Bytes per router logit and probability (fp32 for a stable softmax, as Switch and Mixtral keep them).
ROUTER_BYTES = 4


def moe_layers(spec: ModelSpec, layers: Iterable[int] | None = None) -> int:
    """MoE layers among ``layers`` (all of the model's by default)."""
    if not spec.experts:
        return 0
    return sum(spec.is_moe_layer(i) for i in (range(spec.layers) if layers is None else layers))


def active_param_count(spec: ModelSpec) -> int:
    """Parameters one token uses (published, no vocab padding): all of the layout's rows but, in every MoE
    layer, the ``experts - top_k`` routed experts the token is not sent to (equals
    :func:`testbed.model.costs.param_count` for a dense model)."""
    spec = replace(spec, pad_vocab_to=None, vocab_multiple=1)
    held = [(p, 1) for p in layout.embedding_params(spec) + layout.head_params(spec)]
    held += layout.layers_params(spec, range(spec.layers))
    total = sum(p.size * n for p, n in held)
    routed = sum(p.size * n for p, n in held if p.is_expert)
    return total - routed * (spec.experts - spec.top_k) // spec.experts if spec.experts else total


def expert_capacity(spec: ModelSpec) -> int:
    """Slots each expert has per sequence, the routing group (the rule both interpreters read).

    ``ceil(capacity_factor x seq_len x top_k / experts)``, at least 1 and at most ``seq_len`` (a token
    takes one slot of an expert); dropless (``capacity_factor`` None) gives every expert ``seq_len``
    slots, so no token is dropped whatever the routing. testbed.runner.moe routes into these slots.
    """
    if spec.capacity_factor is None:
        return spec.seq_len
    return max(1, min(spec.seq_len, math.ceil(spec.capacity_factor * spec.seq_len * spec.top_k / spec.experts)))


def expert_load(plan: Plan) -> float:
    """The routed experts' work over even routing: the capacity buffers' padding (:func:`expert_capacity` over
    the even share ``seq_len x top_k / experts``) when a capacity is set or the stack pads dropless buffers to the
    sequence (``runtime.moe_padded_dropless``, the runner: ``experts / top_k``; its all-to-alls then move the whole
    ``[experts, seq_len, d]`` slot buffer of each sequence, as XLA:TPU's compiles of moe1k-expert4 and
    moe1k-data4-expert4 show, benchmarks/xla_tpu/), else ``expert_imbalance``."""
    m = plan.model
    if m.capacity_factor or (m.experts and plan.runtime.moe_padded_dropless):
        return expert_capacity(m) * m.experts / (m.seq_len * m.top_k)
    return float(plan.expert_imbalance)


def local_tokens(plan: Plan) -> int:
    """Tokens of one microbatch on one rank: ``microbatch x seq_len / context``."""
    return plan.microbatch_size * plan.model.seq_len // plan.mesh.context


def expert_tokens(plan: Plan) -> int:
    """Rows each local expert's GEMMs run per microbatch on one rank: ``ceil(ep N top_k load / E)`` (0: dense)."""
    spec = plan.model
    if not spec.experts:
        return 0
    return max(1, math.ceil(plan.mesh.expert * local_tokens(plan) * spec.top_k * expert_load(plan) / spec.experts))


def dispatch_bytes(plan: Plan) -> float:
    """One rank's buffer of one dispatch (or combine) all-to-all per microbatch: ``N top_k load d`` values.

    As the grouped GEMMs see them: ``E / ep`` local experts x :func:`expert_tokens` rows of ``d_model``. With
    a capacity factor every rank's buffers are padded to it; dropless, the busiest rank receives ``load`` times
    the even share, and an all-to-all lasts as long as its busiest receiver, so the even-share buffer scaled
    by the load is what the (uniform) collective timing prices.
    """
    return float(routed_rows(plan) * plan.model.d_model * plan.precision.compute_bytes)


def sequence_dispatch(plan: Plan) -> bool:
    """Whether each tensor rank dispatches only its own sequence shard (``runtime.moe_sequence_dispatch``, Megatron-
    Core's all-to-all dispatcher): with sequence parallelism over ``t`` > 1 tensor ranks, experts split like the dense
    MLP (``expert_tensor`` = ``tensor``) and ``expert`` > 1, a rank's all-to-all carries ``1 / t`` of
    :func:`dispatch_bytes` and the experts' tensor ranks all-gather the received rows (the combine reduce-scatters
    them first). Folded experts (``expert_tensor`` 1) already take ``1 / t`` each (:func:`routed_rows`)."""
    mesh = plan.mesh
    return (plan.runtime.moe_sequence_dispatch and plan.sequence_parallel and mesh.tensor > 1 and mesh.expert > 1
            and mesh.expert_tensor_degree == mesh.tensor)


def routed_rows(plan: Plan) -> int:
    """Rows of all local experts' GEMMs together per microbatch on one rank: ``E / expert_parallel`` experts x
    :func:`expert_tokens` (MoE parallel folding, ``mesh.expert_tensor`` 1: the tensor ranks share the expert
    group's experts, each taking a ``1 / tensor`` share of the slots of the tokens all of them hold)."""
    return plan.model.experts // plan.mesh.expert_parallel * expert_tokens(plan)


def _routed_forward(spec: ModelSpec, rows: float, tensor: int) -> float:
    """Forward FLOPs of the routed experts on one tensor rank for ``rows`` routed rows (all local experts)."""
    return 2.0 * rows * spec.d_model * spec.mlp_matrices * spec.expert_width / tensor


def _moe_forward(spec: ModelSpec, tokens: int, rows: float, tensor: int, expert_tensor: int | None = None) -> float:
    """Forward FLOPs of one MoE block on one tensor rank: router, routed experts (``rows`` rows at the experts'
    tensor degree, ``tensor`` when None), shared experts."""
    d, m, fe = spec.d_model, spec.mlp_matrices, spec.expert_width
    router = 2.0 * tokens * d * spec.experts
    shared = 2.0 * tokens * d * m * spec.shared_experts * fe / tensor
    return router + _routed_forward(spec, rows, tensor if expert_tensor is None else expert_tensor) + shared


def _dense_mlp(spec: ModelSpec, tokens: int, tensor: int) -> float:
    return 2.0 * tokens * spec.d_model * spec.mlp_matrices * spec.d_ff / tensor


def mlp_flops_swap(plan: Plan, tokens: int | None = None) -> float:
    """Forward FLOPs an MoE layer adds over a dense one on one rank per microbatch (may be negative): the MoE
    block (routed rows as :func:`expert_tokens` gives them) less the dense MLP. The backward's input and
    weight gradients are each the same again (the GEMMs of testbed.model.gemm.moe_gemms)."""
    spec, t = plan.model, plan.mesh.tensor
    n = local_tokens(plan) if tokens is None else tokens
    return _moe_forward(spec, n, routed_rows(plan), t, plan.mesh.expert_tensor) - _dense_mlp(spec, n, t)


def recompute_flops_swap(plan: Plan) -> float:
    """Full remat's extra recompute in an MoE layer over a dense one: the MoE block less its out projections
    (routed and shared ``w2``), against the dense MLP less its out projection."""
    spec, t = plan.model, plan.mesh.tensor
    n = local_tokens(plan)
    keep = (spec.mlp_matrices - 1) / spec.mlp_matrices
    moe_block = _moe_forward(spec, n, routed_rows(plan), t, plan.mesh.expert_tensor)
    return 2.0 * n * spec.d_model * spec.experts + keep * (moe_block - 2.0 * n * spec.d_model * spec.experts
                                                          - _dense_mlp(spec, n, t))


def model_flops_swap(spec: ModelSpec, tokens: int) -> float:
    """Active forward FLOPs all MoE layers add over dense ones for ``tokens`` tokens (MFU: even routing, no
    padding): router, ``top_k`` and the shared experts, less the dense MLPs they replace."""
    return moe_layers(spec) * (_moe_forward(spec, tokens, tokens * spec.top_k, 1) - _dense_mlp(spec, tokens, 1))


def activation_bytes_swap(plan: Plan, tensor: int, xla_tpu: bool = False) -> int:
    """Bytes an MoE layer keeps for its backward over a dense one, per microbatch on one rank (may be negative).

    Kept: the router's fp32 logits and probabilities (``2 N E``), the dispatched tokens and the experts'
    outputs (``rows d`` each), the routed and shared experts' hidden values (``m rows fe / t`` and
    ``m N S fe / t``, ``m`` the MLP's matrices: SwiGLU keeps gate, up and their product, GELU its input and
    output); less the dense MLP's hidden (``m N d_ff / t``). Under XLA:TPU's buffer rules (``xla_tpu``,
    testbed.model.xla_tpu) ``m - 1`` hidden values per MLP (the activation function's output is recomputed in the
    backward's fusions, the experts' as the dense MLP's, testbed.model.xla_tpu.layer_kept_bytes: the chip's MoE
    profiles, benchmarks/tpu_chip/moe/profiles.json, show the experts' down projection reading gate and up, their
    product made inside its kernel), and of the experts' outputs only the combine's gathered ones, ``N top_k d``
    (the gate's gradient reads them; nothing in the backward reads the slot buffer of outputs, whose gradient is a
    scatter into zeros: the profiles' ``gather_fusion`` of ``N top_k`` rows and ``scatter_fusion`` of ``rows``).
    """
    spec = plan.model
    if not xla_tpu:
        return sum(_kept_swap(plan, tensor, spec.mlp_matrices, routed_rows(plan)))
    return sum(_kept_swap(plan, tensor, spec.mlp_matrices - 1, local_tokens(plan) * spec.top_k))


def layer_traffic_swap(plan: Plan, tensor: int) -> tuple[int, int]:
    """(replicated, split) bytes of activations an MoE layer's forward writes over a dense layer's, per microbatch on
    one rank (testbed.model.activations.layer_traffic_bytes' two kinds, which count every kept value as XLA:CPU
    keeps it; may be negative): :func:`activation_bytes_swap`'s, divided by where they live. Replicated, ``d_model``
    wide on every tensor rank as the residual stream: the router's fp32 logits and probabilities and the slot buffers
    (the dispatched tokens and the experts' outputs, ``rows d`` each, the padded slots included: the runner's gather,
    copies and scatter-add move them whole, benchmarks/tpu_moe_ops.py); split: the routed and shared experts' hidden
    values less the dense MLP's."""
    return _kept_swap(plan, tensor, plan.model.mlp_matrices, routed_rows(plan))


def _kept_swap(plan: Plan, tensor: int, hidden: int, outputs: int) -> tuple[int, int]:
    """(replicated, split) bytes of :func:`activation_bytes_swap` with ``hidden`` values kept per MLP and ``outputs``
    rows of the experts' outputs."""
    spec, c = plan.model, Precision(plan.precision).compute_bytes
    n, fe, rows, m = local_tokens(plan), spec.expert_width, routed_rows(plan), hidden
    et = tensor if plan.mesh.expert_tensor is None else plan.mesh.expert_tensor
    replicated = ROUTER_BYTES * 2 * n * spec.experts + c * (rows + outputs) * spec.d_model
    split = c * (m * rows * fe // et + m * n * spec.shared_experts * fe // tensor) - c * m * n * spec.d_ff // tensor
    return replicated, split


def dispatch_workspace(plan: Plan) -> int:
    """Transient bytes of one MoE layer's all-to-alls: the dispatch's send buffer and the combine's receive
    buffer (the received tokens and the experts' outputs are kept activations); 0 for a dense model, and 0 without
    expert parallelism (``MeshSpec.expert_parallel`` 1: every expert is on the rank, no all-to-all runs, and the
    dispatched tokens the experts read are the kept ones: the runner's ``capacity_factor`` MoE at ``expert`` 1,
    compiled by XLA:CPU, 252.1 MB against 250.1 MB predicted without the buffers and 255.4 MB with them)."""
    if not plan.model.experts or plan.mesh.expert_parallel == 1:
        return 0
    return int(2 * dispatch_bytes(plan))


def hidden_workspace(plan: Plan) -> int:
    """One MoE layer's backward transients on one rank: the gradients of the routed and shared experts' hidden
    values and of the dispatched tokens (the dense MLP's counterpart is ``N (2 d + m d_ff / t)``); 0 if dense."""
    spec, c, t = plan.model, plan.precision.compute_bytes, plan.mesh.tensor
    if not spec.experts:
        return 0
    n, fe, m, rows, et = local_tokens(plan), spec.expert_width, spec.mlp_matrices, routed_rows(plan), \
        plan.mesh.expert_tensor_degree
    return c * (2 * n * spec.d_model + rows * spec.d_model + m * rows * fe // et + m * n * spec.shared_experts * fe // t)
