"""Memos of the step's facts: the schedule's execution order and each chunk's cost and GEMMs, kept across plans.

A search prices thousands of plans that share schedule tables and chunk shapes; these memoize the pure
functions testbed.sim.step.facts reads (keyed on exactly what each reads), so each is worked out once.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from testbed.model import costs
from testbed.model.costs import ChunkCost
from testbed.model.gemm import ChunkGemms, chunk_gemms
from testbed.pipeline.schedules import Action, Schedule, build_schedule, dependency_keys, execution_order
from testbed.plan.spec import Plan

__all__ = ["ActionKey", "Waits", "waits", "OrderedAction", "cached_execution", "cached_order", "cached_chunk_cost",
           "cached_chunk_gemms", "order_of"]

#: An action's key: (stage, kind, microbatch, chunk).
ActionKey = tuple[int, str, int, int]


class Waits(NamedTuple):
    """What an action waits for beyond its stage's previous action, by the one rule both tiers play: ``ends``, its own
    stage's actions it depends on (their ends); ``receives``, other stages' actions whose sends it receives (those
    sends' arrival: testbed.sim.graph.program's send tasks, testbed.explore.play's pipe streams). A lower bound may
    take a send's arrival as its sender's end (testbed.explore.floor)."""

    ends: tuple[ActionKey, ...]
    receives: tuple[ActionKey, ...]


def waits(stage: int, keys: list[ActionKey]) -> Waits:
    """:class:`Waits` of an action of ``stage`` that depends on ``keys``
    (testbed.pipeline.schedules.dependency_keys)."""
    return Waits(tuple(k for k in keys if k[0] == stage), tuple(k for k in keys if k[0] != stage))


#: One action in execution order: (stage, action, what it waits for).
OrderedAction = tuple[int, Action, Waits]


def order_of(schedule: Schedule, executed: tuple[tuple[int, Action], ...] | None = None
             ) -> tuple[OrderedAction, ...]:
    """Every action of ``schedule`` in execution order (``executed``, where already worked out) with its
    :class:`Waits`."""
    return tuple((s, a, waits(s, dependency_keys(schedule, s, a.kind, a.microbatch, a.chunk)))
                 for s, a in (execution_order(schedule) if executed is None else executed))


@functools.lru_cache(maxsize=4096)
def cached_execution(name: str, stages: int, microbatches: int, virtual: int
                     ) -> tuple[Schedule, tuple[tuple[int, Action], ...]]:
    """(schedule table, its execution order: testbed.pipeline.schedules.execution_order), memoized: the order with
    dependency keys (:func:`cached_order`) and the search's played floors (testbed.explore.floor) read one."""
    schedule = build_schedule(name, stages, microbatches, virtual)
    return schedule, tuple(execution_order(schedule))


@functools.lru_cache(maxsize=4096)
def cached_order(name: str, stages: int, microbatches: int, virtual: int) -> tuple[Schedule, tuple[OrderedAction, ...]]:
    """(schedule table, its execution order with dependency keys: :func:`order_of`), memoized: many plans share a
    table."""
    schedule, executed = cached_execution(name, stages, microbatches, virtual)
    return schedule, order_of(schedule, executed)


def cached_chunk_cost(plan: Plan, stage: int, chunk: int) -> ChunkCost:
    """``chunk_cost`` memoized on what it reads (model, stages, virtual, tensor, microbatch size, precision, remat,
    layers per stage, ``runtime.recompute``, ``moe_dispatch`` and ``moe_padded_dropless``, ``mesh.expert_tensor``)."""
    key = (plan.model, plan.mesh.stage, plan.schedule.virtual_stages, plan.mesh.tensor, plan.microbatch_size,
           plan.precision, plan.remat, plan.sequence_parallel, stage, chunk, plan.layers_per_stage,
           plan.mesh.expert, plan.expert_imbalance, plan.mesh.context, plan.runtime.recompute,
           plan.runtime.moe_dispatch, plan.mesh.expert_tensor, plan.runtime.moe_padded_dropless)
    cost = _CHUNKS.get(key)
    if cost is None:
        if len(_CHUNKS) > 100_000:
            _CHUNKS.clear()
        cost = _CHUNKS[key] = costs.chunk_cost(plan, stage, chunk)
    return cost


_CHUNKS: dict[tuple, ChunkCost] = {}


def cached_chunk_gemms(plan: Plan, stage: int, chunk: int) -> ChunkGemms:
    """``testbed.model.gemm.chunk_gemms`` memoized on what it reads (as :func:`cached_chunk_cost`, and
    ``runtime.attention_kernel``, which tags the attention products, and ``runtime.fp8_scaling`` with the
    precision, which tag the fp8 casts' amax passes)."""
    key = (plan.model, plan.mesh.stage, plan.schedule.virtual_stages, plan.mesh.tensor, plan.microbatch_size,
           plan.remat, stage, chunk, plan.layers_per_stage, plan.mesh.expert, plan.expert_imbalance, plan.mesh.context,
           plan.runtime.recompute, plan.runtime.moe_dispatch, plan.runtime.attention_kernel, plan.runtime.fp8_scaling, plan.precision,
           plan.mesh.expert_tensor, plan.runtime.fp8_head, plan.runtime.moe_padded_dropless)
    shapes = _GEMMS.get(key)
    if shapes is None:
        if len(_GEMMS) > 100_000:
            _GEMMS.clear()
        shapes = _GEMMS[key] = chunk_gemms(plan, stage, chunk)
    return shapes


_GEMMS: dict[tuple, ChunkGemms] = {}
