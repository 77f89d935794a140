"""testbed.sim.step.span_order.time_block reads a block's play through its compiled slots (each item's stream and
the slots of what it waits for): the times it returns are those of the play read item by item as its contract
states (:func:`_reference`, each dependency resolved one at a time), to the bit, on random plays (hypothesis) and
on the plays of a real fsdp plan."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.sim.step.span_order import MERGED, START, WAITING, BlockPlay, Item, merge_of, merged, time_block


def _reference(play: BlockPlay, seconds, start, previous, merges, gathered, compute, tensor):
    """time_block's contract, read item by item: each dependency resolved as its docstring states."""
    ends, releases, first = [], [], None

    def when(d: int) -> float:
        if d >= 0:
            return ends[d]
        if d == START:
            return start
        if d == WAITING:
            return gathered
        m = merge_of(d)
        return max(previous, merges[m] if m < len(merges) else gathered) if m >= 0 else previous
    for item, s in zip(play.items, seconds):
        at = max((when(d) for d in item.deps), default=start)
        if item.stream == "compute":
            at = compute if compute > at else at
            compute = at + s
            first = at if first is None else first
        elif item.stream == "tensor":
            at = tensor if tensor > at else at
            tensor = at + s
        else:
            if s:
                at = compute if compute > at else at
                compute = at + s
            releases.append((len(ends), at))
        ends.append(at + s)
    return (max(when(d) for d in play.after), when(play.done[-1]), compute, tensor, releases,
            start if first is None else first, ends[play.summed] if play.summed >= 0 else 0.0)


_TIME = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)
_TOKENS = (START, WAITING, MERGED, merged(0), merged(1), merged(2))


@st.composite
def _plays(draw):
    """A random block play: items on the three streams, each waiting for earlier items and tokens."""
    n = draw(st.integers(1, 8))
    items = []
    for i in range(n):
        deps = draw(st.lists(st.sampled_from(_TOKENS + tuple(range(i))), max_size=3, unique=True))
        stream = draw(st.sampled_from(("compute", "tensor", "buckets")))
        items.append(Item(stream, f".{i}", tuple(deps)))
    pick = st.sampled_from((WAITING, *range(n)))
    after = tuple(draw(st.lists(pick, min_size=1, max_size=3)))
    done = tuple(draw(st.lists(pick, min_size=1, max_size=2)))
    summed = draw(st.integers(-1, n - 1))
    return BlockPlay(tuple(items), after, done, 0, summed)


@settings(max_examples=300, deadline=None)
@given(play=_plays(), data=st.data())
def test_time_block_is_its_play_read_item_by_item(play: BlockPlay, data) -> None:
    seconds = tuple(data.draw(st.lists(_TIME, min_size=len(play.items), max_size=len(play.items))))
    merges = tuple(data.draw(st.lists(_TIME, max_size=3)))
    start, previous, gathered, compute, tensor = (data.draw(_TIME) for _ in range(5))
    args = (seconds, start, previous, merges, gathered, compute, tensor)
    assert time_block(play, *args) == _reference(play, *args)
    assert time_block(play, *args) == _reference(play, *args)  # (its compiled slots memoized)


def test_time_block_equals_its_reading_on_a_real_fsdp_plan() -> None:
    """Every block of a traced-shape fsdp x tensor sequence-parallel plan's forward and backward plays
    (testbed.sim.graph.span_play.action_plays), timed at staggered times, as the reference reads them."""
    from testbed.sim.graph.span_play import action_plays
    from helpers import merging_tpu
    from test_span_gathers import _chunk, _plan

    chunk = _chunk(_plan(), merging_tpu())
    played = 0
    for work in chunk.actions:
        plays = action_plays(chunk, work, chunk.blocks, True, True, work.kind == "B")
        for k, play in enumerate(plays):
            seconds = tuple(0.1 * (j + 1) + 0.01 * k for j in range(len(play.items)))
            args = (seconds, 1.0 + k, 0.5 + k, (0.7 + k, 1.3 + k), 1.2 + k, 0.9 + k, 0.3 + k)
            assert time_block(play, *args) == _reference(play, *args)
            played += 1
    assert played >= 4
