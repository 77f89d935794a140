"""The search's memos of pricing give what they memoize: a stage's sends priced once per (destination, bytes)
(testbed.explore.prices.StepPrices), a stage's parameter counts summed once (testbed.model.costs.device_stage_params),
a chunk's block plays played once (testbed.sim.step.span_order.block_plays), on sampled plans of the search's space."""

from __future__ import annotations

import functools
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.collectives.timing import send_time
from testbed.explore.prices import StepPrices
from testbed.explore.space import SearchSpace, candidates, preset_plan
from testbed.model import costs
from testbed.plan.placement import place
from testbed.plan.spec import Axis
from testbed.sim.graph.span_play import action_plays
from testbed.sim.step import span_order
from testbed.sim.step.facts import step_facts, topology_rules
from testbed.topology.io import load_topology

TOPOLOGIES = ("dgx-h100", "tpu-v5e-4x4")
SPACE = SearchSpace(schedules=("1f1b", "interleaved"), virtual_stages=(2,), microbatches=(2, 4), zero=(0, 3),
                    sequence_parallel=(False, True), remat=("none",))


@functools.cache
def _plans(topology: str) -> tuple:
    return tuple(p for p in candidates(preset_plan("gpt-125m"), load_topology(topology).num_devices, SPACE)
                 if p.mesh.stage > 1)


@settings(deadline=None, max_examples=25)
@given(st.sampled_from(TOPOLOGIES), st.data(), st.booleans())
def test_memoized_sends_are_each_actions_own(name, data, scatter) -> None:
    topology = load_topology(name)
    plan = data.draw(st.sampled_from(_plans(name)))
    plan = replace(plan, runtime=replace(plan.runtime, pipeline_scatter_gather=scatter))
    ids = place(plan, topology).device_ids
    facts = step_facts(plan, ids, **topology_rules(topology))
    step = StepPrices(facts, topology, ids)
    reps, ways = facts.representatives, facts.scatter_sends
    for (s, c, kind), priced in step.prices.items():
        work = facts.chunks[s][c].action(kind)
        own = tuple((dst, send_time(topology, reps[s], reps[dst], nbytes / ways),
                     step.coll.time("all_gather", (Axis.TENSOR,), dst, nbytes) if ways > 1 else 0.0)
                    for dst, _, nbytes in work.sends)
        assert tuple(map(tuple, priced.sends)) == own
        assert priced.send_s == sum(x[1] for x in own)


@settings(deadline=None, max_examples=25)
@given(st.sampled_from(TOPOLOGIES), st.data(), st.integers(1, 8))
def test_stage_params_are_the_chunks_summed(name, data, ways) -> None:
    plan = data.draw(st.sampled_from(_plans(name)))
    m, v = plan.mesh, plan.schedule.virtual_stages
    for s in range(m.stage):
        assert costs.device_stage_params(plan, s, ways) == sum(
            costs._chunk_params(plan.model, s, c, m.stage, v, m.tensor, ways, plan.stage_layers, m.expert, None,
                                m.expert_tensor) for c in range(v))


@settings(deadline=None, max_examples=10)
@given(st.data())
def test_block_plays_memo_plays_as_unmemoized(data) -> None:
    """Every fsdp action's blocks (a tensor axis: spans with collectives among them), played through the memo and
    once without it, alike."""
    topology = load_topology("dgx-h100")
    plan = data.draw(st.sampled_from([p for p in _plans("dgx-h100") if p.zero == 3 and p.mesh.tensor > 1]))
    facts = step_facts(plan, place(plan, topology).device_ids, **topology_rules(topology))
    played = 0
    for chunks in facts.chunks:
        for chunk in chunks:
            for work in chunk.actions:
                args = (chunk, work, chunk.blocks, facts.gathers("B"), plan.sequence_parallel, work.kind == "B")
                first = action_plays(*args)
                span_order.block_plays.cache_clear()
                assert action_plays(*args) == first
                played += bool(first)
    assert played
