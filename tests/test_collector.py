"""testbed.explore.collector: a search runs with the collector's thresholds raised, the caller's restored after."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from testbed.explore.collector import THRESHOLD, rarely_collected

#: Python's default thresholds, the caller's here (tests/conftest.py runs the suite at THRESHOLD).
DEFAULT = (700, 10, 10)


@pytest.fixture
def defaults() -> Iterator[None]:
    saved = gc.get_threshold()
    gc.set_threshold(*DEFAULT)
    try:
        yield
    finally:
        gc.set_threshold(*saved)


def test_the_thresholds_are_raised_inside_and_restored_after_even_on_an_error(defaults: None) -> None:
    seen = []

    @rarely_collected
    def inside(fail: bool) -> tuple:
        seen.append(gc.get_threshold())
        if fail:
            raise ValueError("stop")
        return gc.get_threshold()

    assert inside(False) == THRESHOLD and gc.get_threshold() == DEFAULT
    with pytest.raises(ValueError):
        inside(True)
    assert seen == [THRESHOLD, THRESHOLD] and gc.get_threshold() == DEFAULT


def test_the_search_runs_rarely_collected(defaults: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from testbed.explore import search

    seen = []

    def stop(*args) -> None:
        seen.append(gc.get_threshold())
        raise ValueError("stop")

    monkeypatch.setattr(search, "_check_arguments", stop)
    with pytest.raises(ValueError):
        search.search(None, None)
    assert seen == [THRESHOLD] and gc.get_threshold() == DEFAULT
