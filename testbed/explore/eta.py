"""The search's estimate of the seconds it has left, for its progress callback (testbed.explore.search).

A search has three phases of known or bounded size: the bounds (every plan's step floor: a known count), the
analytic tier (estimates in floor order, at most the plans whose floor is still below the bar: a count that
only falls) and the DES replay (a known list, plus a settling tail). :class:`TimeLeft` times each phase's work
as it runs and prices what is left of each at the rate measured so far; a phase not yet reached is priced at
the rate of the one before it times :data:`REPLAY_PER_ESTIMATE` (replays) or as one estimate per plan left
(estimates). The estimate only shows progress: no result depends on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["TimeLeft", "REPLAY_PER_ESTIMATE"]

#: A DES replay's seconds per analytic estimate's seconds of the same plan, until the search has timed a replay
#: of its own: 6.3-15.2 (median 12) over Llama 3 405B's layouts on llama3-h100-16k (1F1B and interleaved x 8,
#: the runner's and Meta's runtime, measured for this estimate); the first replay replaces it.
REPLAY_PER_ESTIMATE = 12.0


class TimeLeft:
    """Seconds a search has left, from the seconds per item each phase has taken so far."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._phase: str | None = None
        self._started = clock()
        self._done = 0
        self.per_item: dict[str, float] = {}  # phase -> measured seconds per item (the latest)

    def update(self, phase: str, done: int) -> None:
        """Record that ``phase`` has finished ``done`` items (a new phase starts its own clock)."""
        now = self._clock()
        if phase != self._phase:
            self._phase, self._started, self._done = phase, now, done
            return
        if done > self._done:
            self.per_item[phase] = (now - self._started) / (done - self._done)

    def seconds(self, phase: str, left: int, estimates: int = 0, replays: int = 0) -> float | None:
        """Seconds left: ``left`` items of ``phase`` at its measured rate, then ``estimates`` analytic estimates
        and ``replays`` DES replays still to come (each at its own rate, or as the module docstring says); None
        until ``phase`` has a rate."""
        own = self.per_item.get(phase)
        if own is None:
            return None
        estimate = self.per_item.get("analytic", own if phase == "bounds" else None)
        replay = self.per_item.get("replay")
        if replay is None and estimate is not None:
            replay = REPLAY_PER_ESTIMATE * estimate
        return own * left + (estimate or 0.0) * estimates + (replay or 0.0) * replays
