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


def held_blocks(gathers: Sequence[Sequence[Part]], parts: Sequence[float], held: Sequence[Sequence[Part]],
                start: float, gather_free: float, before: list[float], prefetch: int,
                factor: Callable[[Transfer, Transfer], float], held_gathers: Sequence[Sequence[Part]] = ()
                ) -> HeldPlay:
    """The blocks (module docstring): block ``i``'s merged ``gathers`` on the gather stream, and on the compute stream
    its ``held_gathers`` (empty: none), its compute ``parts[i]`` from ``start`` on once its gathers are done, then its
    ``held`` reductions; the gathers from ``gather_free`` on (``before``, ``prefetch``: gather_after's);
    ``factor(a, b)``: the share of their speed two transfers in flight together run at. Block ``k``'s gathers start
    once the stream is free and the block testbed.sim.step.step_rules.gather_after names has computed (inlined: the
    hottest loop of the analytic tier on a TPU)."""
    n, inf, ends, took = len(parts), math.inf, [], []
    own = held_gathers or ((),) * n
    # the gather stream: its block and merge, the one in flight's work left (None: none), when it is free, and when
    # each block's gathers began and ended (as _Gathers)
    block, merge, gleft, gfree, begun, done, blocks = 0, 0, None, gather_free, [], [], len(gathers)
    # phase 0: waits, 1: computes, 2: held reductions, 3: held gathers; h: the held collective in flight
    t, i, phase, left, h, wake = min(start, gather_free), 0, 0, 0.0, 0, start
    back, rates = len(before) - 1 - prefetch, {}
    while i < n:
        pending = inf
        if gleft is None and block < blocks:  # the stream idle: its next gather starts, or when it may
            block, merge, gleft, gfree, pending = _begin(gathers, block, merge, gfree, t, ends, before, back,
                                                         prefetch, begun, done)
        if phase == 0:
            j = i - 1 - prefetch  # known: block i - 1 - prefetch has computed
            wake = max(start, (ends[j] if j >= 0 else before[back + i] if back + i >= 0 else None) or 0.0)
            if t >= wake and h < len(own[i]):
                phase, left = 3, own[i][h][0]
            elif t >= wake and len(done) > i:
                phase, left = 1, parts[i]
        key = held[i][h][1] if phase == 2 else own[i][h][1] if phase == 3 else None
        other = gathers[block][merge][1] if gleft is not None else None
        if key is None or other is None:
            rate = 1.0
        elif (rate := rates.get((key, other))) is None:
            rate = rates[(key, other)] = factor(key, other)
        dt = min(pending - t, wake - t if phase == 0 and t < wake else inf,
                 left / rate if phase else inf, gleft / rate if gleft is not None else inf)
        if not math.isfinite(dt):  # the compute waits for a gather still in flight
            raise RuntimeError("held_blocks: nothing left to play")  # unreachable: a gather is in flight or pending
        t += dt
        if gleft is not None:  # _Gathers.advance
            gleft -= dt * rate
            if gleft <= _DONE:
                gleft, merge = None, merge + 1
                if merge == len(gathers[block]):
                    done.append(t)
                    gfree, block, merge = t, block + 1, 0
        if phase:
            left -= dt * rate
            if left <= _DONE:
                phase, i, h, left = _next(phase, i, h, left, t, own, held, ends, took)
    return HeldPlay(ends, took, done[-1] if done else gather_free, list(zip(begun, done)))


def _begin(gathers: Sequence[Sequence[Part]], block: int, merge: int, gfree: float, t: float, ends: list[float],
           before: list[float], back: int, prefetch: int, begun: list[float], done: list[float]
           ) -> tuple[int, int, float | None, float, float]:
    """The idle gather stream at ``t`` (:class:`_Gathers`' begin, inlined state): (block, merge, the work left of the
    gather it starts or None, when the stream is free, when the next may start: inf where it started one or waits
    for a block not yet computed); a block whose merges are all done is closed on the way."""
    while block < len(gathers):
        if merge == 0:
            j = block - 1 - prefetch
            if j >= len(ends):
                break
            at = max(gfree, (ends[j] if j >= 0 else before[back + block] if back + block >= 0 else None) or 0.0)
            if at > t:
                return block, merge, None, gfree, at
            begun.append(t)
        merges = gathers[block]
        if merge < len(merges):
            return block, merge, merges[merge][0], gfree, math.inf
        done.append(t)
        gfree, block, merge = t, block + 1, 0
    return block, merge, None, gfree, math.inf


def _next(phase: int, i: int, h: int, left: float, t: float, own: Sequence[Sequence[Part]],
          held: Sequence[Sequence[Part]], ends: list[float], took: list[float]) -> tuple[int, int, int, float]:
    """:func:`held_blocks`' compute stream at ``t``, its work in flight done: (phase, block, held collective, work
    left) next, each block's end and held reductions' seconds added to ``ends`` and ``took`` as they are done."""
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
    return phase, i, h, left
