"""XLA:TPU's heap of temporaries: where its buffer assignment places them, and what ``memory_analysis()`` reports.

XLA's buffer assignment places a program's temporaries in one preallocated allocation whose size is the highest
offset a buffer reaches (``xla/service/buffer_assignment.cc``, the ``preallocated-temp`` allocation); its heap
simulator records the heap's fragmentation as that size less the most bytes live at once
(``xla/service/heap_simulator.cc``: ``fragmentation_size = heap_size - no_frag_result.heap_size``, the
``NoFragmentationStatsHeap`` being the running sum of live sizes). libtpu (0.0.42) reports ``temp`` as the heap
plus that fragmentation (benchmarks/xla_tpu_heap.py: within 1% of ``temp`` on 33 of 37 recorded compiles),
where open-source PJRT sums the allocations' sizes (``xla/pjrt/pjrt_executable.cc``).

Where the buffers go: placing each buffer in schedule order (larger first at one instruction) at the smallest
free gap among the buffers then live that holds it, else just above the highest of them (:func:`place`), over
the recorded compiles' dumped live ranges (benchmarks/xla_tpu_heap.py) gives XLA:TPU's heap more nearly than XLA's
open-source default, decreasing size regardless of time (``GlobalDecreasingSizeBestFitHeap``), which packs the
same buffers tighter than XLA:TPU does; it reproduces most of the fsdp steps' fragmentation (a freed gap a few MB
too small for the next layer-sized buffer) but not all of the data-parallel steps'. testbed.model.step_heap places
the memory model's own buffers of a step this way. A buffer of no bytes takes no room.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

__all__ = ["Buffer", "Heap", "place", "live_peak", "heap"]


@dataclass(frozen=True, slots=True)
class Buffer:
    """One temporary: live from scheduled instruction ``start`` to ``end`` (both included), ``size`` bytes."""

    start: int
    end: int
    size: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"a buffer is live from start to end >= start >= 0, got {self.start}..{self.end}")
        if self.size < 0:
            raise ValueError(f"a buffer's size is >= 0 bytes, got {self.size}")


@dataclass(frozen=True, slots=True)
class Heap:
    """A placement's heap: its size (the highest offset reached) and the most bytes live at once."""

    size: int
    live: int

    def __post_init__(self) -> None:
        if not 0 <= self.live <= self.size:
            raise ValueError(f"a heap holds 0 <= live <= size bytes, got live {self.live}, size {self.size}")

    @property
    def fragmentation(self) -> int:
        """XLA's heap simulator's fragmentation: the heap beyond the most bytes live at once."""
        return self.size - self.live

    @property
    def reported_temp(self) -> int:
        """What libtpu's ``memory_analysis()`` reports as ``temp``: the heap plus its fragmentation."""
        return self.size + self.fragmentation


class _Gaps:
    """The free gaps below the top of a heap being placed, by offset (to join a freed buffer with its neighbours)
    and by size (the smallest that holds a buffer, the lowest on a tie, found by bisection)."""

    def __init__(self) -> None:
        self.offsets: list[int] = []  # sorted
        self.ends: dict[int, int] = {}  # offset -> end
        self.sizes: list[tuple[int, int]] = []  # sorted (size, offset)

    def _add(self, offset: int, end: int) -> None:
        bisect.insort(self.offsets, offset)
        self.ends[offset] = end
        bisect.insort(self.sizes, (end - offset, offset))

    def _remove(self, offset: int) -> int:
        end = self.ends.pop(offset)
        del self.offsets[bisect.bisect_left(self.offsets, offset)]
        del self.sizes[bisect.bisect_left(self.sizes, (end - offset, offset))]
        return end

    def take(self, size: int) -> int | None:
        """The offset of the smallest gap that holds ``size`` bytes (the lowest on a tie), its rest left free;
        None when none does."""
        k = bisect.bisect_left(self.sizes, (size, -1))
        if k == len(self.sizes):
            return None
        offset = self.sizes[k][1]
        end = self._remove(offset)
        if end > offset + size:
            self._add(offset + size, end)
        return offset

    def free(self, offset: int, end: int, top: int) -> int:
        """Free ``[offset, end)``: joined with the gaps it touches, or with the space above ``top`` when it reaches
        it; the new top."""
        if end in self.ends:  # the gap just above
            end = self._remove(end)
        below = bisect.bisect_left(self.offsets, offset) - 1
        if below >= 0 and self.ends[self.offsets[below]] == offset:  # the gap just below
            lower = self.offsets[below]
            self._remove(lower)
            offset = lower
        if end >= top:
            return offset
        self._add(offset, end)
        return top


def place(buffers: tuple[Buffer, ...] | list[Buffer]) -> tuple[int, ...]:
    """Each buffer's offset, placed in schedule order (by start, larger first) at the smallest gap among the
    buffers live at its start that holds it (the lowest on a tie), else just above the highest of them: the
    buffers whose last instruction is before its start freed first, their gaps joined (:class:`_Gaps`)."""
    order = sorted(range(len(buffers)), key=lambda i: (buffers[i].start, -buffers[i].size, i))
    offsets = [0] * len(buffers)
    gaps = _Gaps()
    ends: list[tuple[int, int]] = []  # (last instruction, buffer) of the live buffers, a heap
    top = 0
    for i in order:
        buffer = buffers[i]
        while ends and ends[0][0] < buffer.start:
            j = heapq.heappop(ends)[1]
            top = gaps.free(offsets[j], offsets[j] + buffers[j].size, top)
        if not buffer.size:
            offsets[i] = top
            continue
        at = gaps.take(buffer.size)
        if at is None:
            at, top = top, top + buffer.size
        offsets[i] = at
        heapq.heappush(ends, (buffer.end, i))
    return tuple(offsets)


def live_peak(buffers: tuple[Buffer, ...] | list[Buffer]) -> int:
    """The most bytes live at one scheduled instruction."""
    changes: dict[int, int] = {}
    for b in buffers:
        changes[b.start] = changes.get(b.start, 0) + b.size
        changes[b.end + 1] = changes.get(b.end + 1, 0) - b.size
    peak = running = 0
    for step in sorted(changes):
        running += changes[step]
        peak = max(peak, running)
    return peak


def heap(buffers: tuple[Buffer, ...] | list[Buffer]) -> Heap:
    """The heap :func:`place` makes of ``buffers``: its size and their live peak."""
    offsets = place(buffers)
    return Heap(size=max((o + b.size for o, b in zip(offsets, buffers)), default=0), live=live_peak(buffers))
