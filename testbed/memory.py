"""Per-device memory of a plan: parameters, gradients, optimizer, activations, workspace.

Model states follow the ZeRO paper (Rajbhandari et al., 2020), per parameter:

- fp32: parameters 4 B, gradients 4 B, Adam moments 2 x 4 B;
- bf16-mixed: bf16 parameters 2 B, bf16 gradients 2 B, fp32 master weights
  4 B and fp32 moments 2 x 4 B (counted as optimizer state): 16 B in all.
  (The JAX runner keeps fp32 parameters as the master and makes the bf16
  copy per step; the total is the same.)

Sharding of model states, on top of the tensor split and the pipeline split
(each device holds only its stage's layers, see ``testbed.model``): the fsdp
axis shards parameters, gradients and optimizer state; ZeRO over the data
axis shards the optimizer state (stage 1), also the gradients (2), also the
parameters (3).

Activations: the bytes one microbatch-chunk keeps for its backward
(``testbed.model.activation_bytes_per_layer``, plus the head's) times the
(microbatch, chunk) pairs a stage holds at peak, which the pipeline schedule
decides (:func:`inflight_microbatches`).

Workspace: buffers live only inside one phase, never across microbatches —
the largest of (a) the loss phase: the fp32 gradient of the logits,
(b) one layer's backward: the gradient of the score matrix and of the MLP
hidden, plus what remat recomputes for that layer, (c) with sharded
parameters, one layer's gathered parameters (double-buffered).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from testbed import model
from testbed.plan import Plan, Precision, Remat, ScheduleName
from testbed.topology import Topology

__all__ = ["StageMemory", "MemoryBreakdown", "memory_breakdown", "inflight_microbatches", "state_bytes_per_param"]


def state_bytes_per_param(plan: Plan) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per parameter before sharding."""
    moments = plan.optimizer.moments
    if plan.precision is Precision.BF16_MIXED:
        return 2, 2, 4 + 4 * moments
    return 4, 4, 4 * moments


def _interim_inflight(plan: Plan) -> tuple[int, ...]:
    """Peak (microbatch, chunk) pairs per stage when ``testbed.schedules`` is unavailable.

    GPipe: all ``m``; 1F1B and ZB-H1: ``min(m, p - s)``; ZB-H2:
    ``min(m, 2(p - s) - 1)``; interleaved (Megatron): warm-up
    ``2(p - s - 1) + (v - 1) p`` plus one, capped at ``m v``.
    """
    p, m, v = plan.mesh.stage, plan.batch.microbatches, plan.schedule.virtual_stages
    name = plan.schedule.name
    if name is ScheduleName.GPIPE:
        return tuple(m for _ in range(p))
    if name is ScheduleName.INTERLEAVED:
        return tuple(min(m * v, 2 * (p - s - 1) + (v - 1) * p + 1) for s in range(p))
    if name is ScheduleName.ZB_H2:
        return tuple(min(m, 2 * (p - s) - 1) for s in range(p))
    return tuple(min(m, p - s) for s in range(p))


def inflight_microbatches(plan: Plan) -> tuple[int, ...]:
    """Per stage, the most (microbatch, chunk) activation sets held at once.

    Taken from the schedule table of ``testbed.schedules`` (the one the
    simulator and runner execute); the documented interim rule otherwise.
    """
    try:
        from testbed.schedules import build_schedule, peak_inflight
    except ImportError:
        return _interim_inflight(plan)
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

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.workspace


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

    def __post_init__(self) -> None:
        if self.total != self.params + self.grads + self.optimizer + self.activations + self.workspace:
            raise ValueError("total must be the sum of its parts")

    def as_dict(self) -> dict:
        """JSON-ready: the contract keys first, then per-stage rows."""
        keys = ("params_count", "device_params_count", "params", "grads", "optimizer", "activations", "workspace",
                "total", "capacity", "fits", "worst_stage")
        out = {k: getattr(self, k) for k in keys}
        out["per_stage"] = [{"stage": s.stage, "params_count": s.params_count, "params": s.params, "grads": s.grads,
                             "optimizer": s.optimizer, "activations": s.activations, "workspace": s.workspace,
                             "total": s.total, "inflight": s.inflight} for s in self.per_stage]
        return out


def _shard(count: int, ways: int) -> int:
    return math.ceil(count / ways)


def _layer_param_bytes(plan: Plan) -> int:
    """One layer's parameters on one tensor rank in compute precision (what a gather materialises)."""
    spec, t = plan.model, plan.mesh.tensor
    d, f = spec.d_model, spec.d_ff
    return plan.precision.compute_bytes * ((4 * d * d + 2 * d * f + 3 * d + f) // t + 6 * d)


def _workspace(plan: Plan, holds_head: bool, params_sharded: bool) -> int:
    spec, t, c = plan.model, plan.mesh.tensor, plan.precision.compute_bytes
    b, s, d, f = plan.microbatch_size, spec.seq_len, spec.d_model, spec.d_ff
    n = b * s
    phases = []
    if holds_head:
        # The fp32 gradient of the logits (the fp32 logits are kept activations), plus the
        # compute-dtype logits the projection writes before the fp32 cast under bf16.
        phases.append(n * spec.vocab // t * (4 + (c if c != 4 else 0)))
    recompute = {Remat.NONE: 0,
                 Remat.SELECTIVE: c * b * spec.heads * s * s // t,
                 Remat.FULL: model.activation_bytes_per_layer(spec, b, plan.precision, Remat.NONE, t)}[plan.remat]
    phases.append(c * b * spec.heads * s * s // t + c * n * (2 * d + f // t) + recompute)
    gathered = 2 * _layer_param_bytes(plan) if params_sharded else 0
    return max(phases) + gathered


def memory_breakdown(plan: Plan, topology: Topology) -> MemoryBreakdown:
    """Per-device bytes of ``plan`` (worst stage), with capacity from ``topology.device``."""
    spec, mesh = plan.model, plan.mesh
    p, v = mesh.stage, plan.schedule.virtual_stages
    param_b, grad_b, opt_b = state_bytes_per_param(plan)
    param_ways = mesh.fsdp * (mesh.data if plan.zero >= 3 else 1)
    grad_ways = mesh.fsdp * (mesh.data if plan.zero >= 2 else 1)
    opt_ways = mesh.fsdp * (mesh.data if plan.zero >= 1 else 1)
    inflight = inflight_microbatches(plan)
    per_layer = model.activation_bytes_per_layer(spec, plan.microbatch_size, plan.precision, plan.remat, mesh.tensor)
    layers_per_chunk = spec.layers // (p * v)
    stages = []
    for s in range(p):
        held = model.device_stage_params(plan, s)
        holds_head = s == p - 1
        acts = inflight[s] * layers_per_chunk * per_layer
        if holds_head:
            # The head chunk's share of the stage's in-flight (microbatch, chunk) pairs.
            acts += math.ceil(inflight[s] / v) * model.head_activation_bytes(
                spec, plan.microbatch_size, plan.precision, mesh.tensor)
        stages.append(StageMemory(
            stage=s, params_count=_shard(held, param_ways), params=param_b * _shard(held, param_ways),
            grads=grad_b * _shard(held, grad_ways), optimizer=opt_b * _shard(held, opt_ways), activations=acts,
            workspace=_workspace(plan, holds_head, param_ways > 1), inflight=inflight[s]))
    worst = max(stages, key=lambda m: m.total)
    capacity = int(topology.device.memory_bytes)
    return MemoryBreakdown(
        params_count=model.param_count(spec), device_params_count=worst.params_count, params=worst.params,
        grads=worst.grads, optimizer=worst.optimizer, activations=worst.activations, workspace=worst.workspace,
        total=worst.total, capacity=capacity, fits=worst.total <= capacity, worst_stage=worst.stage,
        per_stage=tuple(stages))
