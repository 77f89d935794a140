"""One play of the analytic tier's schedule table: every action in execution order on its stage, then each
stage's gradient tail and update (testbed.explore.analytic prices the actions; this module plays them by
testbed.sim.step.step_rules, the rules the task graph is built by).

An action starts once its stage is free, its dispatch is out and what it waits for has arrived; it computes,
then blocks for its tensor collectives (less the part ``runtime.tp_comm_overlap`` hides: testbed.sim.step.tp_overlap),
and its sends leave on the stage's pipe stream (serial; with ``runtime.pipeline_blocking_sends`` the stage waits
for them). Gathers (fsdp/ZeRO-3) run block by block ahead of the compute, gradient buckets reduce on the grad
stream, and a shared host's stragglers wait at the action's barriers
(testbed.sim.price.barriers). With ``device.comm_slowdown`` the compute beside communication is slower before the
action's reductions leave (:meth:`Play._slowed`), so its buckets and its end carry the extra once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from testbed.plan.spec import Axis
from testbed.explore.block_memo import spans_from_start
from testbed.explore.play_floor import SAFETY, AboveBar, action_floors, beside_compute, stage_rests
from testbed.explore.span_times import Played
from testbed.sim.price.barriers import interleaved_wait, step_end_wait
from testbed.sim.step.memo import Waits
from testbed.sim.step.update_facts import update_seconds
from testbed.sim.step.step_rules import (ActionStep, Gradients, action_dispatch, action_steps, dispatch_seconds,
                                    prepare_seconds, step_dispatch, step_prepare, update_dispatch)
from testbed.sim.step.tp_overlap import slowed_overlap

if TYPE_CHECKING:
    from testbed.explore.prices import ActionPrice, StepPrices

__all__ = ["Play"]

class _Replay(NamedTuple):
    """What an action's blocks were played from, to play them again slowed (``device.comm_slowdown``): each block's
    gather seconds, the action's start, when the stage's gathers were free, the previous gathering action's blocks'
    ends."""

    gathers: tuple[float, ...]
    start: float
    gather_free: float
    before: list[float]


#: A gradient reduction leaving for the grad stream: (when, its seconds, the share of its action's compute before it).
Release = tuple[float, float, float]


class Play:
    """One play of the schedule table, stage by stage, with compute slowed ``slow`` times: every action in
    execution order (:meth:`action`), then each stage's gradient tail and update (:meth:`update`)."""

    def __init__(self, step: StepPrices, slow: float) -> None:
        facts, p = step.facts, step.facts.stages
        self.step, self.facts, self.slow, self.plan = step, facts, slow, facts.plan
        self.slowdown = step.topology.device.comm_slowdown  # read per action
        self.end: dict[tuple, float] = {}     # (stage, kind, microbatch, chunk) -> done on its stage
        self.arrive: dict[tuple, float] = {}  # ... -> its send has reached the next stage
        self.free, self.pipe, self.gather_free, self.grad, self.once = ([0.0] * p for _ in range(5))
        self.recv: dict[tuple[int, str], float] = {}  # (stage, direction) -> its split sends' gathers done
        self.block_ends: list[list[float]] = [[] for _ in range(p)]  # the last gathering action's blocks' ends
        # With a slowdown, the last action's block gathers in flight, and what its blocks were played from.
        self.gathered: list[tuple[float, float]] = []
        self.replay = _Replay((), 0.0, 0.0, [])
        self.played: Played | None = None  # the last action's blocks played span by span (span_times)
        self.held: list[float] | None = None  # the last action's held reductions' seconds per block (held_blocks)
        self.sums = list(step.shard_sum_s)  # each stage's merged shard all-reduces, until played (_kept)
        self.once_group = [0] * p  # the group the first of a stage's once-reductions meets
        self.early = [0.0] * p  # the sequence-replicated gradients' sum done (ActionPrice.early: its own stream)
        self.busy, self.comm = [0.0] * p, [0.0] * p
        self.carry = [0.0] * p  # a shared host's stragglers: computing since the stage's devices last met
        self.launch = 0.0  # with ``serial``: when the previous program completed
        self.host, controller = 0.0, step.controller
        if controller is not None:
            self.host = prepare_seconds(controller, step_prepare(facts))
            if dispatch := step_dispatch(facts):
                self.host += dispatch_seconds(controller, *dispatch)

    def run(self, bar: float = math.inf) -> tuple[float, list[float], list[float], float]:
        """(step seconds, per-stage compute, per-stage communication, the controller's seconds). With a finite
        ``bar`` (compute unslowed), raises testbed.explore.play_floor.AboveBar as soon as the step is certainly
        above it."""
        if bar < math.inf:
            self._bounded(bar)
        else:
            for step in action_steps(self.facts):
                self.action(step)
        if self.facts.tied_bytes:
            self._tied()
        step = 0.0
        for s in range(self.facts.stages):
            step = max(step, self.update(s), self.host)
        return step, self.busy, self.comm, self.host

    def _bounded(self, bar: float) -> None:
        """Every action played as :meth:`run`, stopping once a stage's free time and the floors of what it has left
        (testbed.explore.play_floor) pass ``bar`` (AboveBar: with every bound checked)."""
        floors = action_floors(self.step)
        rests, keep = stage_rests(self.step, floors), 1.0 - SAFETY
        free, bounds = self.free, [max(rests) * keep]
        if bounds[0] > bar:
            raise AboveBar(bounds[0], bounds)
        for step in action_steps(self.facts):
            self.action(step)
            s, action = step.stage, step.action
            rests[s] -= floors[(s, action.chunk, action.kind)]
            bounds.append((free[s] + rests[s]) * keep)
            if bounds[-1] > bar:
                raise AboveBar(bounds[-1], bounds)

    def _start(self, s: int, c: int, kind: str, accumulated: bool, waits: Waits) -> float:
        """When an action starts: after its stage's previous action (and program), its dispatch
        (``accumulated``: testbed.sim.step.step_rules.action_dispatch's), what it waits for (``waits``: its stage's
        actions' ends, other stages' sends' arrival) and its parameter gather (the wait for which is communication)."""
        step, controller = self.step, self.step.controller
        start = max(self.free[s], self.launch) if step.serial else self.free[s]
        if controller is not None:
            if dispatch := action_dispatch(self.facts, s, c, kind, accumulated):
                self.host += dispatch_seconds(controller, *dispatch)
            start = max(start, self.host)
        ends, receives = waits
        for key in ends:
            t = self.end[key]
            if t > start:
                start = t
        for key in receives:
            t = self.arrive[key]
            if t > start:
                start = t
        return start

    def _gather(self, s: int, priced: ActionPrice, start: float, compute: float, grads: Gradients
                ) -> tuple[float, float]:
        """An action's gathers block by block (testbed.sim.graph.program's): (when its first block computes, the seconds
        the later blocks wait for their gathers), each block's gather and compute its own where they differ (a
        block's merged collectives; the embedding's and the head's blocks), else equal shares (:meth:`_gathered_blocks`).
        Where its gradients (``grads``) leave bucket by bucket, one a block, and the compiler holds their reductions
        (or reduce-scatters into the accumulator) with the compute, each block's run after it beside the later
        gathers (:meth:`_held_blocks`), as where the compiler holds some of its gathers with the compute."""
        n, d, skewed = priced.blocks, self.facts.prefetch, self.step.skewed
        g, c = priced.gather / n, compute / n
        # Without prefetch each gather, exposed, first meets its group after a block's computing.
        wait = skewed.barrier_wait(self.facts.params_ways, c) if skewed is not None and d == 0 else 0.0
        gathers = priced.block_gathers or (g,) * n
        # (x * 1.0 and x + 0.0 are x: the tuples are built only where they differ)
        parts = (priced.parts if self.slow == 1.0 else tuple(self.slow * x for x in priced.parts)) if priced.parts \
            else (c,) * n
        held = priced.held_parts if grads.release else priced.scatter_parts if grads.each else ()
        key = (id(priced), s, self.slow, wait, id(held))  # what the blocks play from but the times (block_memo)
        if priced.gather_parts and (len(held) == n or priced.held_gathers) and not priced.plays:
            return self._held_blocks(s, priced, held if len(held) == n else (), wait, start, parts, key)
        return self._gathered_blocks(s, tuple(x + wait for x in gathers) if wait else gathers, start, parts,
                                     bool(priced.parts), priced.plays, key)

    def _gathered_blocks(self, s: int, gathers: tuple[float, ...], start: float, parts: tuple[float, ...],
                         own: bool, plays: tuple = (), key: tuple = ()) -> tuple[float, float]:
        """:meth:`_gather` with each block's gather and compute seconds: block ``i``'s gather starts after block
        ``i - 1``'s and once the block testbed.sim.step.step_rules.gather_after names has computed, its compute once its
        gather and block ``i - 1`` are done, block by block as the task graph plays them. ``own``: the
        blocks compute their own shares (with a slowdown, kept to play them again, each slowed: :meth:`_slowed`);
        ``plays``: the blocks played span by span (testbed.explore.span_times), each done once its collectives are."""
        n, d, before = len(gathers), self.facts.prefetch, self.block_ends[s]
        replay = own and bool(self.slowdown)
        self.played, self.held = None, None
        if plays:
            self.played = played = self.step.blocks.spans(key, plays, gathers, start, self.gather_free[s], before, d,
                                                          (self.slow,) * n)
            if replay:
                self.replay, self.gathered = _Replay(gathers, start, self.gather_free[s], before), played.flying
            first = played.starts[0]
            self.comm[s] += first - start
            self.gather_free[s], self.block_ends[s] = played.gather_end, played.dones
            return first, played.ends[-1] - first - sum(parts)
        ends, gather_end, self.gathered = _blocks(gathers, parts, start, self.gather_free[s], before, d, replay)
        if replay:
            self.replay = _Replay(gathers, start, self.gather_free[s], before)
        first = ends[0] - parts[0]
        self.comm[s] += first - start
        self.gather_free[s], self.block_ends[s] = gather_end, ends
        return first, ends[-1] - first - sum(parts)

    def _held_blocks(self, s: int, priced: ActionPrice, held: tuple, wait: float, start: float,
                     parts: tuple[float, ...], key: tuple) -> tuple[float, float]:
        """:meth:`_gather` of an action whose blocks' held reductions (``held``; empty: none played among the
        blocks) or held gathers share links with the gathers beside them (testbed.explore.held_blocks): the seconds
        each block's held reductions took are kept for :meth:`_backward_end`, and the later blocks' waits for their
        gathers (held ones among them) leave them out."""
        gathers = tuple(((wait, None), *merges) for merges in priced.gather_parts) if wait else priced.gather_parts
        played = self.step.blocks.held(key, s, self.step.coll, gathers, parts, held or ((),) * len(parts), start,
                                       self.gather_free[s], self.block_ends[s], self.facts.prefetch, priced.held_gathers)
        self.played, self.held = None, played.held if held else None
        self.gathered = played.flying if self.slowdown else []
        first = played.ends[0] - parts[0]
        self.comm[s] += first - start
        self.gather_free[s], self.block_ends[s] = played.gather_end, played.ends
        return first, played.ends[-1] - first - sum(parts) - sum(played.held[:-1])

    def action(self, step: ActionStep) -> None:
        """Plays one F/B/W action as ``step`` (testbed.sim.step.step_rules.action_steps) rules it."""
        s, action, grads = step.stage, step.action, step.gradients
        c, kind, mb = action.chunk, action.kind, action.microbatch
        priced = self.step.played(s, c, kind, grads)
        compute = self.slow * priced.compute
        if step.iteration.waits:
            self._iteration(s)
        start, stretch = self._start(s, c, kind, step.accumulated, step.waits), 0.0
        skewed = self.step.skewed
        if priced.gather:
            start, stretch = self._gather(s, priced, start, compute, grads)
            if skewed is not None and priced.blocks > self.facts.prefetch:
                # Its first prefetch + 1 blocks' gathers met the shard group as the stage's previous gathering
                # action ended (or later): nothing computed since (the task graph's gathers, testbed.sim.price.barriers).
                self.carry[s] = 0.0
        wait = 0.0  # at the action's barriers (a shared host's stragglers): communication, not compute
        last, releases = grads.ends, ()
        if last:
            compute, wait, releases = self._backward_end(s, priced, start, compute, step)
        elif skewed is not None:
            wait = interleaved_wait(skewed, priced.syncs[0], compute, self.carry[s])
            self.carry[s] = 0.0 if priced.syncs[0] else self.carry[s] + compute
            compute += wait
        if skewed is not None and priced.gather and priced.blocks > 1:
            # Each block's gather is a meeting of the shard group (testbed.sim.price.barriers): the last one runs as
            # block n - 1 - prefetch starts, so only the blocks from there on are computed since.
            n = priced.blocks
            self.carry[s] = min(self.carry[s], min(n, self.facts.prefetch + 1) * (compute - wait) / n)
        if self.slowdown:  # compute is longer for the communication beside it, before its reductions leave
            extra, stretch, releases = self._slowed(s, priced, grads, compute - wait, stretch, releases)
            compute += extra
        for at, seconds, _ in releases:  # the gradient buckets (or reduce-scatter) on the grad stream
            self.grad[s] = max(self.grad[s], at) + seconds
        tensor = priced.tensor
        if priced.hidden:  # overlapped with the compute before the accumulator's add (the task graph's join)
            tensor += max(0.0, priced.hidden - (compute - (self.slow * priced.acc if last else 0.0))) - priced.hidden
        gemms = blocks = 0.0
        if priced.overlap:  # tp_comm_overlap GEMM by GEMM, after the rest
            blocks, gemms = slowed_overlap(tuple((f, self.slow * g, r) for f, g, r in priced.overlap), self.slowdown)
        finish = start + compute + stretch + blocks + tensor
        self.busy[s] += compute - wait + gemms
        self.comm[s] += tensor + wait + stretch + blocks - gemms
        self.free[s] = finish
        if self.step.serial:  # the program ends with its reductions too
            self.launch = max(finish, self.grad[s])
        self.end[(s, kind, mb, c)] = finish
        if priced.sends:
            self._sends(s, (s, kind, mb, c), priced, finish, step.blocking)

    def _sends(self, s: int, key: tuple, priced: ActionPrice, finish: float, blocking: bool) -> None:
        """An action's sends, one after another on its stage's pipe stream from ``finish`` (``key``: the action's),
        a split send's receivers' all-gather on their recv stream of its direction; with ``blocking`` sends the
        stage waits for them (testbed.sim.step.step_rules.ActionStep). A send is no program's own: with programs one at
        a time the next one waits for the action's end only (testbed.sim.graph.tasks.Builder.serialize)."""
        kind = key[1]
        for dst, seconds, gather in priced.sends:
            self.pipe[s] = max(self.pipe[s], finish) + seconds
            self.arrive[key] = self.pipe[s]
            if gather:
                recv = self.recv.get((dst, kind), 0.0)
                self.recv[(dst, kind)] = self.arrive[key] = max(recv, self.pipe[s]) + gather
        if blocking:
            self.comm[s] += max(0.0, self.pipe[s] - self.free[s])
            self.free[s] = max(self.free[s], self.pipe[s])

    def _backward_end(self, s: int, priced: ActionPrice, start: float, compute: float, step: ActionStep
                      ) -> tuple[float, float, tuple[Release, ...]]:
        """A microbatch's last backward action (B, or W when split; ``step.left``: the chunk's microbatches after
        it): (its compute seconds, its barriers' wait, its reductions ``(when it leaves, seconds, the share of the
        compute before)``). The last microbatch's buckets reduce as its pieces finish, from ``step.tail_from`` on
        after its tensor collectives (or once, after the stage's backward, when gradients do not accumulate
        sharded); an earlier one's gradients are reduce-scattered (testbed.sim.step.step_rules.gradients)."""
        piece, acc, pieces, skewed = self.slow * priced.piece, self.slow * priced.acc, priced.pieces, self.step.skewed
        grads, last_mb = step.gradients, step.left == 0
        parts = tuple(self.slow * x for x in priced.parts) if priced.parts and len(priced.parts) == pieces else ()
        if grads.release and piece:
            compute = sum(parts) if parts else pieces * piece
        wait = 0.0
        if skewed is not None:  # the action's barriers (testbed.sim.price.barriers), then the accumulator's add
            own = priced.syncs[1] if last_mb else priced.syncs[0]
            if last_mb and piece and pieces > 1:  # the task graph's bucket pieces: an equal share each
                share = tuple((g, n / pieces) for g, n in own)
                wait = interleaved_wait(skewed, share, piece, self.carry[s]) + (pieces - 1) * interleaved_wait(
                    skewed, share, piece, 0.0)
            else:
                wait = interleaved_wait(skewed, own, compute, self.carry[s])
            self.carry[s] = acc if own else self.carry[s] + compute + acc
            compute += wait
            piece += wait / pieces
        releases: tuple[Release, ...] = ()
        held = 0.0  # the reductions' seconds held with the compute (step_rules.held_stream), as they leave
        if grads.release and piece:
            if not self.facts.reduce_in_backward:  # the replicas' one sum, after the stage's backward (program.py)
                self.once[s] += pieces * (priced.bucket + priced.bucket_held)
                self.early[s] = max(self.early[s], start + compute) + priced.early  # its own stream, from here
                self.once_group[s] = self.once_group[s] or (priced.bucket_syncs[0][0] if priced.bucket_syncs else 1)
            # Each bucket once its piece has computed: where the blocks played their own gathers, when each ended.
            ends = self.block_ends[s] if priced.gather and parts and len(self.block_ends[s]) == pieces else ()
            done, total, before, out = start, sum(parts), 0.0, []
            if priced.plays and self.played is not None and self.facts.reduce_in_backward:  # as the play releases
                return compute + acc, wait, tuple((at, x, 1.0) for at, x in self.played.releases)
            played = self.held if ends else None  # the held reductions played among the blocks (_held_blocks)
            for k in range(pieces if self.facts.reduce_in_backward else 0):
                own = priced.bucket_each[k] if priced.bucket_each else priced.bucket
                done = ends[k] if ends else done + (parts[k] + wait / pieces if parts else piece)
                before += parts[k] if parts else 0.0
                tp = (ends[-1] if ends else start + compute) + priced.tensor if k >= step.tail_from else 0.0
                out.append((max(done, tp) + (0.0 if played else held), own,
                            before / total if parts and total else (k + 1) / pieces))
                held += played[k] if played else priced.held_each[k] if priced.held_each else priced.bucket_held
            releases = tuple(out)
        elif grads.each and priced.plays and self.played is not None and self.played.releases:  # as played
            releases = tuple((at, x, 1.0) for at, x in self.played.releases)
        elif grads.each and priced.scatter_each:  # a loop XLA keeps: bucket by bucket as the backward makes them
            n = len(priced.scatter_each)
            ends = self.block_ends[s] if priced.gather and len(self.block_ends[s]) == n else ()
            releases = tuple((ends[k] if ends else start + compute * (k + 1) / n, x, (k + 1) / n)
                             for k, x in enumerate(priced.scatter_each) if x)
            held = sum(self.held) if ends and self.held else priced.scatter_held  # (played among the blocks)
        elif grads.scatter and (priced.scatter or priced.scatter_held):
            releases = ((start + compute, priced.scatter, 1.0),) if priced.scatter else ()
            held = priced.scatter_held
        return compute + acc + held, wait + held, releases

    def _iteration(self, s: int) -> None:
        """A microbatch of a loop XLA keeps (testbed.sim.step.grad_bytes.loop_kept) begins once the one before it has
        ended, its reduce-scatters and sums too, and gathers nothing before (testbed.sim.graph.program's join)."""
        end = max(self.free[s], self.grad[s], self.early[s])
        self.comm[s] += end - self.free[s]
        self.free[s], self.gather_free[s] = end, max(self.gather_free[s], end)

    def _slowed(self, s: int, priced: ActionPrice, grads: Gradients, compute: float, stretch: float,
                releases: tuple[Release, ...]) -> tuple[float, float, tuple[Release, ...]]:
        """``device.comm_slowdown``: (the action's extra compute, its gather waits left, its reductions' releases
        ``(when, seconds, share of the compute before)`` later by the extra computed before each). The extra is the
        slowdown times the communication beside the compute (gathers, reductions, sends, tensor), at most the
        compute (``compute``, less the barriers' wait); gather waits absorb a slower compute. Where the blocks
        played their own gathers (the embedding's, the head's differ) it is each block's own, as the task graph
        slows each compute task: the seconds the action's gathers, its buckets and the stage's reductions still in
        flight are beside the block (the exposed part of a gather runs beside no compute), the rest (sends, tensor)
        spread by compute; the blocks are played again, each slowed (a later gather may absorb it), and each bucket
        leaves as its block now ends: the extra counts once, in the buckets and in the action's end."""
        rate, facts = self.slowdown, self.facts
        if priced.plays and self.played is not None:
            return self._slowed_spans(s, priced, releases)
        # (the buckets are beside no compute when they wait for the end; blocks played with their held reductions,
        # or gathers, testbed.explore.held_blocks, are not played again: the extra is spread over the action's compute)
        if not (priced.gather and priced.parts) or self.held is not None or priced.held_gathers:
            extra = rate * min(compute, beside_compute(self.step, priced, grads))
            late = extra - min(stretch, extra)
            return extra, stretch - min(stretch, extra), tuple((t + late * f, x, f) for t, x, f in releases)
        ends, parts = self.block_ends[s], tuple(self.slow * x for x in priced.parts)
        gathers, start, gather_free, before = self.replay
        each = _overlaps([(e - c, e) for e, c in zip(ends, parts)], self._in_flight(s, start, releases))
        total = sum(parts[:len(ends)])
        spread = rate * min(max(0.0, total - sum(each)), priced.hidden + priced.send_s) / (total or 1.0)
        longer = tuple(c + rate * o + spread * c for o, c in zip(each, parts))
        slowed, gather_end, _ = _blocks(gathers, longer, start, gather_free, before, facts.prefetch, False)
        n = len(slowed)
        self.gather_free[s], self.block_ends[s] = gather_end, slowed
        out, i, done = [], 0, parts[0]
        for t, x, f in releases:  # each after the block its share of the compute ends in
            while i < n - 1 and (done < f * total * (1 - 1e-9) or not parts[i + 1]):  # (the last of equal ends)
                i += 1
                done += parts[i]
            out.append((t + slowed[i] - ends[i], x, f))
        first = ends[0] - parts[0]
        return sum(longer) - total, slowed[-1] - first - sum(longer), tuple(out)

    def _in_flight(self, s: int, start: float, releases: tuple[Release, ...]) -> list[tuple[float, float]]:
        """The spans, sorted, in which communication runs beside an action of stage ``s`` starting at ``start``: its
        gathers, the earlier actions' reductions still in flight (back to back from the start on) and its own
        ``releases`` as they leave without the slowdown."""
        spans, grad = list(self.gathered), self.grad[s]
        if grad > start:
            spans.append((start, grad))
        for t, x, _ in releases:
            grad = max(grad, t) + x
            spans.append((grad - x, grad))
        return sorted(spans)

    def _slowed_spans(self, s: int, priced: ActionPrice, releases: tuple[Release, ...]
                      ) -> tuple[float, float, tuple[Release, ...]]:
        """:meth:`_slowed` of an action whose blocks are played span by span (testbed.explore.span_times): each
        block's compute longer by the slowdown times the communication beside the block (its gathers, the stage's
        reductions in flight), the rest (sends, tensor) spread by compute; the blocks played again so, each
        bucket leaving as the play now releases it."""
        played, rate, d = self.played, self.slowdown, self.facts.prefetch
        parts = tuple(self.slow * x for x in priced.parts)
        gathers, start, gather_free, before = self.replay
        each = [min(o, c) for o, c in zip(_overlaps(list(zip(played.starts, played.ends)),
                                                     self._in_flight(s, start, releases)), parts)]
        total = sum(parts)
        spread = rate * min(max(0.0, total - sum(each)), priced.hidden + priced.send_s) / (total or 1.0)
        longer = tuple(c + rate * o + spread * c for o, c in zip(each, parts))
        scale = tuple(self.slow * x / c if c else self.slow for x, c in zip(longer, parts))
        again = spans_from_start(priced.plays, gathers, start, gather_free, before, d, scale)
        self.gather_free[s], self.block_ends[s] = again.gather_end, again.dones
        first = played.starts[0]
        if again.releases or not releases:
            out = tuple((at, x, 1.0) for at, x in again.releases) if releases else releases
        else:  # an earlier microbatch's reduce-scatters (a loop XLA keeps), each as its block is now done
            out = tuple((t + _later(t, played.dones, again.dones), x, f) for t, x, f in releases)
        return sum(longer) - total, again.ends[-1] - first - sum(longer), out

    def _tied(self) -> None:
        """The tied token table's gradient summed between the first and last stage (StepFacts.tied_bytes): once both
        stages' kept reductions (played here, :meth:`_kept`) and backward are done; both updates wait for it."""
        ends = (0, self.facts.stages - 1)
        for s in ends:
            self._kept(s)
        start = max(max(self.free[s], self.grad[s], self.launch, self.early[s]) for s in ends)
        for s in ends:
            self.grad[s] = start + self.step.tied_s

    def _kept(self, s: int) -> None:
        """Stage ``s``'s kept reductions, the replicas' one sum after the backward, then its merged shard all-reduces
        (StepPrices.shard_sum_s), each once: they are then done."""
        if self.once[s]:  # the replicas meet first (a shared host's stragglers)
            skewed = self.step.skewed
            self.grad[s] = max(self.grad[s], self.free[s], self.launch) + self.once[s] + (
                skewed.barrier_wait(self.once_group[s], self.carry[s]) if skewed else 0.0)
            self.carry[s], self.once[s] = 0.0, 0.0
        if self.sums[s]:  # once every bucket is done (StepFacts.shard_sums)
            self.grad[s], self.sums[s] = max(self.grad[s], self.free[s], self.launch) + self.sums[s], 0.0

    def update(self, s: int) -> float:
        """Plays stage ``s``'s gradient tail, optimizer and (ZeRO-1/2) re-gather; returns when the stage is done."""
        step, skewed, update, controller = self.step, self.step.skewed, self.facts.updates[s], self.step.controller
        self._kept(s)
        ready = max(self.free[s], self.grad[s], self.launch, self.early[s])
        if controller is not None and (dispatch := update_dispatch(self.facts, s)):
            self.host += dispatch_seconds(controller, *dispatch)
            ready = max(ready, self.host)
        self.comm[s] += max(0.0, max(self.grad[s], self.early[s]) - self.free[s])
        opt = self.slow * update_seconds(step.topology, step.dtype, update)
        self.busy[s] += opt
        done = ready + opt
        self.carry[s] += opt
        if step.serial and skewed is not None:  # the update program's end: the stage's devices meet
            wait = interleaved_wait(skewed, step.ends, opt, self.carry[s] - opt)
            self.comm[s] += wait
            done += wait
            self.carry[s] = 0.0
        if update.regathers:
            regather = update.regathers * step.coll.time("all_gather", (Axis.DATA,), s, update.regather_bytes)
            self.comm[s] += regather
            done += regather
            if skewed is not None:  # back to back after the update: the first meets the data group
                wait = skewed.barrier_wait(self.plan.mesh.data, self.carry[s])
                self.comm[s] += wait
                done += wait
                self.carry[s] = 0.0
        done += step_end_wait(skewed, step.per_stage, self.carry[s])  # every device meets at the end
        self.launch = done if step.serial else self.launch
        return done


def _blocks(gathers: tuple[float, ...], parts: tuple[float, ...], start: float, gather_free: float,
            before: list[float], prefetch: int, spans: bool) -> tuple[list[float], float, list[tuple[float, float]]]:
    """Blocks of ``gathers`` and ``parts`` seconds played (:meth:`Play._gathered_blocks`): (each block's end, when
    the last gather ends, when each gather is in flight if ``spans``)."""
    gather_end, ends, flying, end, back = gather_free, [], [], start, len(before) - 1 - prefetch
    for i, (g, c) in enumerate(zip(gathers, parts)):  # (gather_after inlined: the hottest loop of the play)
        j = i - 1 - prefetch
        after = (ends[j] if j >= 0 else before[back + i] if back + i >= 0 else None) or 0.0
        gather_end = (after if after > gather_end else gather_end) + g
        if spans:
            flying.append((gather_end - g, gather_end))
        end = (gather_end if gather_end > end else end) + c
        ends.append(end)
    return ends, gather_end, flying


def _later(t: float, dones: list[float], again: list[float]) -> float:
    """How much later a release at ``t`` (a block's done, of ``dones``) leaves with the blocks done at ``again``:
    the latest block done by ``t``'s shift."""
    k = max((i for i, d in enumerate(dones) if d <= t * (1 + 1e-12)), default=0)
    return again[k] - dones[k]


def _overlaps(blocks: list[tuple[float, float]], spans: list[tuple[float, float]]) -> list[float]:
    """Each of ``blocks`` (in order, apart), the seconds of it some of ``spans`` (sorted by start, on several
    streams) covers."""
    union: list[list[float]] = []
    for a, b in spans:
        if union and a <= union[-1][1]:
            union[-1][1] = max(union[-1][1], b)
        else:
            union.append([a, b])
    out, j = [], 0
    for lo, hi in blocks:
        while j < len(union) and union[j][1] <= lo:
            j += 1
        k, covered = j, 0.0
        while k < len(union) and union[k][0] < hi:
            covered += min(hi, union[k][1]) - max(lo, union[k][0])
            k += 1
        out.append(covered)
    return out
