"""The analytic tier's prices on first use (testbed.explore.prices.StepPrices): what the play floor bounds an action by
(``least``, priced without the collectives only a play reads) is, to the bit, what the action's whole price says,
and each action's price is the same whichever order the play reads them in."""

from __future__ import annotations

import random

import pytest

from testbed.explore.play_floor import action_floors
from testbed.explore.prices import Least, StepPrices
from testbed.explore.space import SearchSpace, candidates, preset_plan
from testbed.plan.placement import place
from testbed.sim.step.facts import step_facts, topology_rules
from testbed.topology.io import load_topology

SPACE = SearchSpace(schedules=("1f1b", "interleaved", "zb-h1"), microbatches=(1, 4), zero=(0, 1, 3),
                    remat=("none", "full"), sequence_parallel=(False, True))


def _steps(topology_name: str, devices: int, count: int, seed: int):
    topology = load_topology(topology_name)
    plans = list(candidates(preset_plan("gpt-125m"), devices, SPACE))
    random.Random(seed).shuffle(plans)
    for plan in plans[:count]:
        ids = place(plan, topology).device_ids
        facts = step_facts(plan, ids, **topology_rules(topology))
        yield lambda: StepPrices(facts, topology, ids)


def _whole(step: StepPrices, key) -> Least:
    """The :class:`Least` the action's whole price gives."""
    p, rate = step.prices[key], step.topology.device.comm_slowdown
    played = tuple(sum(block.compute for block in v) for v in (p.plays, p.plays_last, p.plays_scatter) if v)
    beside = (p.gather, p.send_s, p.bucket, p.scatter) if rate else (0.0,) * 4
    return Least(p.compute, p.tensor, p.hidden, p.piece, p.pieces, p.parts, p.acc, played, *beside, p.ring_hidden,
                 p.chain)


@pytest.mark.parametrize(("topology_name", "devices"), [("dgx-h100-superpod@32", 32), ("tpu-v4-4x4x4", 64),
                                                        ("tpu-v5p-2x4x4", 32)])
def test_least_is_the_whole_price_and_order_does_not_matter(topology_name: str, devices: int) -> None:
    for make in _steps(topology_name, devices, 24, 3):
        lazy = make()
        floors = action_floors(lazy)  # every action's least first, as a bounded play reads them
        keys = list(lazy.actions)
        for key in reversed(keys):  # priced last-first
            assert lazy.least(key) == _whole(lazy, key), key
        eager = make()
        assert action_floors(eager) == floors
        assert all(eager.prices[key] == lazy.prices[key] for key in keys)


def test_an_actions_span_plays_are_played_once_per_pieces_and_priced_alike_without_the_memo() -> None:
    """testbed.explore.span_times: an action's blocks played span by span (span_play.action_plays) are built once per
    ``pieces`` and memo and read by both its price and its floor; priced without a memo they are the same, to the
    bit."""
    from testbed.explore.span_times import played_computes, priced_plays

    seen = 0
    for make in _steps("tpu-v4-4x4x4", 64, 24, 5):
        step = make()
        for (s, c, kind), (chunk, work, _) in step.actions.items():
            for pieces, reduce in ((chunk.blocks, False), (chunk.buckets, True)):
                spans: dict = {}
                priced = priced_plays(step, s, chunk, work, pieces, reduce, spans=spans)
                computes = played_computes(step, s, chunk, work, pieces, reduce, spans=spans)
                assert priced == priced_plays(step, s, chunk, work, pieces, reduce)
                assert computes == played_computes(step, s, chunk, work, pieces, reduce)
                assert computes == tuple(block.compute for block in priced)
                if priced:
                    assert tuple(block.play for block in priced) == spans[("plays", reduce)]
                    seen += 1
    assert seen > 0
