"""A step's optimizer update and gradient reductions, per stage: the facts testbed.sim.step.facts.step_facts works out
for the update's FLOPs and HBM bytes (and ZeRO-1/2's re-gather of the updated shards) and for how each kind of
parameter's gradients is summed over the mesh (a reduce-scatter over the axes the optimizer state is split on,
an all-reduce over the rest; sequence parallelism's tensor-replicated parameters apart). Read by both tiers
through :class:`testbed.sim.step.facts.StepFacts`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from testbed.model import costs, layout, xla_tpu
from testbed.model.param_spec import Part
from testbed.model.leaves import moved_elements, parameter_collectives
from testbed.model.memory import state_bytes_per_param
from testbed.plan.sharding import reduction_axes, state_sharding
from testbed.model.gemm import trailing_bytes
from testbed.sim.price.compute import compute_seconds
from testbed.plan.spec import MESH_AXES, Axis, Plan
from testbed.sim.step.grad_bytes import sequence_apart, sequence_replicated, summed_each_microbatch

__all__ = ["OPTIMIZER_FLOPS_PER_PARAM", "StageUpdate", "Reduction", "stage_update", "fused_update", "update_seconds",
           "update_bytes", "parameter_reductions"]

#: Adam(W) update FLOPs per parameter (moments, bias correction, sqrt, divide, decay).
OPTIMIZER_FLOPS_PER_PARAM = 12


@dataclass(frozen=True, slots=True, kw_only=True)
class StageUpdate:
    """One stage's optimizer update: its FLOPs and HBM bytes on one device, and with ZeRO-1/2 the re-gather of
    the updated shards over data (``regathers`` collectives of ``regather_bytes`` each; 0: none)."""

    flops: float
    hbm_bytes: float
    regathers: int
    regather_bytes: float
    #: Where the compiler runs each weight matrix's update in its gradient matmul's epilogue (:func:`fused_update`):
    #: those matmuls' FLOPs on the device, and the part of ``hbm_bytes`` past the kernels' streams
    #: (testbed.model.gemm.trailing_bytes; the gradient's read and the two passes its size that ride the
    #: kernel's streams are not in ``hbm_bytes``), priced by testbed.sim.price.compute.fused_kernel_seconds (0: none).
    fused_flops: float = 0.0
    fused_bytes: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Reduction:
    """How one kind of parameter's gradients are summed (testbed.plan.sharding.reduction_axes): a reduce-scatter
    over ``sharded`` (the axes the optimizer state is split on), then an all-reduce of the ``ways``-th shard over
    ``rest``. ``expert``: the routed experts' weights (summed over every batch axis but expert); ``sequence``:
    under sequence parallelism the parameters replicated over tensor (summed over tensor too:
    :func:`sequence_reduced`)."""

    expert: bool
    sharded: tuple[Axis, ...]
    rest: tuple[Axis, ...]
    ways: int
    sequence: bool = False
    #: Whether the sequence-replicated parameters' bytes stay in this (dense) reduction although a ``sequence``
    #: one sums them over tensor too (:func:`sequence_apart`); False: that reduction takes them out of this one.
    holds_sequence: bool = False
    #: The collective the ``sharded`` sum compiles to: ``reduce_scatter``, or ``all_reduce`` where the compiler
    #: lowers a reduce-scatter over the whole slice as an all-reduce of the whole gradient (testbed.sim.xla.xla_tpu:
    #: the same bytes, merged by the all-reduce combiner).
    scatter_op: str = "reduce_scatter"
    #: Whether the all-reduces of the shards over ``rest`` leave the buckets for the stage's merged ones, issued after
    #: its last reduce-scatter (testbed.sim.xla.xla_tpu.merges_shard_sums; StepFacts.shard_sums).
    rest_merged: bool = False

    def size(self, nbytes: float, special: tuple[float, float]) -> float:
        """Bytes this reduction sums of a bucket of ``nbytes`` (``special``: ChunkFacts.special's shares)."""
        if self.expert or self.sequence:
            return special[0] if self.expert else special[1]
        return nbytes - special[0] - (0.0 if self.holds_sequence else special[1])


def stage_update(plan: Plan, s: int, stage_costs, o_ways: int, p_ways: int, combine: float, param_b: float,
            grad_b: float, fused_updates: bool = False) -> StageUpdate:
    """Stage ``s``'s :class:`StageUpdate`: the optimizer over its shard (by the layout's one rule), and with
    ZeRO-1/2 the updated shards gathered over data, as many collectives as the rule counts (per leaf).
    ``fused_updates``: the compiler fuses updates into the weight-gradient matmuls (:func:`fused_update`)."""
    shard = costs.device_stage_params(plan, s, o_ways)
    regathers, regather_bytes = 0, 0.0
    if o_ways > p_ways and plan.mesh.data > 1:
        regathers = max(1, parameter_collectives(plan, s, None, combine, param_b, which="optimizer"))
        regather_bytes = moved_elements(plan, s, None, "optimizer") / plan.mesh.fsdp * param_b / regathers
    per_param = update_bytes(plan, param_b, grad_b)
    matrices = fused_update(plan, s, routed=False) if fused_updates else 0  # routed experts' updates add whole
    trailing = trailing_bytes(per_param - grad_b, grad_b)  # its gradient read on chip, two passes its size ride
    return StageUpdate(flops=OPTIMIZER_FLOPS_PER_PARAM * shard,
                       hbm_bytes=shard * per_param - matrices * (per_param - trailing),
                       regathers=regathers, regather_bytes=regather_bytes,
                       fused_flops=2.0 * plan.batch.global_batch * plan.model.seq_len * matrices,
                       fused_bytes=matrices * trailing)


def fused_update(plan: Plan, s: int, routed: bool = True) -> int:
    """Weight-matrix elements of stage ``s`` on one device whose optimizer update XLA:TPU runs in the epilogue
    of their weight-gradient matmul (0: none). Seen in the chip's per-op profiles (benchmarks/tpu_chip/
    profiles.json): with one microbatch and no gradient sum over devices, each matrix's update is one output
    fusion with its gradient's convolution, which takes the two one after the other (:func:`update_seconds`); the
    token table (its gradient a scatter), the norms and an accumulated (the loop's sum) or reduced gradient are
    updated apart. ``routed`` False leaves the routed experts' stacked matrices out: their kernels (batched over the
    experts) fuse the update too, but take its whole pass after their matmul (none of it hides: benchmarks/
    tpu_moe_ops.py, against testbed.sim.price.compute.EPILOGUE_HIDDEN of it, over the chip's MoE profiles), so only the
    others' updates hide under their matmuls (:func:`stage_update`)."""
    if not xla_tpu.updates_in_epilogue(plan):
        return 0
    held = layout.chunk_params(plan.model, s, 0, 1)
    return sum(copies * p.device_elements(plan.mesh.tensor) for p, copies in held
               if p.part is not Part.EMBEDDING and len(p.shape) >= 2 and (routed or not p.is_expert))


def update_seconds(topology, dtype: str, update: StageUpdate) -> float:
    """Seconds of a stage's optimizer update past its gradients' matmuls: its roofline, less the part that hides
    under the weight-gradient matmuls it is fused into (:func:`fused_update`; testbed.sim.price.compute.
    fused_kernel_seconds, the rule a traced program's fused kernels are priced by too): the chip's fused kernels take
    their matmul's time plus most of the update's pass, not the longer of the two (benchmarks/tpu_chip/
    profiles.json). Both tiers price the update here."""
    return compute_seconds(topology, dtype, update.flops, update.hbm_bytes, 1,
                           epilogue=(update.fused_flops, update.fused_bytes))


def update_bytes(plan: Plan, param_b: float, grad_b: float) -> float:
    """HBM bytes the optimizer update moves per parameter of its shard: the gradient read, the optimizer state
    (:func:`state_bytes_per_param`'s: an fp32 master and the moments, or bf16 moments only) read and written, and
    the parameters written; read too where no master copy holds them (fp32 training, ``runtime.state_dtype``
    bf16's weights updated in place)."""
    _, _, state_b = state_bytes_per_param(plan)
    has_master = plan.precision.mixed and plan.runtime.state_dtype == "fp32"
    return grad_b + param_b * (1 if has_master else 2) + 2 * state_b


def parameter_reductions(plan: Plan, optimizer_axes: tuple[Axis, ...]) -> tuple[Reduction, ...]:
    """Per parameter kind (dense, then routed experts'), how its gradients are summed (kinds nothing sums left
    out): over the axes the optimizer state is split on a reduce-scatter, over the rest an all-reduce
    (``runtime.grad_all_reduce``: unsharded gradients all-reduced over data too)."""
    out = []
    if plan.runtime.grad_all_reduce and not state_sharding(plan).split_axes(plan, "grads"):
        optimizer_axes = tuple(a for a in optimizer_axes if a is not Axis.DATA)  # all-reduced whole over data
    for expert in (False, True):
        axes = reduction_axes(plan, expert)
        if axes:
            sharded = tuple(a for a in axes if a in optimizer_axes)
            out.append(Reduction(expert=expert, sharded=sharded, rest=tuple(a for a in axes if a not in optimizer_axes),
                                 ways=math.prod(plan.mesh.degree(a) for a in sharded),
                                 holds_sequence=not expert and sequence_apart(plan)))
    if sequence_replicated(plan):  # nothing shards the optimizer state here: one all-reduce
        axes = (Axis.TENSOR,) if summed_each_microbatch(plan) else (*reduction_axes(plan), Axis.TENSOR)
        out.append(Reduction(expert=False, sequence=True, sharded=(), ways=1,
                             rest=tuple(a for a in MESH_AXES if a in axes)))
    elif sequence_apart(plan):  # summed whole over tensor first, then reduce-scattered with the rest
        out.append(Reduction(expert=False, sequence=True, sharded=(), ways=1, rest=(Axis.TENSOR,)))
    return tuple(out)
