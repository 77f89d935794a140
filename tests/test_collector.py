"""testbed.explore.collector: a search runs with the collector's thresholds raised, the caller's restored after."""

from __future__ import annotations

import gc

import pytest

from testbed.explore.collector import THRESHOLD, rarely_collected


def test_the_thresholds_are_raised_inside_and_restored_after_even_on_an_error() -> None:
    before = gc.get_threshold()
    seen = []

    @rarely_collected
    def inside(fail: bool) -> tuple:
        seen.append(gc.get_threshold())
        if fail:
            raise ValueError("stop")
        return gc.get_threshold()

    assert inside(False) == THRESHOLD and gc.get_threshold() == before
    with pytest.raises(ValueError):
        inside(True)
    assert seen == [THRESHOLD, THRESHOLD] and gc.get_threshold() == before


def test_the_search_runs_rarely_collected(monkeypatch: pytest.MonkeyPatch) -> None:
    from testbed.explore import search

    seen = []

    def stop(*args) -> None:
        seen.append(gc.get_threshold())
        raise ValueError("stop")

    monkeypatch.setattr(search, "_check_arguments", stop)
    with pytest.raises(ValueError):
        search.search(None, None)
    assert seen == [THRESHOLD]
