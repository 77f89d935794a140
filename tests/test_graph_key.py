"""The memos' key (testbed.sim.step.facts.facts_key): a plan whose key was played before reuses that task graph and
timeline (testbed.sim.graph.engine.simulate) or that analytic play (testbed.explore.analytic.estimate) without building
or playing them, so plans with equal keys must have equal task graphs, DES steps and estimates."""

from __future__ import annotations

import functools
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.explore.analytic import estimate
from testbed.explore.space import SearchSpace, candidates, preset_plan
from testbed.plan.model import Attention
from testbed.plan.placement import place
from testbed.plan.spec import Remat
from testbed.sim.graph.engine import simulate
from testbed.sim.graph.program import build_program
from testbed.sim.step.facts import facts_key, step_facts, topology_rules
from testbed.sim.step.step_rules import serial_host
from testbed.topology.io import load_topology

#: No controller (dgx-h100), a controller on a shared host (host-cpu-8), XLA:TPU's collective rules (tpu-v5e-4x4).
TOPOLOGIES = ("dgx-h100", "host-cpu-8", "tpu-v5e-4x4")
SPACE = SearchSpace(schedules=("1f1b", "interleaved"), virtual_stages=(2,), microbatches=(1, 2), zero=(0, 1, 3),
                    sequence_parallel=(False, True), remat=("none",))


@functools.cache
def _plans(topology: str, model: str, flash: bool) -> tuple:
    base = preset_plan(model)
    if flash:
        base = replace(base, model=replace(base.model, attention=Attention.FLASH))
    return tuple(candidates(base, load_topology(topology).num_devices, SPACE))


def _key(plan, topology) -> tuple:
    ids = place(plan, topology).device_ids
    return facts_key(step_facts(plan, ids, **topology_rules(topology)), ids, topology.calibration.controller is not None)


def _program(plan, topology):
    return build_program(plan, place(plan, topology), controller=topology.calibration.controller is not None,
                         serial=serial_host(topology.calibration), **topology_rules(topology))


@settings(deadline=None)
@given(st.sampled_from(TOPOLOGIES), st.sampled_from(("gpt-tiny", "gpt-125m")), st.booleans(), st.data(),
       st.sampled_from(list(Remat)), st.sampled_from(list(Remat)))
def test_equal_keys_have_equal_graphs_and_steps(name, model, flash, data, first, second) -> None:
    topology = load_topology(name)
    plan = data.draw(st.sampled_from(_plans(name, model, flash)))
    a, b = replace(plan, remat=first), replace(plan, remat=second, name="other")
    memo, plays = {}, {}
    played, again = simulate(a, topology, memo), simulate(b, topology, memo)
    assert (again.timeline is played.timeline) is (_key(a, topology) == _key(b, topology))
    if again.timeline is played.timeline:  # b's key equals a's: neither built nor played
        built = _program(b, topology)
        assert built.tasks == played.program.tasks
        assert (built.representative == played.program.representative).all()
        assert again.report.step_time_s == simulate(b, topology).report.step_time_s
    else:  # plans alike but for their name always share one
        assert first is not second
    estimate(a, topology, plays=plays)
    assert estimate(b, topology, plays=plays) == estimate(b, topology)  # from the memo or played


def test_selective_under_flash_attention_shares_the_graph_of_none_without_a_controller() -> None:
    """Flash attention's backward recomputes its scores anyway, so selective remat adds no work: one graph. With a
    controller (its dispatches pass each remat's residual buffers) and under full remat, graphs of their own."""
    plan = next(p for p in _plans("dgx-h100", "gpt-125m", True) if p.mesh.data == 8)
    for name, shared in (("dgx-h100", True), ("host-cpu-8", False)):
        topology, memo = load_topology(name), {}
        none = simulate(replace(plan, remat=Remat.NONE), topology, memo)
        selective = simulate(replace(plan, remat=Remat.SELECTIVE), topology, memo)
        assert (selective.timeline is none.timeline) is shared, name
        assert selective.report.step_time_s == simulate(replace(plan, remat=Remat.SELECTIVE), topology).report.step_time_s
        full = simulate(replace(plan, remat=Remat.FULL), topology, memo)
        assert full.timeline is not none.timeline
        plays: dict = {}
        estimate(replace(plan, remat=Remat.NONE), topology, plays=plays)
        assert estimate(replace(plan, remat=Remat.SELECTIVE), topology, plays=plays) == estimate(
            replace(plan, remat=Remat.SELECTIVE), topology)
        assert len(plays) == (2 if shared else 3)  # the topology's entry and one play, or two
