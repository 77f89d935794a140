"""The analytic tier's blocks of an action that gathers block by block and whose gradient reductions or parameter
gathers the compiler runs blocking (testbed.sim.step.step_rules.held_stream: XLA:TPU's all-reduces, v5p's all-gathers
too), played as the task graph plays them: on the compute stream each block's held gathers run once the block
testbed.sim.step.step_rules.gather_after names has computed, then the block computes once its gathers on the gather
stream are done too, then its held reductions run; each block's other gathers run on their own stream once that block
has computed. A held collective and the gather in flight beside it share their links as the task graph's engine shares
them (testbed.sim.price.contention.shared_factor, asked through ``factor``): both run at that share of their speed
while both are in flight, so the held collective, which the next compute waits for, ends later by what the gather
beside it takes of the links.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from testbed.explore.stage_collectives import Transfer
from testbed.sim.step.step_rules import gather_after

__all__ = ["Part", "HeldPlay", "held_blocks"]

#: One collective (or a wait) in a stream: its standalone seconds and what it moves (None: nothing on the links).
Part = tuple[float, Transfer | None]

_DONE = 1e-15  # seconds of work left below which a part is done (rounding of the fluid steps)


class HeldPlay(NamedTuple):
    """Blocks played: when each block's compute ends (its weights free), the seconds its held reductions took, when
    the last gather ends, and each block's gather in flight (begin, end)."""

    ends: list[float]
    held: list[float]
    gather_end: float
    flying: list[tuple[float, float]]


class _Gathers:
    """The gather stream: block ``block``'s merged gathers (``gathers``), the one in flight (``left`` seconds of its
    work, None: none), when the stream is free and when each block's gathers began and ended."""

    def __init__(self, gathers: Sequence[Sequence[Part]], free: float) -> None:
        self.gathers, self.free, self.block, self.merge, self.left = gathers, free, 0, 0, None
        self.begun: list[float] = []
        self.done: list[float] = []

    def key(self) -> Transfer | None:
        return self.gathers[self.block][self.merge][1] if self.left is not None else None

    def begin(self, t: float, after: Callable[[int], float | None]) -> float:
        """Starts the next gather at ``t`` if it may (``after(block)``: what the block's gathers wait for, None: not
        known yet); returns when it may start instead (inf: not known, or one is in flight)."""
        while self.left is None and self.block < len(self.gathers):
            if self.merge == 0:
                at = after(self.block)
                if at is None:
                    return math.inf
                at = max(self.free, at)
                if at > t:
                    return at
                self.begun.append(t)
            merges = self.gathers[self.block]
            if self.merge < len(merges):
                self.left = merges[self.merge][0]
                return math.inf
            self._block_done(t)
        return math.inf

    def advance(self, t: float, dt: float, rate: float) -> bool:
        """``dt`` seconds at ``rate`` pass, now ``t``; True when the gather in flight is done."""
        if self.left is None:
            return False
        self.left -= dt * rate
        if self.left > _DONE:
            return False
        self.left, self.merge = None, self.merge + 1
        if self.merge == len(self.gathers[self.block]):
            self._block_done(t)
        return True

    def _block_done(self, t: float) -> None:
        self.done.append(t)
        self.free, self.block, self.merge = t, self.block + 1, 0


def held_blocks(gathers: Sequence[Sequence[Part]], parts: Sequence[float], held: Sequence[Sequence[Part]],
                start: float, gather_free: float, before: list[float], prefetch: int,
                factor: Callable[[Transfer, Transfer], float], held_gathers: Sequence[Sequence[Part]] = ()
                ) -> HeldPlay:
    """The blocks (module docstring): block ``i``'s merged ``gathers`` on the gather stream, and on the compute stream
    its ``held_gathers`` (empty: none), its compute ``parts[i]`` from ``start`` on once its gathers are done, then its
    ``held`` reductions; the gathers from ``gather_free`` on (``before``, ``prefetch``: gather_after's);
    ``factor(a, b)``: the share of their speed two transfers in flight together run at."""
    n = len(parts)
    g, ends, took = _Gathers(gathers, gather_free), [], []
    own = held_gathers or ((),) * n
    # phase 0: waits, 1: computes, 2: held reductions, 3: held gathers; h: the held collective in flight
    t, i, phase, left, h, wake = min(start, gather_free), 0, 0, 0.0, 0, start

    def after(k: int) -> float | None:
        return gather_after(k, prefetch, ends, before) or 0.0 if k - 1 - prefetch < len(ends) else None
    while i < n:
        pending = g.begin(t, after)
        if phase == 0:
            wake = max(start, after(i) or 0.0)  # known: block i - 1 - prefetch has computed
            if t >= wake and h < len(own[i]):
                phase, left = 3, own[i][h][0]
            elif t >= wake and len(g.done) > i:
                phase, left = 1, parts[i]
        key = held[i][h][1] if phase == 2 else own[i][h][1] if phase == 3 else None
        other = g.key()
        rate = factor(key, other) if key is not None and other is not None else 1.0
        dt = min(pending - t, wake - t if phase == 0 and t < wake else math.inf,
                 left / rate if phase else math.inf, g.left / rate if g.left is not None else math.inf)
        if not math.isfinite(dt):  # the compute waits for a gather still in flight
            raise RuntimeError("held_blocks: nothing left to play")  # unreachable: a gather is in flight or pending
        t += dt
        g.advance(t, dt, rate)
        if phase:
            left -= dt * rate
            while phase and left <= _DONE:
                if phase == 1:
                    ends.append(t)
                    phase, h = 2, 0
                else:
                    h += 1
                queue = own[i] if phase == 3 else held[i]
                if h < len(queue):
                    left = queue[h][0]
                elif phase == 3:  # the block's held gathers done: it waits for those on the gather stream
                    phase = 0
                else:
                    took.append(t - ends[i])
                    phase, i, h = 0, i + 1, 0
    flying = list(zip(g.begun, g.done))
    return HeldPlay(ends, took, g.done[-1] if g.done else gather_free, flying)
