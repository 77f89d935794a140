"""What an XLA program compiled against its device's memory limit can drop to fit: the compiler's floors.

XLA compiles for a device with a memory limit, and two of its passes act against it when the program would
not fit: the rematerialisation pass (``HloRematerialization``) recomputes cheap values at their uses instead
of keeping them, and the latency-hiding scheduler ranks staying under the limit above overlapping a collective.
Each floor here is the plan as the compiler would leave it (:func:`compiler_floors`, in order, each on top of the
one before); testbed.model.memory takes them, one after another, only while the stage would overflow, so a
program that fits keeps everything the runner's program keeps. Memory only: what the floors cost in time (a
recomputed loss, a gather overlapped less) is not priced. Programs not compiled against the limit
(``runtime.limit_aware_compile`` false: PyTorch's) have no floor.
"""

from __future__ import annotations

from dataclasses import replace

from testbed.plan.sharding import gathered_blocks
from testbed.plan.spec import Plan

__all__ = ["loss_floor_plan", "prefetch_floor_plan", "compiler_floors", "deepest_floor"]


def loss_floor_plan(plan: Plan) -> Plan | None:
    """``plan`` with the loss at its floor, or None when its loss has no buffers a compiler could drop.

    An XLA program (``runtime.limit_aware_compile``) compiled for a device with a memory limit runs XLA's
    rematerialisation pass (``HloRematerialization``, openxla/xla ``hlo_rematerialization.cc``) against that
    limit: when the program would not fit, it recomputes cheap values at their uses instead of keeping them.
    The runner's loss keeps fp32 logits and writes two fp32 logits-sized buffers (testbed.model.kept), all
    elementwise functions of the compute-dtype logits the head's matmul wrote (the fp32 cast, ``exp(logits -
    max)``, the softmax gradient). What no compiler can drop: the compute-dtype logits, kept for the backward,
    and the compute-dtype logits gradient the head's backward matmuls read, 2 + 2 bytes a logit under bf16 and
    the per-row log-sum-exp: the buffers ``runtime.fused_loss`` describes. The floor is what a published run
    shows XLA:TPU reaching: MaxText's Llama 3.1 8B on v6e-64 (tpu-recipes, per_device_batch_size 5, 8192
    tokens, vocabulary 128,256: 5.25e9 logits a chip) trained on 31.25 GiB of HBM, where one fp32 logits
    buffer alone is 19.6 GiB; XLA:TPU's own ``memory_analysis`` of a program that fits with room (MaxText's
    docs, understand_logs_and_metrics.md: DeepSeek2-16B on v5p-8, 5.03e9 logits a chip, temp 55.9 GB)
    keeps more, so the floor applies only to programs that would not fit."""
    return _applied(plan, _loss_fields(plan))


def _loss_fields(plan: Plan) -> dict | None:
    """The runtime fields :func:`loss_floor_plan` sets, or None."""
    return None if not plan.runtime.limit_aware_compile or plan.runtime.fused_loss else {"fused_loss": True}


def prefetch_floor_plan(plan: Plan) -> Plan | None:
    """``plan`` with no block's gather run ahead (``runtime.fsdp_prefetch`` 0), or None when nothing is prefetched
    or the program is not XLA's.

    XLA's latency-hiding scheduler (openxla/xla ``latency_hiding_scheduler.cc``, ``ReadySetLt::
    MemoryPressurePolicy``), given the device's memory limit, ranks "do not bring the peak beyond the limit"
    (``kMemoryPeakOverLimit``) above every overlap rule once live memory passes half the limit: an all-gather
    whose early start would put the prefetched block's gathered weights beside the peak is not started there. The
    block computing still needs its own weights, so what can be dropped is the ``fsdp_prefetch`` blocks gathered
    ahead; the gather then overlaps less (not priced: memory only). PyTorch's FSDP prefetches whatever the memory."""
    return _applied(plan, _prefetch_fields(plan))


def _prefetch_fields(plan: Plan) -> dict | None:
    """The runtime fields :func:`prefetch_floor_plan` sets, or None."""
    if not plan.runtime.limit_aware_compile or plan.runtime.fsdp_prefetch == 0 or not gathered_blocks(plan):
        return None
    return {"fsdp_prefetch": 0}


def _applied(plan: Plan, fields: dict | None) -> Plan | None:
    return None if fields is None else replace(plan, runtime=replace(plan.runtime, **fields))


#: The floors in the order a compiler reaches them: (name, the runtime fields it sets or None). Each floor's
#: condition reads fields the others leave alone, so they apply independently.
_FLOORS = (("rematerialised_loss", _loss_fields), ("delayed_gathers", _prefetch_fields))


def compiler_floors(plan: Plan) -> tuple[tuple[str, Plan], ...]:
    """The plans an XLA compiler reaches against a memory limit, in order, each on top of the one before:
    the loss at its floor (:func:`loss_floor_plan`), then no prefetched gathers (:func:`prefetch_floor_plan`)."""
    floors, fields = [], {}
    for name, fields_of in _FLOORS:
        more = fields_of(plan)
        if more is not None:
            fields = {**fields, **more}
            floors.append((name, _applied(plan, fields)))
    return tuple(floors)


def deepest_floor(plan: Plan) -> Plan | None:
    """The last of :func:`compiler_floors` (every floor at once), built in one step; None when there is none."""
    fields = {}
    for _, fields_of in _FLOORS:
        fields.update(fields_of(plan) or {})
    return _applied(plan, fields) if fields else None
