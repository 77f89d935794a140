"""The estimate memo's stopped plays (testbed.explore.analytic.estimate): a plan whose key's play stopped above a bar
gets, under any lower bar, the floor its own play would stop at, to the bit, without playing; under a higher bar it
is played again."""

from __future__ import annotations


import pytest

from testbed.explore import analytic
from testbed.explore.analytic import estimate
from testbed.topology.io import load_topology

from helpers import sampled_plans


def _no_play(*_args, **_kwargs):
    raise AssertionError("played again: the memo should have answered")


@pytest.mark.parametrize(("model", "topology_name", "devices"), [("gpt-1.3b", "dgx-h100-x4@16", 16),
                                                                 ("llama3-8b", "dgx-h100-x4", 32)])
def test_a_stopped_play_answers_lower_bars_as_a_play_would(model: str, topology_name: str, devices: int,
                                                            monkeypatch) -> None:
    topology = load_topology(topology_name)
    stopped = 0
    for plan in sampled_plans(model, devices, 8, 3):
        whole = estimate(plan, topology).step_time_s
        high, lower = 0.95 * whole, [0.95 * whole, 0.9 * whole, 0.7 * whole, 0.4 * whole, 0.1 * whole]
        fresh = [estimate(plan, topology, bar=bar) for bar in lower]
        assert all(isinstance(f, float) and f > bar for f, bar in zip(fresh, lower))
        memo: dict = {}
        assert estimate(plan, topology, bar=high, plays=memo) == fresh[0]
        kept = [v for k, entries in memo.items() if isinstance(k, tuple) for _, v in entries]
        assert len(kept) == 1 and isinstance(kept[0], analytic._Stopped)
        stopped += 1
        with monkeypatch.context() as patch:
            patch.setattr(analytic, "_played", _no_play)
            assert [estimate(plan, topology, bar=bar, plays=memo) for bar in lower] == fresh
        # Above the stopped play's bar it is played again: the step whole, then kept whole.
        assert estimate(plan, topology, bar=0.99 * whole, plays=memo) == estimate(plan, topology, bar=0.99 * whole)
        assert estimate(plan, topology, plays=memo).step_time_s == whole
        with monkeypatch.context() as patch:
            patch.setattr(analytic, "_played", _no_play)
            assert estimate(plan, topology, plays=memo).step_time_s == whole
    assert stopped == 8
