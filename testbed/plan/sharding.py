"""Which mesh axes shard the model state: parameters, gradients, optimizer state.

One decision read by the memory model, the simulator's task graph and the
runner's shardings alike: the ``fsdp`` axis shards all three; ZeRO over the
``data`` axis adds the optimizer state (stage 1), the gradients (2) and the
parameters (3); ``runtime.shard_context`` adds the ``context`` axis to all three
(torchtitan's FSDP over its ``dp_shard_cp`` mesh). It also decides when gradients are reduced over each
replica axis with several microbatches (:func:`gradient_reduction`); how
many collectives one pass over a chunk's sharded parameters issues, which
needs the model's layout, is testbed.model.leaves'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from testbed.plan.spec import MESH_AXES, Axis, Plan

#: Bytes of the loss value each of :func:`loss_reductions` moves (fp32).
LOSS_VALUE_BYTES = 4

__all__ = ["StateSharding", "state_sharding", "gradient_reduction", "reduction_axes", "loss_reductions",
           "loss_merged", "gathers_parameters", "gathered_blocks", "expert_axes"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StateSharding:
    """Axes (in MESH_AXES order) over which each kind of model state is split."""

    params: tuple[Axis, ...]
    grads: tuple[Axis, ...]
    optimizer: tuple[Axis, ...]

    def ways(self, plan: Plan, which: str) -> int:
        """How many pieces ``which`` (params, grads, optimizer) is cut into."""
        return math.prod(plan.mesh.degree(a) for a in getattr(self, which))

    def split_axes(self, plan: Plan, which: str) -> tuple[str, ...]:
        """Names of the axes of ``which`` that really split it (degree > 1)."""
        return tuple(a.value for a in getattr(self, which) if plan.mesh.degree(a) > 1)


def state_sharding(plan: Plan) -> StateSharding:
    """The state sharding a plan's fsdp degree, ZeRO stage and ``runtime.shard_context`` imply (one object per
    combination: the axes depend on nothing else, and the search asks for it hundreds of thousands of times)."""
    return _SHARDINGS[plan.zero, plan.runtime.shard_context]


def _sharding(zero: int, context: bool) -> StateSharding:
    def axes(zero_stage: int) -> tuple[Axis, ...]:
        chosen = {Axis.FSDP} | ({Axis.DATA} if zero >= zero_stage else set()) | ({Axis.CONTEXT} if context else set())
        return tuple(a for a in MESH_AXES if a in chosen)

    return StateSharding(params=axes(3), grads=axes(2), optimizer=axes(1))


_SHARDINGS = {(zero, context): _sharding(zero, context) for zero in range(4) for context in (False, True)}


def gradient_reduction(plan: Plan) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(axes reduced after every microbatch, axes reduced once per step) of the replica axes that split the batch.

    Gradients sharded over an axis (fsdp; data when zero >= 2) accumulate
    sharded, so every microbatch's are reduce-scattered over it as they
    come. Over the replica axes they are replicated on (data when zero < 2)
    each replica accumulates its own and the replicas are summed once per
    step. testbed.sim.graph.program builds these reductions; testbed.runner.replicas and the
    runner's shardings execute them.
    """
    sharded = state_sharding(plan).split_axes(plan, "grads")
    replicated = tuple(a.value for a in (Axis.DATA, Axis.FSDP) if plan.mesh.degree(a) > 1 and a.value not in sharded)
    return sharded, replicated


def reduction_axes(plan: Plan, expert: bool = False) -> tuple[Axis, ...]:
    """The mesh axes (degree > 1, MESH_AXES order) a parameter's gradients are summed over, by kind.

    A dense parameter is replicated over every axis that splits the batch or the sequence (data, fsdp,
    expert, context), so its gradient is summed over all of them. A routed expert's weight
    (``testbed.model.layout.ParamSpec.is_expert``) is split over ``expert``: each expert rank holds other
    experts, whose gradients already hold every token dispatched to them from the whole expert group, so
    it is summed over the other axes only. How each sum runs (reduce-scatter over the sharded axes, then
    all-reduce) is testbed.sim.graph.program's; the runner's shardings follow the same rule.
    """
    axes = (Axis.DATA, Axis.FSDP, Axis.CONTEXT) if expert else (Axis.DATA, Axis.FSDP, Axis.EXPERT, Axis.CONTEXT)
    return tuple(a for a in MESH_AXES if a in axes and plan.mesh.degree(a) > 1)


def expert_axes(plan: Plan) -> tuple[Axis, ...]:
    """The mesh axes (degree > 1, MESH_AXES order: ``expert`` major) the routed experts are split over in the MoE
    layers, the group their dispatch and combine all-to-alls run over: ``expert``, and ``tensor`` too when
    ``mesh.expert_tensor`` is 1 (Megatron-Core's MoE parallel folding: the tensor ranks of the dense layers are
    expert-parallel ranks in the MoE layers). Their product is ``mesh.expert_parallel``; an expert's index
    ``e`` sits on the rank whose position in that group is ``e // (experts / expert_parallel)``."""
    mesh = plan.mesh
    folded = mesh.expert_tensor_degree != mesh.tensor
    return tuple(a for a in (Axis.EXPERT, Axis.TENSOR) if mesh.degree(a) > 1 and (a is Axis.EXPERT or folded))


def loss_reductions(plan: Plan) -> tuple[tuple[tuple[Axis, ...], bool], ...]:
    """The all-reduces of the step's loss (one fp32 value each) over the axes that split the batch (those a dense
    gradient sums over, :func:`reduction_axes`), as ``(axes, per microbatch)``.

    The runner returns the step's mean loss, so its compiled step all-reduces it (check-sharding counts the 4
    bytes beside the gradients'). With one microbatch once over every such axis; with several, each microbatch's
    within its replica (every such axis but data: the microbatch loop runs per data replica) and the replicas'
    once over data. Empty when nothing splits the batch.
    """
    axes = reduction_axes(plan)
    if plan.batch.microbatches == 1:
        return ((axes, False),) if axes else ()
    inner = tuple(a for a in axes if a is not Axis.DATA)
    return (((inner, True),) if inner else ()) + (((Axis.DATA,), False),) * (Axis.DATA in axes)


def loss_merged(plan: Plan, reduce_bytes: float, scatter_allreduce: bool = False) -> bool:
    """Whether the step's loss all-reduce is merged into its gradients' all-reduce: XLA's all-reduce combiner merges
    only all-reduces of one key, whose element type is the reduction's (xla/service/all_reduce_key.cc,
    ``GetAllReduceKey``: the ``to_apply`` root's type), so the fp32 loss joins the gradient sums where those are
    fp32 too (``reduce_bytes`` 4: fp32 training, or ``runtime.grad_reduce_dtype: fp32``) and stays apart from bf16
    ones. Only in one SPMD step of one microbatch (the loss reduced once, over the axes the dense gradients sum
    over), with nothing sharding the gradients (their sums are all-reduces over those axes, after the backward)
    and the combiner on.
    ``scatter_allreduce``: the sharded gradients' reduce-scatter compiles to one all-reduce over the loss's axes
    (XLA:TPU over a whole slice: testbed.sim.xla.xla_tpu.merges_loss), which the loss joins as it joins unsharded sums.
    Recorded XLA:TPU compiles (benchmarks/xla_tpu/): gpt1k-data4-fp32 moves the gradients' bytes and the loss's 4
    in three all-reduces over data, gpt1k-data4 (bf16) the loss in an all-reduce of its own; llama2k-fsdp16-fp32-
    selective (fsdp over a whole v5e 4x4) the loss's 4 bytes in one of its six fp32 gradient all-reduces."""
    rt = plan.runtime
    return (reduce_bytes == LOSS_VALUE_BYTES and rt.allreduce_combiner and not rt.grad_reduce_overlap
            and plan.mesh.stage == 1
            and plan.batch.microbatches == 1 and bool(reduction_axes(plan))
            and (scatter_allreduce or not state_sharding(plan).split_axes(plan, "optimizer")))


def gathers_parameters(plan: Plan, kind: str) -> bool:
    """Whether a pipeline action of ``kind`` (F, B or W) all-gathers the sharded parameters it uses.

    Forward and backward gather block by block (:func:`gathered_blocks`): the backward gathers each block
    again rather than keeping the forward's gathered weights as residuals (PyTorch FSDP's
    ``reshard_after_forward``, ZeRO-3; testbed.runner.param_shards.ParamShards rematerialises the gather in
    the backward). W needs no weights. False when nothing shards the parameters.
    """
    if not state_sharding(plan).split_axes(plan, "params"):
        return False
    return kind in ("F", "B")


def gathered_blocks(plan: Plan) -> int:
    """How many blocks' gathered parameters are live at once under fsdp/ZeRO-3: the one computing and the
    ``runtime.fsdp_prefetch`` gathered ahead of it (testbed.plan.runtime), forward and backward; 0 when nothing
    shards the parameters. The one rule testbed.model.memory counts, testbed.sim.graph.program and
    testbed.explore.analytic time (block ``i``'s gather waits for block ``i - 1 - prefetch``) and the runner
    executes (each block in its own map, gathered again in the backward)."""
    if not state_sharding(plan).split_axes(plan, "params"):
        return 0
    return 1 + plan.runtime.fsdp_prefetch
