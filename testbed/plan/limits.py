"""Stated limits on a plan's sizes, checked when the plan is read, before anything uses them.

A plan can name any whole number up to 2^53 (``testbed.fields.get_int``), but
the memory model, the simulator and the runner allocate per device, per layer
and per microbatch: a 10^15-layer or 2^40-device plan would pass ``plan
check`` and then exhaust memory, overflow, or start JAX. These limits are far
beyond any real job (the largest clusters have ~10^5 devices, the largest
models ~10^3 layers and d_model ~ 2^15) and keep every byte count a float64
holds exactly enough, and the simulator's work bounded. Each message names the
field and the limit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from testbed.errors import InputError
from testbed.fields import MAX_DEVICES, MAX_NAME

if TYPE_CHECKING:
    from testbed.plan.spec import Plan

__all__ = ["MAX_DEVICES", "MAX_LAYERS", "MAX_D_MODEL", "MAX_D_FF", "MAX_HEADS", "MAX_VOCAB", "MAX_SEQ_LEN",
           "MAX_GLOBAL_BATCH", "MAX_MICROBATCHES", "MAX_PIPELINE_ACTIONS", "MAX_STAGES", "MAX_EXPERTS", "MAX_NAME", "check_plan_limits"]

#: Transformer blocks at most.
MAX_LAYERS = 100_000
#: Hidden size at most (2^17; GPT-4-class models use 2^14).
MAX_D_MODEL = 1 << 17
#: MLP width at most (8 x MAX_D_MODEL).
MAX_D_FF = 1 << 20
#: Attention heads at most.
MAX_HEADS = 1 << 14
#: Vocabulary at most (2^24 tokens).
MAX_VOCAB = 1 << 24
#: Sequence length at most (2^22 tokens).
MAX_SEQ_LEN = 1 << 22
#: Sequences per step at most (2^30).
MAX_GLOBAL_BATCH = 1 << 30
#: Microbatches per step at most.
MAX_MICROBATCHES = 1 << 16
#: Pipeline actions of one step (stages x microbatches x virtual chunks x 3) at most: the schedule table,
#: its dependency graph and the simulator's tasks are built action by action.
MAX_PIPELINE_ACTIONS = 200_000
#: Experts per MoE layer at most (the largest published models route over a few hundred).
MAX_EXPERTS = 1 << 14
#: Pipeline stages at most (ordering a table's actions takes about stages^2 steps).
MAX_STAGES = 1024

_MODEL = (("layers", MAX_LAYERS), ("d_model", MAX_D_MODEL), ("heads", MAX_HEADS), ("d_ff", MAX_D_FF),
          ("vocab", MAX_VOCAB), ("seq_len", MAX_SEQ_LEN))


def _at_most(value: int, limit: int, field: str, what: str) -> None:
    if value > limit:
        raise InputError(f"must be at most {limit:,} ({what}), got {value:,}", field=field)


def check_plan_limits(plan: "Plan") -> "Plan":
    """``plan`` unchanged, or an InputError naming the first field beyond its stated limit."""
    model = plan.model
    for name, limit in _MODEL:
        _at_most(getattr(model, name), limit, f"model.{name}", "the testbed's limit")
    kv_heads = getattr(model, "kv_heads", None)
    if isinstance(kv_heads, int):
        _at_most(kv_heads, MAX_HEADS, "model.kv_heads", "the testbed's limit")
    _at_most(plan.batch.global_batch, MAX_GLOBAL_BATCH, "batch.global_batch", "the testbed's limit")
    _at_most(plan.batch.microbatches, MAX_MICROBATCHES, "batch.microbatches", "the testbed's limit")
    mesh = plan.mesh
    for axis in ("data", "fsdp", "tensor", "stage", "expert", "context"):
        _at_most(getattr(mesh, axis), MAX_DEVICES, f"mesh.{axis}", "devices the testbed models at most")
    _at_most(mesh.size, MAX_DEVICES, "mesh", "devices in the mesh, the product of its degrees")
    for name in ("experts", "shared_experts"):
        _at_most(getattr(model, name, 0), MAX_EXPERTS, f"model.{name}", "the testbed's limit")
    if getattr(model, "expert_d_ff", None):
        _at_most(model.expert_d_ff, MAX_D_FF, "model.expert_d_ff", "the testbed's limit")
    if getattr(model, "head_dim", None):
        _at_most(model.head_dim, MAX_D_MODEL, "model.head_dim", "the testbed's limit")
    _at_most(mesh.stage, MAX_STAGES, "mesh.stage", "pipeline stages the testbed schedules at most")
    virtual = plan.schedule.virtual_stages
    _at_most(virtual, MAX_LAYERS, "schedule.virtual_stages", "the testbed's limit")
    actions = mesh.stage * plan.batch.microbatches * virtual * 3
    if actions > MAX_PIPELINE_ACTIONS:
        raise InputError(f"mesh.stage {mesh.stage} x microbatches {plan.batch.microbatches} x virtual stages "
                         f"{virtual} gives {actions:,} pipeline actions per step; the testbed builds at most "
                         f"{MAX_PIPELINE_ACTIONS:,}", field="batch.microbatches")
    if len(plan.name) > MAX_NAME:
        raise InputError(f"must be at most {MAX_NAME} characters, got {len(plan.name):,}", field="name")
    return plan
