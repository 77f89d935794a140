"""The analytic tier's fsdp blocks played span by span: testbed.sim.step.span_order's plays (the ones the task graph
builds its tasks from, testbed.sim.graph.span_play), each item priced as the task graph prices its task
(:func:`priced_plays`) and each block timed on its compute and tensor streams (:func:`play_blocks`).

Where an action's blocks are so played, its tensor collectives sit among its blocks (the action has none after
its compute), its blocks are done for the next gathers once their last span's collectives are, and its gradient
buckets leave as the play releases them (its weight gradients held for the bucket that reads them).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, NamedTuple

from testbed.model.gemm import scaled
from testbed.sim.price.compute import compute_seconds
from testbed.sim.step.chunk_facts import ActionWork, ChunkFacts
from testbed.sim.step.span_order import BlockPlay, span_kernels, time_block
from testbed.sim.graph.span_play import action_plays
from testbed.sim.step.step_rules import held_stream

if TYPE_CHECKING:
    from testbed.explore.prices import StepPrices

__all__ = ["PricedBlock", "priced_plays", "played_computes", "play_blocks"]


class PricedBlock(NamedTuple):
    """One block's play, each item's seconds (a bucket item's: those of its reductions held with the compute,
    testbed.sim.step.step_rules.held_stream), each bucket item's reductions' seconds on the grad stream, the block's
    compute seconds, each of its merged gathers' seconds (ChunkFacts.gather_sizes), and which of them are held with
    the compute."""

    play: BlockPlay
    seconds: tuple[float, ...]
    buckets: tuple[float, ...]
    compute: float
    merges: tuple[float, ...] = ()
    held: tuple[bool, ...] = ()


def priced_plays(step: StepPrices, s: int, chunk: ChunkFacts, work: ActionWork, pieces: int, reduce: bool,
                 accumulate: bool = False, spans: dict | None = None) -> tuple[PricedBlock, ...]:
    """Each block of an action's play (testbed.sim.graph.span_play.action_plays; empty: not played by spans), priced:
    a compute item as testbed.sim.graph.span_play's ``_span`` prices its task (a roofline of its matmuls and its bytes,
    its FLOPs' share of its block's kernels, its share of the block's replicated and split bytes), a tensor item
    its collectives one after another, a bucket item its reductions (``reduce``: the action releases them;
    ``accumulate``: as an earlier microbatch's reduce-scatters into the sharded accumulator). ``spans``: the memo
    of the compute items' seconds and of the action's plays (:func:`played_computes`'), one per action and
    ``pieces``."""
    facts = step.facts
    spans = {} if spans is None else spans
    plays = _action_plays(step, chunk, work, pieces, reduce, spans)
    if not plays:
        return ()
    sizes = chunk.gather_sizes(work.kind) if facts.params_ways > 1 else ()
    ops = chunk.gather_ops(work.kind) if sizes else ()
    time, axes = step.coll.time, facts.params_axes
    out = []
    priced = _span_prices(step, chunk, work, pieces, spans)
    for k, play in enumerate(plays):
        seconds, buckets = [], []
        for item in play.items:
            nbytes = 0.0
            if item.stream == "compute":
                seconds.append(priced(k, item))
            elif item.stream == "tensor":
                seconds.append(step._tensor_seconds(s, item.transfers))
            else:
                j, lo, hi = item.bucket
                if accumulate:
                    x = step._accumulated(s, chunk, chunk.bucket(pieces, j)[lo:hi])
                    held = held_stream(facts, facts.accumulate_op, "grad") == "compute"
                    seconds.append(x if held else 0.0)
                    nbytes = 0.0 if held else x
                else:
                    reduced = [step._reduce(s, chunk.reduced.last * f, chunk.special(f, facts.reduce_bytes), n, op=op)
                               for f, n, op in chunk.bucket(pieces, j)[lo:hi]]
                    seconds.append(sum(r.held for r in reduced))
                    nbytes = sum(r.seconds for r in reduced)
            buckets.append(nbytes)
        compute = sum(x for x, item in zip(seconds, play.items) if item.stream == "compute")
        merges = tuple(time(op, axes, s, n) for n, op in zip(sizes[k], ops[k])) if k < len(sizes) else ()
        held = tuple(held_stream(facts, op, "gather") == "compute" for op in ops[k]) if k < len(sizes) else ()
        out.append(PricedBlock(play, tuple(seconds), tuple(buckets), compute, merges, held))
    return tuple(out)


def played_computes(step: StepPrices, s: int, chunk: ChunkFacts, work: ActionWork, pieces: int, reduce: bool,
                    accumulate: bool = False, spans: dict | None = None) -> tuple[float, ...]:
    """Each block's compute seconds of :func:`priced_plays`' play (its PricedBlock.compute, to the bit) without
    pricing its collectives (empty: not played by spans); ``spans``: as :func:`priced_plays`'."""
    spans = {} if spans is None else spans
    plays = _action_plays(step, chunk, work, pieces, reduce, spans)
    if not plays:
        return ()
    priced = _span_prices(step, chunk, work, pieces, spans)
    return tuple(sum(priced(k, item) for item in play.items if item.stream == "compute")
                 for k, play in enumerate(plays))


def _action_plays(step: StepPrices, chunk: ChunkFacts, work: ActionWork, pieces: int, reduce: bool, spans: dict
                  ) -> tuple[BlockPlay, ...]:
    """testbed.sim.graph.span_play.action_plays of the action, memoized in ``spans`` (one per action and ``pieces``;
    under a key of its own beside the compute items'): its pricing and its floor read it both."""
    key = ("plays", reduce)
    hit = spans.get(key)
    if hit is None:
        facts = step.facts
        hit = spans[key] = action_plays(chunk, work, pieces, facts.gathers("B"), facts.plan.sequence_parallel, reduce)
    return hit


def _span_prices(step: StepPrices, chunk: ChunkFacts, work: ActionWork, pieces: int, spans: dict):
    """A compute item's seconds (block ``k``'s ``item``), as testbed.sim.graph.span_play's ``_span`` prices its task,
    memoized in ``spans`` by what it is priced from (the layers' are alike)."""
    own = chunk.block_shares(work.kind, pieces)
    flops, _, replicated, split = work.work
    kernels, tensor_bytes = chunk.kernels // pieces, chunk.cost.tensor_bytes

    def priced(k: int, item) -> float:
        part = own[k][0]
        j, share = item.gemms
        key = (id(own[j][1]), share, part, item.flops, item.nbytes, item.passes)
        x = spans.get(key)
        if x is None:
            n = span_kernels(kernels, item.flops, flops * part)
            x = spans[key] = compute_seconds(step.topology, step.dtype, item.flops, item.nbytes, n,
                                             replicated * part * item.passes, split * part * item.passes,
                                             tensor_bytes, scaled(own[j][1], share), ((1.0, item.nbytes),))
        return x
    return priced


class Played(NamedTuple):
    """Blocks played: when each starts and ends (what the next block waits for), when each is done (its weights
    freed), when the last gather ends, when each gather is in flight, and each bucket release (when, seconds)."""

    starts: list[float]
    ends: list[float]
    dones: list[float]
    gather_end: float
    flying: list[tuple[float, float]]
    releases: list[tuple[float, float]]


def play_blocks(plays: tuple[PricedBlock, ...], gathers: tuple[float, ...], start: float, gather_free: float,
                before: list[float], prefetch: int, scale: tuple[float, ...]) -> Played:
    """The blocks of ``plays`` timed (testbed.explore.play's ``_blocks`` for blocks played by spans): block
    ``i``'s gather (``gathers``) after the previous one and once the block testbed.sim.step.step_rules.gather_after names
    is done (``before``: the stage's previous gathering action's), and the unlinked last layer's once the head's
    input gradient is summed (testbed.sim.step.span_order's ``waits``); each span of the block once what the previous
    block leaves (from ``start``) and the merged gathers it reads are done (each merge landing in its share of the
    block's gather: testbed.sim.step.span_order), its compute items ``scale`` times as long. A block's merges the
    compiler runs blocking (PricedBlock.held) run on the compute stream once it and the gather's wait are done,
    before the block's compute (testbed.sim.step.step_rules.held_stream)."""
    gather_end, compute, tensor = gather_free, start, start
    starts, ends, dones, flying, releases, summed = [], [], [], [], [], []
    previous, back = start, len(before) - 1 - prefetch
    for i, (g, block) in enumerate(zip(gathers, plays)):
        j = i - 1 - prefetch  # (gather_after inlined)
        after = (dones[j] if j >= 0 else before[back + i] if back + i >= 0 else None) or 0.0
        play = block.play
        if play.waits >= 0 and plays[play.waits].play.summed >= 0:  # the unlinked last layer's, after the head's
            after = max(after, summed[play.waits])  # summed input gradient
        total = sum(block.merges)  # each merge lands in its share of the block's gather (g: with a barrier's wait)
        if True in block.held:  # those the compiler runs blocking: on the compute stream before the block
            held = sum(x for x, h in zip(block.merges, block.held) if h) * g / total
            begin = max(gather_end, after)
            gather_end = begin + g - held
            compute = max(compute, previous, after) + held
            flying.append((begin, gather_end))
            free = itertools.accumulate((begin, *(0.0 if h else x * g / total for x, h in zip(block.merges,
                                                                                               block.held))))
            merges = tuple(compute if h else at for at, h in zip(tuple(free)[1:], block.held))
            landed = max(gather_end, compute)
        else:
            begin = max(gather_end, after)
            gather_end = begin + g
            flying.append((begin, gather_end))
            merges = tuple(itertools.accumulate((begin, *(x * g / total for x in block.merges))))[1:] if total else ()
            landed = gather_end
        t0 = landed if landed > previous else previous
        seconds = block.seconds if scale[i] == 1.0 else tuple(x * scale[i] if item.stream == "compute" else x
                                                               for x, item in zip(block.seconds, play.items))
        end, done, compute, tensor, out, first, sums = time_block(play, seconds, t0, previous, merges,
                                                                  landed, compute, tensor)
        summed.append(sums)
        starts.append(first if first < t0 else t0)
        ends.append(end)
        dones.append(done)
        if out:
            releases += [(at, block.buckets[idx]) for idx, at in out]
        previous = end
    return Played(starts, ends, dones, gather_end, flying, releases)
