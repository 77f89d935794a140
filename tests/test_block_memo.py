"""An action's fsdp blocks played from its start and kept (testbed.explore.block_memo): the play is the one played at
the start, but for rounding; a kept play is, to the bit, what playing the blocks again gives; and an estimate is the
same with the memo as without it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from testbed.explore.analytic import estimate
from testbed.explore.block_memo import StepBlocks, from_start, shared_plays
from testbed.explore.held_blocks import held_blocks
from testbed.plan.io import load_plan
from testbed.plan.spec import Axis
from testbed.topology.io import load_topology

AR, AG = ("all_reduce", (Axis.FSDP,), 1.0), ("all_gather", (Axis.FSDP,), 1.0)
GATHERS, PARTS, HELD = (((1.0, AG),),) * 3, (3.0, 3.0, 3.0), (((2.0, AR),),) * 3


class _Coll:
    """A stage's collectives sharing links at half speed (a reduction beside a gather)."""

    placement = ((1,), b"")

    def factor(self, stage: int, a, b) -> float:
        return 0.5 if {a[0], b[0]} == {"all_reduce", "all_gather"} else 1.0


def _absolute(start: float, gather_free: float, before: list[float]):
    return held_blocks(GATHERS, PARTS, HELD, start, gather_free, before, 1, lambda a, b: _Coll().factor(0, a, b))


def _from_start(blocks: StepBlocks, start: float, gather_free: float, before: list[float]):
    return blocks.held(("action",), 0, _Coll(), GATHERS, PARTS, HELD, start, gather_free, before, 1)


@pytest.mark.parametrize("gather_free, before", [(0.0, []), (7.5, [6.0, 8.0, 9.0]), (9.0, [8.5])])
def test_blocks_played_from_their_start_are_those_played_at_it(gather_free: float, before: list[float]) -> None:
    """Gathers prefetched into the previous action (before the start, from ``gather_free`` and the previous blocks'
    ends), or from time 0 where nothing came before: the same play, every time moved by the start."""
    blocks = StepBlocks(load_topology("tpu-v5e-4x4"))
    played, want = _from_start(blocks, 10.0, gather_free, before), _absolute(10.0, gather_free, before)
    assert played.ends == pytest.approx(want.ends, rel=1e-12)
    assert played.held == pytest.approx(want.held, rel=1e-12)
    assert played.gather_end == pytest.approx(want.gather_end, rel=1e-12)
    assert played.flying == [pytest.approx(x, rel=1e-12) for x in want.flying]


def test_a_kept_play_is_the_play_again_to_the_bit() -> None:
    """The same blocks from a later start, the stage's earlier times as far before it: the kept play, moved, is
    what a memo of its own plays (times exact in binary, so moving them rounds nothing)."""
    topology = load_topology("tpu-v5e-4x4")
    first = _from_start(StepBlocks(topology), 10.0, 7.5, [6.0, 8.0, 9.0])
    kept = shared_plays(topology)
    size = len(kept.plays)
    again = _from_start(StepBlocks(topology), 20.0, 17.5, [16.0, 18.0, 19.0])
    assert len(kept.plays) == size  # played once
    assert again.ends == [x + 10.0 for x in first.ends] and again.held == first.held
    kept.plays.clear()
    assert _from_start(StepBlocks(topology), 20.0, 17.5, [16.0, 18.0, 19.0]) == again


def test_the_earlier_times_read_are_the_last_prefetch_plus_one() -> None:
    """Only the previous blocks' ends the prefetch rule reads, from the start; time 0 for those missing."""
    assert from_start(10.0, 9.0, [1.0, 8.0, 9.5], 1) == (-1.0, (-2.0, -0.5))
    assert from_start(10.0, 9.0, [9.5], 2) == (-1.0, (-10.0, -10.0, -0.5))


@pytest.mark.parametrize("topology_name, microbatches", [("tpu-v5e-4x4", 4), ("tpu-v5p-2x4x4", 2)])
def test_an_estimate_is_the_same_with_its_blocks_kept(topology_name: str, microbatches: int) -> None:
    """plans/fsdp-tpu.yaml (held reductions beside the gathers; over v5p, held gathers), its microbatches' blocks
    played from their starts: the same estimate from an emptied memo, from a full one, and again."""
    plan = load_plan("plans/fsdp-tpu.yaml")
    topology = load_topology(topology_name)
    plan = replace(plan, topology=None, mesh=replace(plan.mesh, fsdp=topology.num_devices),
                   batch=replace(plan.batch, microbatches=microbatches))
    first = estimate(plan, topology).step_time_s
    kept = shared_plays(topology)
    assert kept.plays
    assert estimate(plan, topology).step_time_s == first
    kept.plays.clear()
    kept.numbers.clear()
    assert estimate(plan, topology).step_time_s == first
