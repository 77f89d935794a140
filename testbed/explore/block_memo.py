"""An action's fsdp blocks played from its start (testbed.explore.play's ``_gather``): the blocks of
testbed.explore.held_blocks and of testbed.explore.span_times.play_blocks played with the action starting at time 0
and the stage's earlier times it reads taken from its start (when the stage's gathers are free; the previous gathering
action's blocks' ends the prefetch rule reads, testbed.sim.step.step_rules.gather_after: the last ``prefetch + 1``,
a missing one time 0 of the step), then every time of the play moved by the start.

A stage's alike actions (each microbatch's of a chunk) meet the same times from their start over and over, and plans
alike in a stage's actions (a search's many) play them alike, so each such play is kept (:class:`StepBlocks`, one per
testbed.explore.prices.StepPrices, over the memo of its topology, the latest one's: a search plays on one) under all
its blocks are played from and those times, to the bit: a hit is what playing the blocks again would give.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from testbed.explore.held_blocks import HeldPlay, Part, held_blocks
from testbed.explore.span_times import Played, PricedBlock, play_blocks
from testbed.explore.stage_collectives import StageCollectives
from testbed.topology import Topology

__all__ = ["StepBlocks", "from_start", "shared_plays", "spans_from_start"]

#: At most this many plays kept (then emptied; a few KB each).
MAX_PLAYS = 50_000
#: The latest topology a step was priced on, and the plays kept for it (:func:`shared_plays`).
_LATEST: list = [None, None]


class _Shared:
    """A topology's plays from their start: each content (what blocks are played from, but the times) numbered once
    (never a number twice: the objects a content names by identity are kept with it), and each play under its
    content's number and times."""

    def __init__(self) -> None:
        self.numbers: dict[tuple, tuple[int, object]] = {}
        self.plays: dict[tuple, object] = {}
        self.count = itertools.count()

    def number(self, content: tuple, keep: object) -> int:
        """``content``'s number (``keep``: the objects it names by identity, kept while it is numbered)."""
        hit = self.numbers.get(content)
        if hit is None:
            if len(self.numbers) > MAX_PLAYS:
                self.numbers.clear()
            hit = self.numbers[content] = (next(self.count), keep)
        return hit[0]

    def play(self, key: tuple, played: Callable[[], object]) -> object:
        """The play kept under ``key`` (a content's number and its times), else ``played()``, kept."""
        hit = self.plays.get(key)
        if hit is None:
            if len(self.plays) > MAX_PLAYS:
                self.plays.clear()
            hit = self.plays[key] = played()
        return hit


def shared_plays(topology: Topology) -> _Shared:
    """The plays kept for ``topology``: the latest topology's only (a new one drops the last one's; the topology is
    kept with them, so its id is its own)."""
    if _LATEST[0] is not topology:
        _LATEST[:] = [topology, _Shared()]
    return _LATEST[1]


class StepBlocks:
    """One step's blocks played from their start over its topology's memo: the step's own keys of its actions
    (the caller's, each naming one content for the step's life) numbered as the topology's memo numbers them."""

    def __init__(self, topology: Topology) -> None:
        self.shared = shared_plays(topology)
        self.own: dict[tuple, int] = {}

    def held(self, key: tuple, stage: int, coll: StageCollectives, gathers: Sequence[Sequence[Part]],
             parts: Sequence[float], held: Sequence[Sequence[Part]], start: float, gather_free: float,
             before: Sequence[float], prefetch: int, held_gathers: Sequence[Sequence[Part]] = ()) -> HeldPlay:
        """testbed.explore.held_blocks.held_blocks of the arguments played from ``start`` (module docstring), its
        ``factor`` ``coll``'s of ``stage`` (StageCollectives.factor: of the topology's, by placement)."""
        number = self.own.get(key)
        if number is None:
            number = self.own[key] = self.shared.number(
                ("held", stage, coll.placement, prefetch, gathers, parts, held, held_gathers), None)
        free, tail = from_start(start, gather_free, before, prefetch)
        ends, took, end, flying = self.shared.play((number, free, tail), lambda: _kept(held_blocks(
            gathers, parts, held, 0.0, free, list(tail), prefetch, lambda a, b: coll.factor(stage, a, b), held_gathers)))
        return HeldPlay([start + x for x in ends], list(took), start + end, [(start + a, start + b) for a, b in flying])

    def spans(self, key: tuple, plays: tuple[PricedBlock, ...], gathers: tuple[float, ...], start: float,
              gather_free: float, before: Sequence[float], prefetch: int, scale: tuple[float, ...]) -> Played:
        """:func:`spans_from_start`, kept."""
        number = self.own.get(key)
        if number is None:
            content = tuple((id(b.play), b.seconds, b.buckets, b.merges, b.held) for b in plays)
            number = self.own[key] = self.shared.number(("spans", content, gathers, prefetch, scale),
                                                        tuple(b.play for b in plays))
        free, tail = from_start(start, gather_free, before, prefetch)
        return _moved(self.shared.play((number, free, tail),
                                       lambda: _kept(play_blocks(plays, gathers, 0.0, free, tail, prefetch, scale))),
                      start)


def from_start(start: float, gather_free: float, before: Sequence[float], prefetch: int
               ) -> tuple[float, tuple[float, ...]]:
    """(``gather_free`` from ``start``, the last ``prefetch + 1`` of ``before`` from ``start``, led by time 0's
    (``-start``) where ``before`` has fewer): all the blocks' play reads of the stage's earlier times."""
    tail = before[len(before) - 1 - prefetch:] if len(before) > prefetch else before
    return gather_free - start, (*((-start,) * (prefetch + 1 - len(tail))), *(x - start for x in tail))


def spans_from_start(plays: tuple[PricedBlock, ...], gathers: tuple[float, ...], start: float, gather_free: float,
                     before: Sequence[float], prefetch: int, scale: tuple[float, ...]) -> Played:
    """testbed.explore.span_times.play_blocks of the arguments played from ``start`` (module docstring)."""
    free, tail = from_start(start, gather_free, before, prefetch)
    return _moved(play_blocks(plays, gathers, 0.0, free, tail, prefetch, scale), start)


def _moved(hit: tuple, start: float) -> Played:
    """A play from time 0 (a Played, or as :func:`_kept` keeps it), every time of it moved by ``start``."""
    starts, ends, dones, end, flying, releases = hit
    return Played([start + x for x in starts], [start + x for x in ends], [start + x for x in dones], start + end,
                  [(start + a, start + b) for a, b in flying], [(start + at, x) for at, x in releases])


def _kept(played: tuple) -> tuple:
    """A play (HeldPlay, Played) as kept: a plain tuple of tuples, which the cyclic collector stops tracking."""
    return tuple(tuple(x) if isinstance(x, list) else x for x in played)
