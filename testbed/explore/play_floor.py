"""A lower bound of the analytic tier's step while it plays (testbed.explore.play), so an estimate that cannot reach
the search's bar stops early.

A stage's play (:class:`testbed.explore.play.Play`) starts each action no earlier than the stage is free and frees
it no earlier than the action's compute has run: its priced compute (the least of the ways the play may price it: whole,
in gradient-bucket pieces, or its blocks played span by span, testbed.explore.span_times), the accumulator's add of a
microbatch's last backward, and its blocking tensor collectives less the part ``runtime.tp_comm_overlap`` hides
(none where its blocks play their collectives among them); barriers, gathers, sends and the iteration joins only
add. The comm slowdown (``device.comm_slowdown``) is counted where the play prices it from the action's own prices
(:meth:`testbed.explore.play.Play._slowed` on an action neither played span by span nor block by block with its
own parts: ``slowdown x min(compute, communication beside it)``, what a gather wait absorbs still lengthening the
action), at the action's least compute. The stage's update then runs its optimizer after the stage is free. So at
any point of the play the step is at least the stage's free time plus the floors of its actions still to play and its
optimizer:
:func:`stage_rests` gives those sums before the play, :func:`action_floors` each action's share.
tests/test_play_floor.py holds the bound under the estimate on sampled plans, at every action.
"""

from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING

from testbed.sim.step.step_rules import Gradients, gradients
from testbed.sim.step.update_facts import update_seconds

if TYPE_CHECKING:
    from testbed.explore.prices import StepPrices

__all__ = ["action_floors", "stage_rests", "beside_compute", "SAFETY", "AboveBar"]

#: The bound is taken this much under its sum (a sum of hundreds of floats, and the play's, round apart).
SAFETY = 1e-9


class AboveBar(Exception):
    """A play stopped once its step could no longer be at most the bar: ``floor``, a lower bound of that step, is
    above it; ``bounds``: every bound the play checked against the bar, in order (its last is ``floor``), so a play
    of the same step under a lower bar would stop at the first of them above that bar (testbed.explore.analytic)."""

    def __init__(self, floor: float, bounds: tuple[float, ...] | list[float] = ()) -> None:
        super().__init__(floor)
        self.floor, self.bounds = floor, bounds


def action_floors(step: StepPrices) -> dict[tuple[int, int, str], float]:
    """Each action's floor ``(stage, chunk, kind) -> seconds`` (module docstring), from what its price bounds it
    by (testbed.explore.prices.Least: the collectives only its play reads are not priced for it)."""
    facts = step.facts
    last, rate = facts.last_backward, step.topology.device.comm_slowdown
    out = {}
    for key in step.actions:
        p = step.least(key)
        plays = p.played
        ways = [p.compute, *plays]
        extra = 0.0
        if key[2] == last:
            if p.piece:
                ways.append(p.pieces * p.piece)
            if p.parts and len(p.parts) == p.pieces:
                ways.append(sum(p.parts))
            extra = p.acc
        compute = min(ways) + extra
        tensor = 0.0 if plays else max(0.0, p.tensor - p.hidden)
        out[key] = compute + tensor + (rate * min(compute, _least_beside(step, p, key[2])) if rate and not plays
                                       and not (p.gather and p.parts) else 0.0)
    return out


def beside_compute(step: StepPrices, p, grads: Gradients) -> float:
    """The communication beside an action's compute (``p``: its price; ``grads``: what it does with its gradients,
    testbed.sim.step.step_rules.gradients) that ``device.comm_slowdown`` slows it by (testbed.explore.play.Play._slowed,
    where its blocks do not play their own gathers; and this floor): its hidden tensor collectives, its sends, the
    gradient reductions it starts (its buckets where it releases them and they reduce in the backward, or an
    earlier microbatch's reduce-scatter), with prefetch its gathers, and the ring's sends beside its compute."""
    facts = step.facts
    buckets = p.bucket * p.pieces if grads.release and facts.reduce_in_backward else 0.0
    return (p.hidden + p.send_s + max(p.scatter if grads.scatter else 0.0, buckets) + p.gather * bool(facts.prefetch)
            + p.ring_hidden)


def _least_beside(step: StepPrices, p, kind: str) -> float:
    """:func:`beside_compute` of a ``kind`` action, the least over its chunk's microbatches (the last releases the
    buckets, an earlier one reduce-scatters)."""
    facts = step.facts
    lefts = (0, 1) if facts.microbatches > 1 else (0,)
    return min(beside_compute(step, p, gradients(facts, kind, p.chain, left)) for left in lefts)


def stage_rests(step: StepPrices, floors: dict[tuple[int, int, str], float]) -> list[float]:
    """Per stage, its optimizer's compute plus the floors of all its actions, added one by one in the schedule's
    order."""
    facts = step.facts
    rests = [update_seconds(step.topology, step.dtype, u) for u in facts.updates]  # what play.py's update costs
    for s, keys in enumerate(_floor_keys(facts.order, facts.stages)):
        rests[s] = functools.reduce(operator.add, map(floors.__getitem__, keys), rests[s])
    return rests


#: id(order) -> (order, each stage's actions' floor keys): the schedules' orders are memoized, so plays share them.
_KEYS: dict[int, tuple[tuple, tuple]] = {}


def _floor_keys(order: tuple, stages: int) -> tuple[tuple[tuple[int, int, str], ...], ...]:
    """Per stage, the key in :func:`action_floors` of each of its actions in ``order`` (StepFacts.order), in order;
    memoized (the memo keeps the order, so its id is not reused)."""
    hit = _KEYS.get(id(order))
    if hit is None or hit[0] is not order:
        if len(_KEYS) > 1024:
            _KEYS.clear()
        keys: list[list[tuple[int, int, str]]] = [[] for _ in range(stages)]
        for s, a, _ in order:
            keys[s].append((s, a.chunk, a.kind))
        hit = _KEYS[id(order)] = (order, tuple(map(tuple, keys)))
    return hit[1]
