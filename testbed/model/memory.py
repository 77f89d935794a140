"""Per-device memory of a plan: parameters, gradients, optimizer, activations, workspace.

Model states follow the ZeRO paper (Rajbhandari et al., 2020), per parameter:

- fp32: parameters 4 B, gradients 4 B, Adam moments 2 x 4 B;
- bf16-mixed: bf16 parameters 2 B, bf16 gradients 2 B, fp32 master weights 4 B and fp32 moments 2 x 4 B (counted as
  optimizer state, so sharded like the moments): 16 B in all. The JAX runner holds exactly these
  (testbed.runner.precision: bf16 parameters and gradient accumulators, the master beside the moments in the
  optimizer state).

Sharding of model states, on top of the tensor split and the pipeline split (each device holds only its stage's
layers, see ``testbed.model.costs``): the fsdp axis shards parameters, gradients and optimizer state; ZeRO over the
data axis shards the optimizer state (stage 1), also the gradients (2), also the parameters (3). Each parameter is
sharded by ``testbed.model.layout``'s one rule, the runner's: along its largest free dim the shard count divides, or
flattened and padded (``ceil(elements / ways)`` per device, the padding counted), so any rank count shards (ZeRO's
and FSDP's flat buffers).

Activations: the bytes one microbatch-chunk keeps for its backward (``testbed.model.kept``:
``testbed.model.activations``' sets under the stack's mechanisms, ``plan.runtime``, plus the head's) times the
(microbatch, chunk) pairs a stage holds at peak, which the pipeline schedule decides (:func:`inflight_microbatches`).

Workspace: buffers live only inside one phase, never across microbatches — the loss backward (softmax of the logits
and their gradient, fp32), one layer's backward (the larger of its score-matrix and its MLP-hidden gradients, plus
what remat recomputes, plus the operands of the weight gradients an XLA step computes after the layers' backward:
``testbed.model.kept.deferred_backward_bytes``; not in a row over the device's capacity, which XLA schedules against
its limit), the out-of-place data-parallel gradient reduction, a microbatch's whole gradients before they join the
accumulator (one-program accumulation loops; pipelines only when they reduce-scatter), and with sharded parameters
(fsdp, ZeRO-3) the gathered weights: one block at a time plus the ``runtime.fsdp_prefetch`` blocks gathered ahead,
forward and backward (:func:`gathered_bytes`; the backward gathers again).

Context parallelism: activations and workspace are one context rank's (``seq_len / context`` tokens, as flash
attention keeps them: ``testbed.model.ring.rank_spec``), plus two ring messages in flight from the ring's second step
on, beside that step's tiles (``ring_attention_workspace``); model states are replicated over ``context`` unless
``runtime.shard_context`` shards them over it as over fsdp (testbed.plan.sharding).

``runtime.offload_activations``: the layers' kept sets live in host memory, two of them on the device in transit
(:func:`testbed.model.kept.device_layer_sets`). ``runtime.fp8_params`` under fp8-mixed: fp8 parameters and their
transposes (1 + 1 bytes) instead of bf16 parameters and per-step fp8 copies (2 + 2). ``runtime.state_dtype`` bf16
under mixed precision: no fp32 master and bf16 moments (2 + 2 + 2 x moments bytes a parameter);
``runtime.cast_weights`` (MaxText's fp32 ``weight_dtype``): the fp32 weights are the only copy, cast at each use (4 +
4 + 4 x moments held, :func:`held_state_bytes`).

Against the device's memory limit an XLA program is compiled to fit where it can (:func:`compiler_floors`, each only
when the program would not fit otherwise): the loss's fp32 buffers rematerialised (:func:`loss_floor_plan`), then no
block's gather started ahead of the peak (:func:`prefetch_floor_plan`).

The runtime fields of the XLA program decide the terms only XLA's buffer assignment keeps (``testbed.model.kept``:
tensor-parallel backward buffers, the residual summands under full remat) and ``runtime.grad_hooks`` how a
microbatch's gradients live: XLA's step writes them whole before it reduces them, PyTorch's hooks accumulate
replicated gradients in place and reduce-scatter sharded ones per block in the backward.

The breakdown is taken at each stage's peak instant: without gradient accumulation (one microbatch) activations are
freed layer by layer while gradients appear, so the two never peak together. Under XLA:TPU's rules such a step's
total adds twice its heap's fragmentation, as libtpu reports ``temp`` (testbed.model.step_heap).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from testbed.model import costs
from testbed.model import kept, layout, moe, step_heap, workspace, xla_tpu
from testbed.model.floors import compiler_floors, deepest_floor, loss_floor_plan, prefetch_floor_plan
from testbed.model.gathered import (_gathered_at, _layer_params_per_device, _stage_blocks, gathered_bytes,
                                    head_block_bytes)
from testbed.model.ring import rank_spec
from testbed.pipeline.schedules import build_schedule, held_by_gradient_chunks, peak_inflight
from testbed.plan.spec import Plan, Precision, Remat
from testbed.plan.sharding import gradient_reduction, state_sharding
from testbed.topology import Topology

__all__ = ["StageMemory", "MemoryBreakdown", "memory_breakdown", "inflight_microbatches", "state_bytes_per_param",
           "stage_memory", "probe_stages", "state_floor", "gathered_bytes", "loss_floor_plan",
           "prefetch_floor_plan", "held_state_bytes", "lazy_grad_instants"]


def state_bytes_per_param(plan: Plan) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per parameter before sharding."""
    moments = plan.optimizer.moments
    if plan.precision.mixed and plan.runtime.state_dtype == "bf16":  # bf16 weights updated in place, bf16 moments
        return 2, 2, 2 * moments
    if plan.precision.mixed:  # bf16-mixed and fp8-mixed (fp8 GEMM inputs are transient casts)
        return 2, 2, 4 + 4 * moments
    return 4, 4, 4 * moments


def held_state_bytes(plan: Plan) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per parameter a device holds before sharding:
    :func:`state_bytes_per_param`'s, or under ``runtime.cast_weights`` (MaxText's fp32 ``weight_dtype``) the fp32
    weights themselves with fp32 gradients (``jax.grad`` returns the parameters' dtype) and fp32 moments, no
    compute-dtype copy and no separate master: 4, 4 and 4 x moments. (:func:`state_bytes_per_param` stays the bytes
    the collectives and the update move, which the per-use casts leave unchanged: testbed.plan.runtime.)"""
    if plan.runtime.cast_weights and plan.precision.mixed and plan.runtime.state_dtype == "fp32":
        return 4, 4, 4 * plan.optimizer.moments
    return state_bytes_per_param(plan)


def inflight_microbatches(plan: Plan) -> tuple[int, ...]:
    """Per stage, the most (microbatch, chunk) activation sets held at once: from the schedule table of
    ``testbed.pipeline.schedules`` (the one the simulator and runner execute)."""
    schedule = build_schedule(plan.schedule.name, plan.mesh.stage, plan.batch.microbatches,
                              plan.schedule.virtual_stages)
    return tuple(int(n) for n in peak_inflight(schedule))


@dataclass(frozen=True, slots=True, kw_only=True)
class StageMemory:
    """Bytes on one device of a pipeline stage."""

    stage: int
    params_count: int
    params: int
    grads: int
    optimizer: int
    activations: int
    workspace: int
    inflight: int
    #: The workspace's named terms at the peak instant (:data:`WORKSPACE_PARTS`), summing to ``workspace``.
    workspace_parts: tuple[tuple[str, int], ...] = ()
    #: XLA:TPU's heap fragmentation (testbed.model.step_heap), in the total twice as libtpu reports it; 0 elsewhere.
    fragmentation: int = 0

    def __post_init__(self) -> None:
        if self.workspace_parts and sum(b for _, b in self.workspace_parts) != self.workspace:
            raise ValueError("workspace must be the sum of its parts")
        if self.fragmentation < 0:
            raise ValueError(f"fragmentation is >= 0 bytes, got {self.fragmentation}")

    @property
    def total(self) -> int:
        """The live peak plus twice the heap's fragmentation (the heap's gaps, reported again in ``temp``)."""
        return self.params + self.grads + self.optimizer + self.activations + self.workspace + 2 * self.fragmentation


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """Per-device memory of a plan on its worst (fullest) device, with per-stage detail."""

    params_count: int
    device_params_count: int
    params: int
    grads: int
    optimizer: int
    activations: int
    workspace: int
    total: int
    capacity: int
    fits: bool
    worst_stage: int
    per_stage: tuple[StageMemory, ...]
    #: The worst stage's workspace terms (:attr:`StageMemory.workspace_parts`).
    workspace_parts: tuple[tuple[str, int], ...] = ()
    #: Whether the worst stage's row is the loss floor (:func:`loss_floor_plan`): the plan's XLA program would
    #: not fit with the loss's fp32 buffers, so the compiler rematerialises them.
    rematerialised_loss: bool = False
    #: Whether the worst stage's row has no prefetched gathers (:func:`prefetch_floor_plan`): with them the
    #: plan's XLA program would not fit, so the scheduler starts no block's gather ahead at its peak.
    delayed_gathers: bool = False
    #: The worst stage's XLA:TPU heap fragmentation (:attr:`StageMemory.fragmentation`), twice in ``total``.
    fragmentation: int = 0

    def __post_init__(self) -> None:
        if self.total != self.live_peak + 2 * self.fragmentation or self.fragmentation < 0:
            raise ValueError("total must be the sum of its parts and twice the fragmentation (>= 0)")

    @property
    def live_peak(self) -> int:
        """The most bytes live at once: the parts' sum, the total without the heap's fragmentation."""
        return self.params + self.grads + self.optimizer + self.activations + self.workspace

    def as_dict(self) -> dict:
        """JSON-ready: the contract keys first, then per-stage rows."""
        keys = ("params_count", "device_params_count", "params", "grads", "optimizer", "activations", "workspace",
                "total", "capacity", "fits", "worst_stage")
        out = {k: getattr(self, k) for k in keys}
        for flag in ("rematerialised_loss", "delayed_gathers", "fragmentation"):
            if getattr(self, flag):
                out[flag] = getattr(self, flag) if flag == "fragmentation" else True
        out["workspace_parts"] = dict(self.workspace_parts)
        out["per_stage"] = [{"stage": s.stage, "params_count": s.params_count, "params": s.params, "grads": s.grads,
                             "optimizer": s.optimizer, "activations": s.activations, "workspace": s.workspace,
                             "total": s.total, "inflight": s.inflight} for s in self.per_stage]
        return out


#: The workspace's terms (the module docstring's "Workspace"), by the names tables show them under.
LOSS_BACKWARD, LAYER_BACKWARD = "loss backward", "layer backward"
GATHERED, MICROBATCH_GRADS, REDUCTION, DEFERRED = ("gathered weights", "microbatch gradients", "gradient reduction",
                                                  "deferred weight-gradient operands")
WORKSPACE_PARTS = (LOSS_BACKWARD, LAYER_BACKWARD, GATHERED, MICROBATCH_GRADS, REDUCTION, DEFERRED)


def _work(*terms: tuple[str, int]) -> tuple[tuple[str, int], ...]:
    """The workspace terms live at one instant, the empty ones left out."""
    return tuple((name, int(size)) for name, size in terms if size)


def _larger(*terms: tuple[str, int]) -> tuple[str, int]:
    """Of terms that are never live together (one phase's buffers, then the next's), the larger."""
    return max(terms, key=lambda t: t[1])


def _floored_peak(plan: Plan, stage: int, inflight: int, capacity: int | None, names: bool = True,
                  rules: str = "xla") -> tuple[StageMemory, tuple[str, ...]]:
    """:func:`_stage_peak`, or with a device ``capacity`` it overflows, the first row at the compiler's floors
    that fits (else the smallest), with the names of the floors taken: a compiler acts against the limit only as
    far as the program needs. First each weight gradient at its layer's backward (:func:`_undeferred_row`: the
    scheduler with the limit in mind), then on top of it :func:`compiler_floors`' rows in order. ``names`` False
    (the search's bound, which reads the total only): the same total with the deepest floor tried first
    (:func:`~testbed.model.floors.deepest_floor`: each floor only lowers the row, so a plan over the capacity
    there is over it at every floor, and the walk runs only for the plans that fit at the deepest)."""
    row = _stage_peak(plan, stage, inflight, rules=rules)
    if capacity is None or row.total <= capacity:
        return row, ()
    if plan.batch.microbatches == 1:  # (_stage_peak reads ``defer`` for one microbatch only: else the same row)
        row = min(row, _undeferred_row(plan, stage, inflight, rules), key=lambda r: r.total)
    if row.total <= capacity:
        return row, ()
    if not names:
        floor = deepest_floor(plan)
        if floor is None:
            return row, ()
        deepest = _undeferred_row(floor, stage, inflight, rules)
        if deepest.total > capacity:
            return min(row, deepest, key=lambda r: r.total), ()
    taken: tuple[str, ...] = ()
    for name, floor in compiler_floors(plan):
        lower = _undeferred_row(floor, stage, inflight, rules)
        if lower.total < row.total:
            row, taken = lower, (*taken, name)
        if row.total <= capacity:
            break
    return row, taken


def _stage_memory(plan: Plan, stage: int, inflight: int, capacity: int | None = None,
                  rules: str = "xla") -> StageMemory:
    """:func:`_stage_peak`, or with a device ``capacity`` it overflows, the row at the compiler's floors
    (:func:`_floored_peak`: each weight gradient at its layer, the loss floor, then no prefetched gathers)."""
    return _floored_peak(plan, stage, inflight, capacity, names=False, rules=rules)[0]


def _undeferred_row(plan: Plan, stage: int, inflight: int, rules: str = "xla") -> StageMemory:
    """The stage's peak with each weight gradient computed at its layer's backward (no deferred operands,
    ``testbed.model.kept.deferred_backward_bytes``). Deferring them is XLA:CPU's list scheduler's choice for a
    program without a memory limit (``benchmarks/memory_vs_xla.py``), not a dependency: a program compiled
    against a device it would overflow is scheduled with the limit in mind, as the loss floor's
    rematerialisation is, so a row over capacity is priced without it."""
    return _stage_peak(plan, stage, inflight, defer=False, rules=rules)


@dataclass(frozen=True, slots=True, kw_only=True)
class _KeptTerms:
    """What one microbatch keeps and the transients beside it, by the compiler's rules: per layer (the stage's mean,
    MoE layers included), the head's kept set, the loss's and one layer backward's workspace."""

    tpu: bool
    per_layer: int
    head: int
    loss: int
    layer: int


def _kept_terms(plan: Plan, stage: int, tpu: bool) -> _KeptTerms:
    """The stage's kept sets and transients: XLA:TPU's (testbed.model.xla_tpu) where ``tpu``, else
    testbed.model.kept's (XLA:CPU's, or the stack's mechanisms)."""
    spec, p, v = rank_spec(plan), plan.mesh.stage, plan.schedule.virtual_stages
    per_layer = xla_tpu.layer_kept_bytes(plan) if tpu else kept.layer_kept_bytes(plan)
    if spec.experts and plan.remat is not Remat.FULL:  # MoE layers keep router, dispatched tokens, experts' hidden
        span = [i for r in layout.chunk_layers(spec, p, v, plan.stage_layers)[stage] for i in r]
        per_layer += moe.moe_layers(spec, span) * moe.activation_bytes_swap(plan, plan.mesh.tensor, tpu) // max(
            1, len(span))
    if tpu:
        head, loss = xla_tpu.head_kept_bytes(plan), xla_tpu.loss_workspace_bytes(plan)
    else:
        head = kept.head_kept_bytes(plan)
        loss = kept.loss_workspace_bytes(plan) + kept.loss_instant_recompute(plan)
    return _KeptTerms(tpu=tpu, per_layer=per_layer, head=head, loss=loss, layer=workspace.layer_workspace(plan, tpu))


def _stage_peak(plan: Plan, stage: int, inflight: int, defer: bool = True, rules: str = "xla") -> StageMemory:
    """Bytes on one device of ``stage`` at its peak instant.

    With one microbatch the step does not accumulate gradients: the backward frees each layer's activations as it
    writes that layer's gradients, so the peak is the largest of the instants (end of forward, loss backward, each
    layer's backward, after the backward). With several microbatches the gradient buffer lives through the whole
    step, next to the in-flight activations.
    """
    mesh = plan.mesh
    p, v = mesh.stage, plan.schedule.virtual_stages
    param_b, grad_b, opt_b = held_state_bytes(plan)
    sharding = state_sharding(plan)
    param_ways, grad_ways, opt_ways = (sharding.ways(plan, w) for w in ("params", "grads", "optimizer"))
    held = costs.device_stage_params(plan, stage)
    param_held, grad_held, opt_held = (costs.device_stage_params(plan, stage, w)
                                       for w in (param_ways, grad_ways, opt_ways))
    holds_head = stage == layout.head_holder(p, v)[0]
    layers = plan.stage_layers[stage]  # all the stage's chunks (layers_per_stage, or the even split)
    terms = _kept_terms(plan, stage, xla_tpu.applies(plan, rules))
    per_layer = terms.per_layer
    # The head chunk's share of the stage's in-flight (microbatch, chunk) pairs.
    head_acts = math.ceil(inflight / v) * terms.head if holds_head else 0
    # In-flight pairs spread over the stage's chunks (as the head term assumes): the mean chunk's layers each,
    # exactly layers / v per pair when the chunks are even; uneven chunks (testbed.plan.stages) average.
    layer_acts = kept.device_layer_sets(plan, inflight * layers // v) * per_layer
    grads = grad_b * grad_held
    if plan.runtime.grad_accumulate_fp32 and plan.precision.mixed:  # the fp32 accumulator beside the bf16 grads
        grads += 4 * grad_held
    # Sharded parameters are gathered block by block, forward and backward (the backward gathers each block
    # again): the block computing and the prefetched ones are live (testbed.plan.sharding.gathered_blocks).
    gathered = gathered_bytes(plan, stage, terms.tpu)
    # Data-parallel gradient reduction is out of place: an all-reduce writes a second gradient
    # buffer; a reduce-scatter (ZeRO >= 1) writes only the shard.
    reduce_ws = 0
    if (mesh.data > 1 or mesh.expert > 1) and mesh.fsdp == 1:  # dense gradients are all-reduced over expert too
        reduce_ws = grad_b * costs.device_stage_params(plan, stage, mesh.data if plan.zero >= 1 else 1)
    loss, layer = (LOSS_BACKWARD, terms.loss if holds_head else 0), (LAYER_BACKWARD, terms.layer)
    live = _Live(layer_acts + head_acts, per_layer, grads, gathered, loss, layer, reduce_ws)
    if plan.batch.microbatches > 1:
        instants = _accumulating_instants(plan, stage, live, _microbatch_grads(plan, stage, held, gathered))
        frag = 0
    else:
        instants, frag = _one_microbatch_instants(plan, stage, live, defer, terms.tpu)
    acts, live_grads, work = max(instants, key=lambda i: i[0] + i[1] + sum(b for _, b in i[2]))
    params = _param_bytes(plan, param_b, param_held, held, param_ways)
    return StageMemory(stage=stage, params_count=param_held, params=params, grads=live_grads,
                       optimizer=opt_b * opt_held, activations=acts, workspace=sum(b for _, b in work),
                       inflight=inflight, workspace_parts=work, fragmentation=frag)


@dataclass(frozen=True, slots=True)
class _Live:
    """What a stage holds at its forward's end, for its peak instants: activations (all layers' and the head's),
    one layer's kept bytes, the stage's gradients, its gathered blocks, the loss and layer backward workspaces
    and the data reduction's."""

    acts: int
    per_layer: int
    grads: int
    gathered: int
    loss: tuple[str, int]
    layer: tuple[str, int]
    reduce_ws: int


def _one_microbatch_instants(plan: Plan, stage: int, live: _Live, defer: bool, tpu: bool) -> tuple[list[tuple], int]:
    """The peak candidates of a step that accumulates nothing: the loss backward, each layer's backward (its
    activations freed as it writes its gradients), after the backward; ``(activations, gradients, workspace)``;
    and under XLA:TPU's rules on one stage the heap's fragmentation (testbed.model.step_heap), else 0."""
    layers, holds_head = plan.stage_layers[stage], stage == layout.head_holder(plan.mesh.stage,
                                                                              plan.schedule.virtual_stages)[0]
    grad_ways = state_sharding(plan).ways(plan, "grads")
    layer_grads = held_state_bytes(plan)[1] * _layer_params_per_device(plan, grad_ways)
    head_grads = max(live.grads - layers * layer_grads, 0) if holds_head else 0
    # XLA's deferred weight gradients: their operands live through the layers' backward, no weight gradient yet.
    # XLA:TPU defers them too, the head's as well: its buffer assignment has no weight gradient before the
    # combined all-reduces that follow the backward (gpt1k-data4 and -fp32 of benchmarks/xla_tpu/, live ranges).
    deferred = kept.deferred_backward_bytes(plan, holds_head) if defer and not tpu else 0
    later = defer and kept.weight_grads_deferred(plan)
    fused = tpu and xla_tpu.updates_in_epilogue(plan)  # no weight gradient live at any instant
    later = later or fused
    at_loss = head_block_bytes(plan, stage) if tpu and plan.schedule.virtual_stages == 1 else live.gathered
    instants = [(live.acts, 0 if later and tpu else head_grads, _work(live.loss, (GATHERED, at_loss)))]
    gathered_at = _gathered_at(plan, stage, live.gathered, tpu)
    for done in range(layers):
        instants.append((kept.device_layer_sets(plan, layers - done) * live.per_layer,
                         0 if later else head_grads + (done + 1) * layer_grads,
                         _work(live.layer, (DEFERRED, deferred), (GATHERED, gathered_at(done + holds_head)))))
    instants.append((0, 0 if fused else live.grads, _work((REDUCTION, live.reduce_ws))))
    if not tpu or plan.mesh.stage > 1:
        return instants, 0
    return instants, step_heap.fragmentation(plan, step_heap.StepTerms(
        per_layer=live.per_layer, head=xla_tpu.head_kept_buffers(plan), loss=live.loss[1], layer=live.layer[1],
        layer_grads=0 if fused else layer_grads, head_grads=0 if fused else head_grads, late_grads=later,
        reduction=live.reduce_ws))


def _microbatch_grads(plan: Plan, stage: int, held: int, gathered: int) -> int:
    """Bytes of one microbatch's gradients before they join the accumulator: the whole stage's, or with sharded
    parameters one block's at a time (each block's gradients are reduce-scattered in its backward,
    testbed.runner.param_shards.ParamShards)."""
    grad_b = held_state_bytes(plan)[1]
    unsharded = grad_b * (_stage_blocks(plan, stage)[0] if gathered else held)
    if plan.runtime.grad_hooks:
        # PyTorch: autograd accumulates replicated gradients into .grad in place; sharded ones (FSDP, ZeRO-2/3)
        # are reduce-scattered block by block in the backward (post-backward hooks), one block's unsharded.
        unsharded = grad_b * _stage_blocks(plan, stage)[0] if state_sharding(plan).ways(plan, "grads") > 1 else 0
    return unsharded


def _accumulating_instants(plan: Plan, stage: int, live: _Live, unsharded: int) -> list[tuple]:
    """The peak candidates of a step that accumulates microbatches' gradients; ``(activations, gradients,
    workspace)``.

    A microbatch's gradients (``unsharded``) are written whole before they join the accumulator. The one-program
    step's accumulation loop adds them after the microbatch's backward, and reduces over data after the loop
    (when activations are gone). The pipeline engine's backward adds replicated gradients into its donated
    accumulator in place, but reduce-scatters sharded ones (fsdp, ZeRO-2/3) after the backward; XLA combines
    the layers' reduce-scatters, so all are live at once. (Measured with XLA:CPU.)
    """
    if plan.mesh.stage == 1:
        return [(live.acts, live.grads, _work(_larger(live.loss, live.layer), (GATHERED, live.gathered),
                                              (MICROBATCH_GRADS, unsharded))),
                (0, live.grads, _work((REDUCTION, live.reduce_ws)))]
    # The axes reduced after every microbatch (testbed.plan.sharding's one rule, as program and runner).
    whole = unsharded if gradient_reduction(plan)[0] else 0
    instants = [(live.acts, live.grads, _work(_larger(live.loss, live.layer, (REDUCTION, live.reduce_ws)),
                                              (GATHERED, live.gathered), (MICROBATCH_GRADS, whole)))]
    if plan.runtime.lazy_grads:  # gradients grow chunk by chunk with the stage's backwards
        ws, pairs = instants[0][2], lazy_grad_instants(plan, stage)
        peak = max(held for held, _ in pairs) or 1
        v = plan.schedule.virtual_stages
        instants = [(live.acts * held // peak, live.grads * chunks // v, ws) for held, chunks in pairs]
    return instants


def _param_bytes(plan: Plan, param_b: int, param_held: int, held: int, param_ways: int) -> int:
    """Bytes of the stage's parameters on one device. fp8-mixed (Transformer Engine): from the step's first
    microbatch on, each weight is also kept cast to fp8 with its transpose for the backward (1 byte each);
    sharded weights only for the gathered layer. The amax histories (a few KB per layer) are left out."""
    if plan.precision is Precision.FP8_MIXED and plan.runtime.fp8_params:
        # fp8 parameters (1 byte) and their fp8 transposes (1 byte); a sharded parameter's shard is fp8 data only,
        # its gathered block (gathered_bytes, 2 bytes a value) holds both.
        return param_held * (2 if param_ways == 1 else 1)
    params = param_b * param_held
    if plan.precision is Precision.FP8_MIXED:
        params += 2 * (held if param_ways == 1 else _layer_params_per_device(plan))
    return params


def lazy_grad_instants(plan: Plan, stage: int) -> tuple[tuple[int, int], ...]:
    """Under ``runtime.lazy_grads`` (gradients allocated by each parameter's first backward of the step, PyTorch's
    ``.grad``): a pipeline stage's candidate peak instants as (activation sets held, chunks with gradients), from
    the schedule table (testbed.pipeline.schedules.held_by_gradient_chunks). The memory model weighs the held
    sets at the stage's mean set and the chunks at ``1 / virtual_stages`` of its gradients each: when every
    forward runs before the first backward (interleaved, ``microbatches <= stages``, the first half of the stages)
    the activation peak has only the first backward's chunk of gradients beside it, and the gradients peak when
    the activations are gone."""
    rows = _gradient_chunk_rows(plan.schedule.name, plan.mesh.stage, plan.batch.microbatches,
                                plan.schedule.virtual_stages)
    return tuple((held, chunks) for chunks, held in enumerate(rows[stage]))


@functools.lru_cache(maxsize=1024)
def _gradient_chunk_rows(name, stages: int, microbatches: int, virtual: int) -> tuple[tuple[int, ...], ...]:
    """testbed.pipeline.schedules.held_by_gradient_chunks of the schedule table, memoized on what builds it (a
    search asks it of every stage of every plan)."""
    return held_by_gradient_chunks(build_schedule(name, stages, microbatches, virtual))


def memory_breakdown(plan: Plan, topology: Topology, inflight: tuple[int, ...] | None = None) -> MemoryBreakdown:
    """Per-device bytes of ``plan`` (worst stage, at its peak instant), capacity from ``topology.device``.

    ``inflight``: the schedule's per-stage peak of activation sets, when the caller has it already (the plan search
    meets each table thousands of times); by default :func:`inflight_microbatches` builds the table.
    """
    inflight = inflight_microbatches(plan) if inflight is None else inflight
    capacity = int(topology.device.memory_bytes)
    rules = topology.device.buffer_rules
    floored = [_floored_peak(plan, s, inflight[s], capacity, rules=rules) for s in range(plan.mesh.stage)]
    stages = [row for row, _ in floored]
    worst, taken = max(floored, key=lambda f: f[0].total)
    return MemoryBreakdown(
        params_count=costs.param_count(plan.model), device_params_count=worst.params_count, params=worst.params,
        grads=worst.grads, optimizer=worst.optimizer, activations=worst.activations, workspace=worst.workspace,
        total=worst.total, capacity=capacity, fits=worst.total <= capacity, worst_stage=worst.stage,
        per_stage=tuple(stages), workspace_parts=worst.workspace_parts,
        rematerialised_loss="rematerialised_loss" in taken, delayed_gathers="delayed_gathers" in taken,
        fragmentation=worst.fragmentation)


def stage_memory(plan: Plan, stage: int, inflight: int, capacity: int | None = None,
                 rules: str = "xla") -> StageMemory:
    """Bytes on one device of ``stage`` at its peak instant with ``inflight`` activation sets (the schedule's).

    With the device's ``capacity`` (bytes), exactly the row :func:`memory_breakdown` reports for that stage, so
    each is a lower bound of the plan's worst-device total: a search drops a plan as soon as one stage
    overflows, without the other stages. ``rules``: the device's ``buffer_rules`` (testbed.topology.DeviceSpec).
    """
    return _stage_memory(plan, stage, inflight, capacity, rules)


def probe_stages(plan: Plan) -> tuple[int, ...]:
    """The stages most likely to be the fullest, to try first: the first middle stage (most layers under an
    uneven split, most in flight of those), the first (embedding, most in flight) and the last (head, loss)."""
    p = plan.mesh.stage
    return tuple(dict.fromkeys(s for s in (1, 0, p - 1) if s < p))


def state_floor(plan: Plan) -> int:
    """A lower bound of the plan's worst-device bytes from its model states alone: the most parameter and
    optimizer bytes one device of a :func:`probe_stages` stage holds (schedule, microbatches and remat aside,
    which change only activations, workspace and live gradients)."""
    param_b, _, opt_b = held_state_bytes(plan)
    sharding = state_sharding(plan)
    param_ways, opt_ways = sharding.ways(plan, "params"), sharding.ways(plan, "optimizer")
    return max(param_b * costs.device_stage_params(plan, s, param_ways)
               + opt_b * costs.device_stage_params(plan, s, opt_ways) for s in probe_stages(plan))
