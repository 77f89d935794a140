"""testbed.model.heap: XLA:TPU's placement of temporaries in schedule order, its heap and what libtpu reports.

Checked against the recorded compiles' buffer assignments (benchmarks/xla_tpu_heap.json) in
tests/test_xla_tpu_records.py; these tests hold what the placement does on small cases worked by hand.
"""

from __future__ import annotations

import pytest

from testbed.model.heap import Buffer, Heap, heap, live_peak, place


def test_buffers_apart_in_time_share_one_offset():
    held = [Buffer(0, 4, 100), Buffer(5, 9, 100)]
    assert place(held) == (0, 0)
    assert heap(held) == Heap(size=100, live=100)


def test_the_larger_of_two_buffers_starting_together_goes_first():
    assert place([Buffer(0, 3, 10), Buffer(0, 3, 30)]) == (30, 0)


def test_a_freed_gap_too_small_for_the_next_buffer_is_fragmentation():
    """A (100 B) and B (50 B) start together: A at 0, B above it. A is freed; C (120 B) does not fit A's 100-byte
    gap, so it goes above B: a 270-byte heap whose live peak is 170 (B and C), 100 bytes of fragmentation, and
    libtpu reports 370 bytes of temporaries."""
    held = [Buffer(0, 2, 100), Buffer(0, 10, 50), Buffer(3, 10, 120)]
    assert place(held) == (0, 100, 150)
    result = heap(held)
    assert (result.size, result.live, result.fragmentation, result.reported_temp) == (270, 170, 100, 370)


def test_a_buffer_takes_the_smallest_gap_that_holds_it():
    """P stays at [0, 10); Q fills [10, 40) until R lands above it at 40; S (60 B) does not fit Q's freed 30 and
    lands at 50, T (31 B) neither and lands above S at 110. S freed: gaps of 30 B at 10 and 60 B at 50. V (40 B)
    takes the 60, then U (25 B) the 30 (the 20 left above V is too small)."""
    held = [Buffer(0, 9, 10), Buffer(1, 2, 30), Buffer(2, 9, 10), Buffer(3, 4, 60), Buffer(4, 9, 31),
            Buffer(5, 6, 25), Buffer(5, 6, 40)]
    assert place(held) == (0, 10, 40, 50, 110, 10, 50)
    assert heap(held) == Heap(size=141, live=116)


def test_live_peak_counts_an_instruction_where_two_buffers_meet():
    assert live_peak([Buffer(0, 3, 10), Buffer(3, 5, 20), Buffer(4, 9, 5)]) == 30
    assert heap([]) == Heap(size=0, live=0)


@pytest.mark.parametrize("start, end, size", [(-1, 2, 1), (3, 2, 1), (0, 1, -5)])
def test_a_buffer_out_of_range_is_refused(start, end, size):
    with pytest.raises(ValueError):
        Buffer(start, end, size)


def test_a_heap_smaller_than_its_live_bytes_is_refused():
    with pytest.raises(ValueError):
        Heap(size=10, live=20)


def test_freed_neighbours_join_into_one_gap():
    """A and B (10 B each) are freed together at instruction 3: one 20-byte gap below C, which D (20 B) fills."""
    held = [Buffer(0, 2, 10), Buffer(0, 2, 10), Buffer(0, 9, 5), Buffer(3, 9, 20)]
    assert place(held) == (0, 10, 20, 0)
    assert heap(held) == Heap(size=25, live=25)


def test_a_buffer_of_no_bytes_takes_no_room_and_a_freed_top_lowers_the_top():
    """Z (no bytes) splits no gap; B, the highest buffer, freed at 2: C (15 B) starts where B did."""
    held = [Buffer(0, 5, 10), Buffer(0, 9, 0), Buffer(0, 1, 10), Buffer(2, 9, 15)]
    offsets = place(held)
    assert (offsets[0], offsets[2], offsets[3]) == (0, 10, 10)
    assert heap(held) == Heap(size=25, live=25)
