"""The search's slowed floor: :mod:`testbed.explore.floor`'s step floor with the compute the comm slowdown adds for
the parameter gathers beside it, before a plan's step facts are built.

The analytic tier lengthens an action's compute by ``device.comm_slowdown x min(compute, the communication beside
it)`` (testbed.explore.play ``Play._slowed``), where, with ``runtime.fsdp_prefetch``, that communication holds the
action's whole parameter gathers (testbed.explore.play_floor.beside_compute: its sends, reductions and hidden tensor
collectives only add); testbed.explore.play_floor.action_floors counts it in each action's floor where the action's
blocks are played neither span by span nor with compute shares of their own. A chunk holding neither the embedding
nor the head splits its blocks into equal shares of its layers (testbed.sim.step.chunk_facts: ``block_work`` is
empty, so testbed.explore.prices gives its actions no ``plays`` and no ``parts``), so each of its gathering actions
costs at least its floor (testbed.explore.floor: compute, blocking tensor collectives' bound, the accumulator's add)
plus ``slowdown x min(its compute floor, its gathers)``, the gathers priced as the tier prices them
(testbed.explore.gather_floor.middle_gathers; min grows with both). Those actions of the first, middle and last stages
are lengthened so (the others keep their floors) and the floor's sums and the schedule's play are taken again
(testbed.explore.floor.combined and played_at): a lower bound of the estimate, as theirs. Only dense models (no MoE
chain), no context parallelism, no shared host (where testbed.explore.floor bounds). tests/test_slowed_floor.py checks
it under the estimate and under the tier's own action floors on sampled plans.
"""

from __future__ import annotations

from testbed.collectives.routed import memoized
from testbed.explore.floor import cached_played_at, combined, floor_key, stage_floors
from testbed.explore.gather_floor import gather_key, middle_gathers
from testbed.plan.spec import Plan
from testbed.topology import Topology

__all__ = ["slowed_floor", "slowed_action_floors"]


def slowed_floor(plan: Plan, topology: Topology) -> float:
    """A lower bound of the analytic estimate's step seconds (module docstring); 0 where the device is not slowed by
    its communication, gathers are not prefetched, or no middle chunk gathers. Memoized per topology on what it reads
    (testbed.explore.floor.floor_key, testbed.explore.gather_floor.gather_key, the schedule's name)."""
    if not topology.device.comm_slowdown or not plan.runtime.fsdp_prefetch:
        return 0.0
    key = (floor_key(plan), gather_key(plan), plan.schedule.name)
    return memoized(topology, "slowed_floor", key, lambda: _slowed_floor(plan, topology))


def _slowed_floor(plan: Plan, topology: Topology) -> float:
    """:func:`slowed_floor`, not memoized on the plan: its play memoized on the order and floors
    (testbed.explore.floor.cached_played_at, shared with the played floor's)."""
    priced = slowed_action_floors(plan, topology)
    if priced is None:
        return 0.0
    return max(combined(plan, priced), cached_played_at(plan, priced, topology))


def slowed_action_floors(plan: Plan, topology: Topology) -> list[dict[tuple[int, str], float]] | None:
    """Per stage, each ``(chunk, kind)`` action's floor seconds with the slowdown its gathers add where the module
    docstring says; None where nothing is added."""
    gathers = middle_gathers(plan, topology) if plan.runtime.fsdp_prefetch else {}
    rate = topology.device.comm_slowdown
    if not gathers or not rate:
        return None
    computes: list[dict[tuple[int, str], float]] = []
    priced = stage_floors(plan, topology, computes)
    if priced is None:
        return None
    out = list(priced)
    for s in {s for s, _, _ in gathers}:
        out[s] = dict(priced[s])
        for (c, kind), compute in computes[s].items():
            gather = gathers.get((s, c, kind), 0.0)
            if gather > 0.0:
                out[s][(c, kind)] += rate * min(compute, gather)
    return out
