"""The analytic tier's prices of one step: every F/B/W action of the step's facts priced on a topology by the
simulator's own cost functions, as the task graph splits it (:class:`StepPrices`, one :class:`ActionPrice` per
action). testbed.explore.play plays them, testbed.explore.play_floor bounds that play, and
testbed.explore.analytic estimates the step from it (its docstring: what each action costs).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import NamedTuple

from testbed.collectives.timing import send_time
from testbed.explore.block_memo import StepBlocks
from testbed.explore.span_times import played_computes, priced_plays
from testbed.explore.held_blocks import Part
from testbed.explore.price_reductions import Reduced, ReductionPrices, reduction_memo
from testbed.explore.stage_collectives import StageCollectives, stage_groups, tied_seconds
from testbed.model.gemm import scaled
from testbed.model.layout import chunk_layers
from testbed.model.spans import scaled_spans
from testbed.plan.spec import Axis
from testbed.sim.price.barriers import Syncs, merge
from testbed.sim.step.chunk_facts import ActionWork, ChunkFacts
from testbed.sim.price.compute import compute_seconds, plan_matmul_dtype
from testbed.sim.step.facts import StepFacts, accumulate_bytes, alike_key, bucket_share
from testbed.sim.step.moe import Piece
from testbed.sim.graph.ring import ring_action_seconds, ring_neighbours
from testbed.sim.step.step_rules import (GatherMode, Gradients, gather_mode, gradients, held_stream, runs_serially,
                                    serial_host)
from testbed.sim.step.step_rules import pieces as step_pieces
from testbed.topology import Topology

__all__ = ["StepPrices", "ActionPrice", "Least", "PricedSend", "Reduced"]

class PricedSend(NamedTuple):
    """One send of an action, priced: its destination stage, its seconds on the sender's pipe stream, and the
    receivers' all-gather seconds of a split send (StepFacts.scatter_sends; 0: a whole send)."""

    dst: int
    seconds: float
    gather: float


class ActionPrice(NamedTuple):
    """One F/B/W action of one chunk, priced: its compute seconds (all of it, and one gradient bucket's piece
    of the chunk's last backward, in ``pieces``), blocking tensor (and exposed all-to-all and ring) seconds,
    the gather it waits for, one bucket's reduction, an earlier microbatch's reduce-scatter, its sends
    (:class:`PricedSend`), the accumulator's add, and its barriers (testbed.sim.price.barriers: of an earlier microbatch,
    of the last; then the bucket reduction's own). ``hidden``: the part of ``tensor`` that runs
    beside the compute (``runtime.tp_comm_overlap``: the tensor collectives; 0 without)."""

    compute: float
    tensor: float
    gather: float
    piece: float
    pieces: int
    bucket: float
    scatter: float
    sends: tuple[PricedSend, ...]
    acc: float
    syncs: tuple[Syncs, Syncs]
    bucket_syncs: Syncs
    hidden: float = 0.0
    blocks: int = 1
    overlap: tuple[tuple[float, float, float], ...] = ()
    block_gathers: tuple[float, ...] = ()  # each block's gather seconds (empty: ``gather`` in equal shares)
    bucket_each: tuple[float, ...] = ()  # each bucket's reduction, of its own count of collectives (empty: ``bucket``)
    send_s: float = 0.0  # the sends' seconds together (read by every play of the action)
    parts: tuple[float, ...] = ()  # each block's (or bucket piece's) compute where they differ (empty: equal shares)
    early: float = 0.0  # the sequence-replicated gradients' sum as the compute ends (grad_bytes.summed_in_the_step)
    plays: tuple = ()  # its blocks played span by span (testbed.explore.span_times; empty: not so played)
    plays_last: tuple = ()  # the same, of the microbatch that releases the chunk's gradient buckets
    plays_scatter: tuple = ()  # the same, of an earlier microbatch reduce-scattering bucket by bucket (loop_kept)
    scatter_each: tuple[float, ...] = ()  # an earlier microbatch's reduce-scatter bucket by bucket (grad_bytes.loop_kept)
    chain: bool = False  # an MoE chain (testbed.sim.step.step_rules.gradients reads it)
    ring_hidden: float = 0.0  # the ring's sends beside its compute (context parallelism: testbed.sim.graph.ring)
    bucket_held: float = 0.0  # one bucket's reduction seconds held with the compute (step_rules.held_stream)
    held_each: tuple[float, ...] = ()  # each bucket's so held where they differ (empty: ``bucket_held``)
    scatter_held: float = 0.0  # an earlier microbatch's reduce-scatter seconds held with the compute
    held_parts: tuple[tuple[Part, ...], ...] = ()  # each bucket's held collectives (testbed.explore.held_blocks)
    scatter_parts: tuple[tuple[Part, ...], ...] = ()  # each bucket's held reduce-scatters of an earlier microbatch
    gather_parts: tuple[tuple[Part, ...], ...] = ()  # each block's merged gathers on the gather stream (held_blocks)
    held_gathers: tuple[tuple[Part, ...], ...] = ()  # each block's merged gathers held with the compute (held_blocks)


class Least(NamedTuple):
    """What testbed.explore.play_floor bounds an action by, as :class:`ActionPrice` prices it: its compute
    (``compute``; each way its blocks play span by span, their compute together, in ``played``: plays, plays_last,
    plays_scatter, those it has; ``piece``, ``pieces`` and ``parts`` as the last microbatch's), ``tensor``,
    ``hidden``, the accumulator's ``acc``, and what testbed.explore.play_floor.beside_compute reads (0 on a device
    without ``comm_slowdown``, where nothing reads them)."""

    compute: float
    tensor: float
    hidden: float
    piece: float
    pieces: int
    parts: tuple[float, ...]
    acc: float
    played: tuple[float, ...]
    gather: float
    send_s: float
    bucket: float
    scatter: float
    ring_hidden: float
    chain: bool


class _Core(NamedTuple):
    """What an action's :class:`ActionPrice` and its :class:`Least` share: its compute, tensor (and hidden)
    seconds, its last microbatch's pieces, the accumulator's add, the ring's sends beside it, whether it is an MoE
    chain or a ring, its tp_comm_overlap blocks, whether the last microbatch releases gradient buckets and whether
    an earlier one reduce-scatters into the accumulator."""

    compute: float
    tensor: float
    hidden: float
    piece: float
    pieces: int
    parts: tuple[float, ...]
    acc: float
    ring_hidden: float
    chain: bool
    blocks: tuple[tuple[float, float, float], ...]
    ringed: bool
    release: bool
    scatters: bool


class _Priced(Mapping):
    """Every action's :class:`ActionPrice`, ``(stage, chunk, kind) -> price``, each priced on first use
    (StepPrices._priced): a play stopped at the search's bar reads few of them."""

    def __init__(self, step: StepPrices) -> None:
        self._step, self._done = step, {}

    def __getitem__(self, key: tuple[int, int, str]) -> ActionPrice:
        hit = self._done.get(key)
        if hit is None:
            hit = self._done[key] = self._step._priced(key)
        return hit

    def __iter__(self):
        return iter(self._step.actions)

    def __len__(self) -> int:
        return len(self._step.actions)


class StepPrices(ReductionPrices):
    """The step's facts priced on a topology: every action's :class:`ActionPrice`, and what the play reads of the
    calibration (the controller, a shared host's stragglers, programs one at a time)."""

    def __init__(self, facts: StepFacts, topology: Topology, ids) -> None:
        cal, p = topology.calibration, facts.stages
        self.facts, self.topology, self.dtype = facts, topology, plan_matmul_dtype(facts.plan, topology)
        self.coll = StageCollectives(topology, ids)
        self.controller = cal.controller
        self.skewed = cal.host if cal.host is not None and cal.host.skew_s else None  # a shared host's stragglers
        # Programs over several devices one at a time (testbed.sim.graph.program's ``serial``): each action and update
        # starts once the previous one has completed, and its end is a meeting of the stage's devices.
        self.per_stage = topology.num_devices // p
        self.serial = runs_serially(serial_host(cal), p, self.per_stage)
        self.ends = ((self.per_stage, 1.0),) if self.serial else ()
        reps = facts.representatives  # no ring: each rank its own (what the groups of one say)
        rings = [ring_neighbours(stage_groups(ids, (Axis.CONTEXT,), s), reps[s])[0] if facts.plan.mesh.context > 1
                 else (reps[s], reps[s]) for s in range(p)]
        self.tied_s = tied_seconds(topology, ids, facts.tied_bytes)
        self.shard_sum_s = tuple(self._shard_sum(s) for s in range(p))
        self.prices: Mapping[tuple[int, int, str], ActionPrice] = _Priced(self)  # each priced on first use
        self._played: dict[tuple, ActionPrice] = {}  # :meth:`played`'s memo (its prices kept: ``blocks`` keys by id)
        self.blocks = StepBlocks(topology)  # the actions' blocks played from their start (kept: block_memo)
        self._reduced = reduction_memo(topology, self.coll.placement, facts)  # :meth:`_reduce`'s
        self._sent: dict[tuple, PricedSend] = {}  # :meth:`_sends`' memo
        self._rings = rings
        # Every action (s, c, kind) -> (its chunk, its work, the first chunk of its stage alike to it,
        # testbed.sim.step.facts.alike_key, whose prices but its sends are its own), in the step's order.
        self.actions: dict[tuple[int, int, str], tuple[ChunkFacts, ActionWork, int]] = {}
        self._cores: dict[tuple[int, int, str], _Core] = {}  # :meth:`_core`'s memo, of the first alike chunks
        self._leasts: dict[tuple[int, int, str], Least] = {}  # :meth:`least`'s memo, of the first alike chunks
        self._spans: dict[tuple, dict] = {}  # the span plays and their compute items' seconds (span_times' ``spans``)
        plan, v = facts.plan, facts.virtual
        spans = chunk_layers(plan.model, p, v, plan.stage_layers)
        for s in range(p):
            alike: dict[tuple, int] = {}  # the stage's chunks alike (testbed.sim.step.facts.alike_key): priced once
            for c, chunk in enumerate(facts.chunks[s]):
                key = alike_key(plan, p, v, s, c, spans[s][c])
                for work in chunk.actions:
                    self.actions[(s, c, work.kind)] = (chunk, work, alike.setdefault((key, work.kind), c))

    def _priced(self, key: tuple[int, int, str]) -> ActionPrice:
        """The :class:`ActionPrice` of action ``key`` (``self.prices`` memoizes it): that of the first chunk alike,
        with its own sends."""
        s, c, kind = key
        chunk, work, first = self.actions[key]
        if first != c:  # all but its sends are the alike chunk's
            sends = self._sends(s, work)
            return self.prices[(s, first, kind)]._replace(sends=sends,
                                                          send_s=sum(x.seconds for x in sends) if sends else 0.0)
        gather, per_block, merges, held = 0.0, (), (), ()
        mode = gather_mode(self.facts, work)
        if mode is GatherMode.WHOLE:
            gather = self._gather_seconds(s, (chunk.moved.params, chunk.leaves), 1)
        elif mode is GatherMode.BLOCKS:
            per_block = self._block_gather_seconds(s, chunk, work.kind)
            gather = sum(per_block)
        priced = self._price(s, c, chunk, work, gather)
        if mode is GatherMode.BLOCKS:  # (held_blocks: where the compiler holds some with the compute)
            merges, held = self._block_gather_parts(s, chunk, work.kind, bool(priced.held_parts or priced.scatter_parts))
        return priced._replace(block_gathers=per_block if len(set(per_block)) > 1 else (), gather_parts=merges,
                               held_gathers=held)

    def least(self, key: tuple[int, int, str]) -> Least:
        """What testbed.explore.play_floor bounds action ``key`` by (:class:`Least`), priced without the
        collectives only a play of it reads: its compute (every way of it), tensor and, with ``device.comm_slowdown``,
        the communication beside it, each to the bit as :meth:`_priced` prices it."""
        s, c, kind = key
        chunk, work, first = self.actions[key]
        out = self._leasts.get((s, first, kind))
        if out is None:
            out = self._leasts[(s, first, kind)] = self._least(s, first, chunk, work)
        if first != c and self.topology.device.comm_slowdown:
            sends = self._sends(s, work)
            out = out._replace(send_s=sum(x.seconds for x in sends) if sends else 0.0)
        return out

    def _least(self, s: int, c: int, chunk: ChunkFacts, work: ActionWork) -> Least:
        """:meth:`least` of the first chunk alike."""
        core, facts = self._core(s, c, chunk, work), self.facts
        mode = gather_mode(facts, work)
        spans = mode is not GatherMode.NONE and not core.chain and not core.ringed
        played = tuple(sum(v) for v in ((self._played_computes(s, c, chunk, work, chunk.blocks, False),
                                         self._played_computes(s, c, chunk, work, core.pieces, True)
                                         if core.release else (),
                                         self._played_computes(s, c, chunk, work, chunk.buckets, True, True)
                                         if core.scatters and self._scatters_each(chunk, core.chain) else ())
                                        if spans else ()) if v)
        gather = bucket = scatter = send_s = 0.0
        if self.topology.device.comm_slowdown:  # what beside_compute reads
            if mode is GatherMode.WHOLE:
                gather = self._gather_seconds(s, (chunk.moved.params, chunk.leaves), 1)
            elif mode is GatherMode.BLOCKS:
                gather = sum(self._block_gather_seconds(s, chunk, work.kind))
            bucket = self._bucket(s, chunk, core.pieces)[0] if core.release else 0.0
            scatter = self._scatter(s, chunk) if core.scatters else 0.0
            sends = self._sends(s, work)
            send_s = sum(x.seconds for x in sends) if sends else 0.0
        return Least(core.compute, core.tensor, core.hidden, core.piece, core.pieces, core.parts, core.acc, played,
                     gather, send_s, bucket, scatter, core.ring_hidden, core.chain)

    def _played_computes(self, s: int, c: int, chunk: ChunkFacts, work: ActionWork, pieces: int, reduce: bool,
                         accumulate: bool = False) -> tuple[float, ...]:
        """Each block's compute seconds of the action's blocks played span by span (testbed.explore.span_times.
        played_computes; empty: not so played), its compute items' memo shared with :meth:`_plays`."""
        return played_computes(self, s, chunk, work, pieces, reduce, accumulate,
                               self._spans.setdefault((s, c, work.kind, pieces), {}))

    def _shard_sum(self, s: int) -> float:
        """Seconds of stage ``s``'s merged all-reduces of its gradient shards (StepFacts.shard_sum; 0: none), as
        testbed.sim.graph.grad_tasks.shard_sum_task issues them after the stage's last bucket."""
        sums = self.facts.shard_sum(s)
        return 0.0 if sums is None else sums.count * self.coll.time("all_reduce", sums.axes, s, sums.each_bytes)

    def played(self, s: int, c: int, kind: str, grads: Gradients) -> ActionPrice:
        """The price of chunk ``c``'s ``kind`` action on stage ``s`` as played with ``grads`` (testbed.sim.step.step_rules'
        Gradients): where its blocks are played span by span, the play it releases its gradients by (its compute their
        computes', its tensor among them), else none. Memoized: every microbatch's action reads one."""
        key = (s, c, kind, grads.release, grads.each)
        out = self._played.get(key)
        if out is None:
            priced = self.prices[(s, c, kind)]
            plays = priced.plays_last if grads.release else (priced.plays_scatter or priced.plays) if grads.each \
                else priced.plays
            if plays:  # its blocks span by span: the tensor among them
                parts = tuple(block.compute for block in plays)
                out = priced._replace(compute=sum(parts), parts=parts, tensor=0.0, hidden=0.0, plays=plays)
            else:
                out = priced._replace(plays=())
            self._played[key] = out
        return out

    def _gather_seconds(self, s: int, moved: tuple[int, int], pieces: int) -> float:
        """Seconds of the gathers of ``moved`` (elements, collectives: :meth:`ChunkFacts.gather`) in ``pieces``
        equal shares (an MoE chain's whole gather, as testbed.sim.graph.program's)."""
        elements, leaves = moved
        total, per = 0.0, elements * self.facts.param_bytes / pieces
        for count, times in Counter(bucket_share(leaves, pieces, k) for k in range(pieces)).items():
            total += times * count * self.coll.time("all_gather", self.facts.params_axes, s, per / count)
        return total

    def _block_gather_seconds(self, s: int, chunk: ChunkFacts, kind: str) -> tuple[float, ...]:
        """Each block's seconds of a ``kind`` action's gathers, each collective at its merged size
        (:meth:`ChunkFacts.gather_sizes`, as testbed.sim.graph.program's tasks)."""
        time, axes, memo = self.coll.time, self.facts.params_axes, {}
        blocks = tuple(zip(chunk.gather_sizes(kind), chunk.gather_ops(kind)))  # ops: lowered gathers all-reduces
        for block in blocks:  # the middle layers' blocks alike: each kind priced once
            if block not in memo:
                memo[block] = sum(count * time(op, axes, s, n) for (n, op), count in Counter(zip(*block)).items())
        return tuple(memo[block] for block in blocks)

    def _block_gather_parts(self, s: int, chunk: ChunkFacts, kind: str, held_reductions: bool
                            ) -> tuple[tuple[tuple[Part, ...], ...], tuple[tuple[Part, ...], ...]]:
        """Each block's merged gathers of a ``kind`` action in program order (:meth:`_block_gather_seconds`' each):
        those on the gather stream and those the compiler holds with the compute (testbed.sim.step.step_rules.
        held_stream), for testbed.explore.held_blocks; both empty where neither they nor the action's reductions
        (``held_reductions``) are held."""
        facts = self.facts
        if not (held_reductions or facts.held):
            return (), ()
        ops = chunk.gather_ops(kind)
        holds = tuple(tuple(held_stream(facts, op, "gather") == "compute" for op in block) for block in ops)
        if not held_reductions and not any(map(any, holds)):
            return (), ()
        time, axes = self.coll.time, facts.params_axes
        merges = tuple(tuple(((time(op, axes, s, n), (op, axes, n)), h) for n, op, h in zip(*block))
                       for block in zip(chunk.gather_sizes(kind), ops, holds))
        return (tuple(tuple(x for x, h in block if not h) for block in merges),
                tuple(tuple(x for x, h in block if h) for block in merges) if any(map(any, holds)) else ())

    def _core(self, s: int, c: int, chunk: ChunkFacts, work: ActionWork) -> _Core:
        """What both an action's :class:`ActionPrice` and its :class:`Least` read (:class:`_Core`), memoized."""
        out = self._cores.get((s, c, work.kind))
        if out is None:
            out = self._cores[(s, c, work.kind)] = self._core_of(s, chunk, work, self._rings[s])
        return out

    def _core_of(self, s: int, chunk: ChunkFacts, work: ActionWork, ring: tuple[int, int]) -> _Core:
        """:meth:`_core`, not memoized."""
        facts, topology, dtype, plan = self.facts, self.topology, self.dtype, self.facts.plan
        cost, kind, overlap = chunk.cost, work.kind, work.overlap
        flops, hbm, rep_b, split_b = overlap.work if overlap else work.work
        gemms = overlap.gemms if overlap else work.gemms
        whole, ringed, chain = self._compute(chunk, work, ring)
        parts: tuple[float, ...] = ()  # each block's compute where the blocks differ (the embedding's, the head's)
        if facts.gathers(kind) and not chain and not ringed and chunk.blocks > 1:
            # the task graph's blocks, each after its own gather, are compute tasks of their own (each launched)
            n = chunk.blocks
            parts = self._parts(chunk, work, n)
            whole = sum(parts) if parts else n * compute_seconds(
                topology, dtype, flops / n, hbm / n, max(1, chunk.kernels // n), rep_b / n, split_b / n,
                cost.tensor_bytes, scaled(gemms, 1 / n), scaled_spans(work.spans, 1 / n))
        ring_s = ringed[1] if ringed else 0.0
        ring_hidden = ringed[2] - ringed[1] if ringed else 0.0  # its sends beside the ring's compute
        # Priced as the chunk's last microbatch plays it, which releases the buckets where any (step_rules.gradients);
        # its blocks, when it gathers, are priced apart.
        grads = gradients(facts, kind, bool(chain), 0)
        last = grads.ends
        release, pieces = grads.release, step_pieces(chunk, grads, GatherMode.NONE)
        piece = acc = 0.0
        if release:  # the program reduces even a one-layer chunk's gradients
            piece = whole / pieces if ringed or chain else compute_seconds(
                topology, dtype, flops / pieces, hbm / pieces, max(1, chunk.kernels // pieces), rep_b / pieces,
                split_b / pieces, cost.tensor_bytes, scaled(gemms, 1 / pieces), scaled_spans(work.spans, 1 / pieces))
            parts = () if ringed or chain else self._parts(chunk, work, pieces) or parts
        if last:  # the add into the gradient accumulator (a task of its own in the graph)
            acc = compute_seconds(topology, dtype, 0.0, accumulate_bytes(plan, cost.params, facts.grad_bytes))
        tp_s = self._tensor_seconds(s, overlap.after if overlap else work.tensor)
        hidden = tp_s if plan.runtime.tp_comm_overlap and not overlap else 0.0  # beside the compute (the join)
        blocks = tuple((self._tensor_seconds(s, blk.first),  # GEMM by GEMM (testbed.sim.step.tp_overlap)
                        compute_seconds(topology, dtype, blk.flops, blk.hbm_bytes, max(1, len(blk.gemms)),
                                        tensor_bytes=cost.tensor_bytes, gemms=blk.gemms),
                        self._tensor_seconds(s, blk.rest)) for blk in (overlap.blocks if overlap else ()))
        tp_s += self._exposed_all_to_all(chain, s)
        tp_s += ring_s
        return _Core(whole, tp_s, hidden, piece, pieces, parts, acc, ring_hidden, bool(chain), blocks, bool(ringed),
                     release, bool(last and facts.per_microbatch and facts.microbatches > 1))

    def _price(self, s: int, c: int, chunk: ChunkFacts, work: ActionWork, gather: float) -> ActionPrice:
        """One action's :class:`ActionPrice` (``gather``: the seconds of a gather of its chunk's parameters) of the
        first chunk alike: its :meth:`_core`, then its collectives."""
        core = self._core(s, c, chunk, work)
        pieces, chain = core.pieces, core.chain
        bucket = scatter = sequence_s = held = scatter_held = 0.0
        bucket_syncs: Syncs = ()
        each: tuple[float, ...] = ()
        held_parts: tuple[tuple[Part, ...], ...] = ()
        if core.release:
            bucket, bucket_syncs, sequence_s, each, held, held_parts = self._buckets(s, chunk, pieces)
        scatter_each: tuple[float, ...] = ()
        scatter_parts: tuple[tuple[Part, ...], ...] = ()
        if core.scatters:
            scatter, scatter_each, scatter_held, scatter_parts = self._scatters(s, chunk, chain)
        sends = self._sends(s, work)
        gathering = gather_mode(self.facts, work) is not GatherMode.NONE
        syncs = self._syncs(chunk, work, not chain and not core.ringed, bool(scatter), bucket_syncs, pieces)
        spans = gathering and not chain and not core.ringed  # the blocks played span by span, as the task graph's
        return ActionPrice(core.compute, core.tensor, gather if gathering else 0.0, core.piece, pieces, bucket,
                           scatter, sends, core.acc, syncs, bucket_syncs, core.hidden,
                           1 if work.chain else chunk.blocks, core.blocks,
                           bucket_each=tuple(r.seconds for r in each), held_each=tuple(r.held for r in each),
                           send_s=sum(x.seconds for x in sends) if sends else 0.0, parts=core.parts, early=sequence_s,
                           scatter_each=scatter_each, ring_hidden=core.ring_hidden,
                           chain=chain, bucket_held=held, scatter_held=scatter_held, held_parts=held_parts,
                           scatter_parts=scatter_parts,
                           **(self._plays(s, c, chunk, work, pieces, core.release, bool(scatter_each)) if spans else {}))

    def _sends(self, s: int, work: ActionWork) -> tuple[PricedSend, ...]:
        """An action's sends: split sends (StepFacts.scatter_sends) each rank's share, then the receivers' all-gather
        over tensor (their recv stream)."""
        memo = self._sent
        out = []
        for dst, _, nbytes in work.sends:  # a stage's chunks send alike to one stage: each priced once
            priced = memo.get((s, dst, nbytes))
            if priced is None:
                reps, ways, topology = self.facts.representatives, self.facts.scatter_sends, self.topology
                priced = memo[(s, dst, nbytes)] = PricedSend(
                    dst, send_time(topology, reps[s], reps[dst], nbytes / ways),
                    self.coll.time("all_gather", (Axis.TENSOR,), dst, nbytes) if ways > 1 else 0.0)
            out.append(priced)
        return tuple(out)

    def _syncs(self, chunk: ChunkFacts, work: ActionWork, plain: bool, scatter: bool, bucket_syncs: Syncs,
               pieces: int) -> tuple[Syncs, Syncs]:
        """The action's collectives as barriers among its kernels (testbed.sim.graph.program's interleave; ``plain``: not
        a chain nor a ring): the tensor collectives, then an earlier microbatch's reduce-scatters (``scatter``) or
        the last one's buckets. Gathers meet on their own stream ahead of the action, with next to no computing
        since the last meeting (no wait here; the task graph's prefetched gathers wait next to nothing too)."""
        facts, mesh, ends = self.facts, self.facts.plan.mesh, self.ends
        if not plain:
            return ends, ends
        own = [(mesh.tensor, n) for _, n, _ in work.tensor if mesh.tensor > 1]
        g_ways = math.prod(mesh.degree(a) for a in facts.per_microbatch)
        return (merge([*ends, *own, *([(g_ways, max(1, chunk.leaves))] if scatter else [])]),
                merge([*ends, *own, *((g, n * pieces) for g, n in bucket_syncs if facts.reduce_in_backward)]))

    def _plays(self, s: int, c: int, chunk: ChunkFacts, work: ActionWork, pieces: int, final: bool, scatters: bool
               ) -> dict[str, tuple]:
        """An action's blocks played span by span (testbed.explore.span_times): ``plays`` (a microbatch releasing no
        gradients), ``plays_last`` (the one releasing the chunk's gradient buckets: ``final``) and ``plays_scatter``
        (an earlier one reduce-scattering into the accumulator bucket by bucket: ``scatters``)."""
        def played(n: int, reduce: bool, accumulate: bool = False) -> tuple:
            return priced_plays(self, s, chunk, work, n, reduce, accumulate, self._spans.setdefault((s, c, work.kind, n), {}))
        return {"plays": played(chunk.blocks, False), "plays_last": played(pieces, True) if final else (),
                "plays_scatter": played(chunk.buckets, True, True) if scatters else ()}

    def _parts(self, chunk: ChunkFacts, work: ActionWork, pieces: int) -> tuple[float, ...]:
        """Each block's compute seconds of an action whose blocks are the embedding's, each layer's and the head's
        (:meth:`ChunkFacts.block_shares`, as testbed.sim.graph.program's tasks); empty where its blocks are equal."""
        shares = chunk.block_shares(work.kind, pieces)
        if not shares:
            return ()
        flops, hbm, rep_b, split_b = work.work
        kernels, tensor_bytes = max(1, chunk.kernels // pieces), chunk.cost.tensor_bytes
        alike: dict[tuple[float, int], float] = {}  # the layers' blocks: one share, one GEMMs tuple
        for w, gemms in shares:
            if (w, id(gemms)) not in alike:
                alike[(w, id(gemms))] = compute_seconds(self.topology, self.dtype, flops * w, hbm * w, kernels,
                                                        rep_b * w, split_b * w, tensor_bytes, gemms,
                                                        scaled_spans(work.spans, w))
        return tuple(alike[(w, id(gemms))] for w, gemms in shares)

    def _tensor_seconds(self, s: int, transfers) -> float:
        """Seconds of tensor collectives ``(op, count, bytes each)`` one after another."""
        return sum(count * self.coll.time(op, (Axis.TENSOR,), s, nbytes) for op, count, nbytes in transfers)

    def _compute(self, chunk: ChunkFacts, work: ActionWork, ring: tuple[int, int],
                 ) -> tuple[float, tuple[float, float, float] | None, tuple[Piece, ...]]:
        """(compute seconds, the ring's (compute, exposed sends, all sends) seconds or None, the MoE chain) of one action,
        priced as the task graph splits it: whole, as the ring's tasks under context parallelism (testbed.sim.graph.ring),
        and the chain's compute tasks each as the graph prices them."""
        topology, dtype, cost = self.topology, self.dtype, chunk.cost
        overlap = work.overlap  # its blocks' GEMMs are priced beside their collectives (_price)
        flops, hbm, rep_b, split_b = overlap.work if overlap else work.work
        whole = compute_seconds(topology, dtype, flops, hbm, chunk.kernels, rep_b, split_b, cost.tensor_bytes,
                                overlap.gemms if overlap else work.gemms, work.spans)
        ringed = ring_action_seconds(self.facts.plan, topology, dtype, ring, work.kind, cost.layers,
                                     overlap.work if overlap else work.ring_work,
                                     overlap.gemms if overlap else work.ring_gemms, chunk.kernels, cost.tensor_bytes)
        whole = ringed[0] if ringed else whole
        if work.chain:
            whole = (ringed[0] if ringed else 0.0) + sum(
                compute_seconds(topology, dtype, x.flops, x.hbm_bytes, x.kernels, x.replicated_bytes,
                                x.split_bytes, cost.tensor_bytes, x.gemms) for x in work.chain if not x.transfer)
        return whole, ringed, work.chain

    def _exposed_all_to_all(self, chain: tuple[Piece, ...], stage: int) -> float:
        """Seconds an action's MoE all-to-alls block it (testbed.sim.step.moe's chain): each all-to-all less the shared
        experts' compute the chain runs beside it (the piece that follows it, when it is one)."""
        total = 0.0
        for i, piece in enumerate(chain):
            if piece.transfer:
                a2a = piece.count * self.coll.time(piece.op, (Axis(piece.axis),), stage, piece.nbytes)
                beside = chain[i + 1] if i + 1 < len(chain) and chain[i + 1].name.endswith("shared") else None
                overlap = compute_seconds(self.topology, self.dtype, beside.flops, 0.0, beside.kernels,
                                          gemms=beside.gemms) if beside else 0.0
                total += max(0.0, a2a - overlap)
        return total
