"""The DES's bar (testbed.sim.graph.engine.run): a play stops only once a proven lower bound of its step is above the
bar, so every stop's floor is at most the whole play's step, a bar at or above the step never stops it, and the
search that stops its replays so ranks the same ``top`` fastest as replaying each whole."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from testbed.explore.search import search
from testbed.explore.space import SearchSpace, candidates, preset_plan
from testbed.explore.analytic import plan_memory
from testbed.sim.graph.engine import StepAboveBar, simulate
from testbed.topology.io import load_topology

SPACE = SearchSpace(schedules=("gpipe", "1f1b", "interleaved", "zb-h1"), virtual_stages=(2,), microbatches=(1, 4, 8),
                    zero=(0, 1, 3), remat=("none", "full"), sequence_parallel=(False, True))
#: Bars as fractions of the whole play's step: each either stops the play at a floor at most the step, or not.
FRACTIONS = (0.5, 0.9, 0.99, 0.999)


def _sampled(model: str, topology: str, devices: int, count: int, seed: int) -> list:
    """``count`` of the space's plans that fit the topology's devices, drawn at random (``seed``): the candidates
    shuffled, then the first that fit (a uniform draw of the fitting ones, pricing the memory of only as many
    candidates as it takes, not of the thousands in the space)."""
    topo = load_topology(topology)
    plans = list(candidates(preset_plan(model), devices, SPACE))
    random.Random(seed).shuffle(plans)
    return list(itertools.islice((p for p in plans if plan_memory(p, topo).fits), count))


@pytest.mark.parametrize(("model", "topology", "devices", "seed"), [
    ("gpt-1.3b", "dgx-h100-x4", 32, 0),       # comm slowdown, NVLink and InfiniBand, pipelines and fsdp
    ("deepseek-moe-16b", "dgx-h100-x4", 32, 1),  # expert parallelism's all-to-alls
    ("gpt-1.3b", "tpu-v4-4x4x4", 64, 2),      # XLA:TPU's held collectives on a torus
])
def test_every_stop_is_below_the_whole_step(model: str, topology: str, devices: int, seed: int) -> None:
    topo = load_topology(topology)
    stops = 0
    plans = _sampled(model, topology, devices, 6, seed)
    assert len(plans) == 6
    for plan in plans:
        step = simulate(plan, topo).report.step_time_s
        assert simulate(plan, topo, bar=step).report.step_time_s == step  # the same play, never stopped
        for fraction in FRACTIONS:
            try:
                assert simulate(plan, topo, bar=fraction * step).report.step_time_s == step
            except StepAboveBar as stop:
                assert fraction * step < stop.floor <= step
                stops += 1
    assert stops >= 10  # the bound is not vacuous: most plays stop well under their step


def test_a_shared_host_is_never_stopped() -> None:
    """A shared host's devices share its cores (a compute task may run at any share), so no bar applies there."""
    topo = load_topology("host-cpu-8")
    for plan in _sampled("gpt-tiny", "host-cpu-8", 8, 4, 3):
        step = simulate(plan, topo).report.step_time_s
        assert simulate(plan, topo, bar=0.5 * step).report.step_time_s == step


def test_search_ranks_the_same_top_stopping_replays() -> None:
    """Many replays (a wide margin), most stopped once slower than the best three: the three are those replaying
    every plan whole finds, in order, with their steps."""
    topo = load_topology("dgx-h100-x4")
    base, space = preset_plan("gpt-1.3b"), replace(SPACE, microbatches=(1, 4), zero=(0, 1))
    whole = search(base, topo, space, replay=24, top=3, margin=0.2, stop_replays=False)
    stopped = search(base, topo, space, replay=24, top=3, margin=0.2)
    assert whole.replays_stopped == 0 and stopped.replays_stopped >= 5
    assert stopped.replayed == whole.replayed
    assert [(c.plan, c.step_time_s) for c in stopped.ranked[:3]] == [(c.plan, c.step_time_s) for c in whole.ranked[:3]]
    assert len(stopped.ranked) == stopped.replayed - stopped.replays_stopped


def test_search_by_mfu_over_precisions_stops_no_replay() -> None:
    """Ranked by MFU over several precisions (each against its own peak, not by step time alone): no bar."""
    topo = load_topology("dgx-h100")
    space = SearchSpace(microbatches=(1, 4), precisions=("bf16-mixed", "fp8-mixed"))
    found = search(preset_plan("gpt-125m"), topo, space, replay=8, top=2, margin=0.2, objective="mfu")
    assert found.replays_stopped == 0 and len(found.ranked) == found.replayed >= 8
