"""The analytic tier's prices of a step's gradient reductions (a mixin of testbed.explore.prices.StepPrices): each
bucket of a chunk's last backward reduced as testbed.sim.graph.program's ``_reduce`` reduces it (by the facts'
reductions, :class:`Reduced`), and an earlier microbatch's reduce-scatters into the sharded accumulator, each by the
simulator's own collective timing (testbed.explore.stage_collectives).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from testbed.collectives.routed import topology_memo
from testbed.explore.held_blocks import Part
from testbed.plan.spec import Axis
from testbed.sim.graph.grad_tasks import allreduce_count
from testbed.sim.price.barriers import Syncs
from testbed.sim.step.chunk_facts import ChunkFacts
from testbed.sim.step.facts import StepFacts, bucket_share
from testbed.sim.step.step_rules import gradients, held_stream, sequence_apart

if TYPE_CHECKING:
    from testbed.explore.stage_collectives import StageCollectives
    from testbed.topology import Topology

__all__ = ["Reduced", "ReductionPrices", "reduction_memo"]

#: At most this many placements, meshes and reductions alike whose gradient reductions a topology's memo keeps
#: (:meth:`ReductionPrices._reduce`).
_REDUCED = 4096


class Reduced(NamedTuple):
    """One gradient bucket's reduction, priced: its seconds on the grad stream, its collectives as barriers, and its
    seconds held in program order with the compute (testbed.sim.step.step_rules.held_stream: XLA:TPU's all-reduces)."""

    seconds: float
    syncs: Syncs
    held: float = 0.0
    held_parts: tuple[Part, ...] = ()  # the held collectives one after another: (seconds, what each moves)


def reduction_memo(topology: Topology, placement, facts: StepFacts) -> dict[tuple, Reduced]:
    """:meth:`ReductionPrices._reduce`'s memo, kept per topology across plans alike in all it reads beside its
    arguments: the placement (its collectives' groups), the mesh, the reductions and the collectives held with
    the compute."""
    reduced = topology_memo(topology).setdefault("reduced", {})
    if len(reduced) > _REDUCED:
        reduced.clear()
    return reduced.setdefault((placement, facts.plan.mesh, facts.reductions, facts.held), {})


class ReductionPrices:
    """The gradient reductions' prices of testbed.explore.prices.StepPrices, which sets ``facts``, ``coll`` and
    ``_reduced`` (:func:`reduction_memo`)."""

    facts: StepFacts
    coll: StageCollectives
    _reduced: dict[tuple, Reduced]

    def _buckets(self, s: int, chunk: ChunkFacts, pieces: int
                 ) -> tuple[float, Syncs, float, tuple[Reduced, ...], float, tuple[tuple[Part, ...], ...]]:
        """The chunk's last backward's ``pieces`` gradient buckets: (one bucket's reduction seconds, its barriers,
        the sequence-replicated gradients' sum as the compute ends (its own stream; each microbatch's is the same
        small sum, counted once), each bucket's own seconds where they differ: its block's merged sizes, or its own
        count of collectives as the task graph's buckets, :class:`Reduced`; empty: all alike; one bucket's seconds
        held with the compute, and each bucket's held collectives: empty where none)."""
        facts, reduced = self.facts, chunk.reduced
        early = sequence_apart(facts)
        bucket, syncs, held, parts = self._bucket(s, chunk, pieces)
        sequence_s = self._reduce(s, reduced.last, chunk.special(1.0, facts.reduce_bytes),
                                  select=True)[0] if early else 0.0
        each: tuple[Reduced, ...] = ()
        if chunk.bucket_sizes and pieces == len(chunk.bucket_sizes):
            each = tuple(_summed([self._reduce(s, reduced.last * f, chunk.special(f, facts.reduce_bytes), n, op=op)
                                  for f, n, op in chunk.bucket(pieces, k)]) for k in range(pieces))
        elif chunk.reduction_collectives and chunk.reduction_collectives % pieces:
            own = {n: self._reduce(s, reduced.last / pieces, chunk.special(1 / pieces, facts.reduce_bytes), n)
                   for n in {bucket_share(chunk.reduction_collectives, pieces, k) for k in range(pieces)}}
            each = tuple(own[bucket_share(chunk.reduction_collectives, pieces, k)] for k in range(pieces))
        held_parts = tuple(r.held_parts for r in each) if each else (parts,) * pieces
        return bucket, syncs, sequence_s, each, held, held_parts if any(held_parts) else ()

    def _bucket(self, s: int, chunk: ChunkFacts, pieces: int) -> Reduced:
        """One of the chunk's last backward's ``pieces`` gradient buckets' reduction (:meth:`_buckets`' first)."""
        facts = self.facts
        return self._reduce(s, chunk.reduced.last / pieces, chunk.special(1 / pieces, facts.reduce_bytes),
                            chunk.reduction_collectives / pieces, chunk.tail if pieces == 1 else (0.0, 0.0),
                            False if sequence_apart(facts) else None)

    def _scatters(self, s: int, chunk: ChunkFacts, chain: bool
                  ) -> tuple[float, tuple[float, ...], float, tuple[tuple[Part, ...], ...]]:
        """An earlier microbatch's reduce-scatter into the sharded accumulator: its seconds, and in a loop XLA keeps
        (testbed.sim.step.grad_bytes.loop_kept) each bucket's as testbed.sim.graph.program reduce-scatters them, bucket by
        bucket as the backward makes them (empty: one, after the backward); the seconds of it held with the compute
        (all of it where the compiler runs its collective blocking: step_rules.held_stream; then the others are 0),
        and then each bucket's held collectives (testbed.explore.held_blocks; empty: none, or one after the
        backward)."""
        parts: tuple[tuple[Part, ...], ...] = ()
        if self._scatters_each(chunk, chain):
            parts = tuple(self._accumulated_parts(s, chunk, chunk.bucket(chunk.buckets, k))
                          for k in range(chunk.buckets))
        each = tuple(sum(x for x, _ in bucket) for bucket in parts)
        if held_stream(self.facts, self.facts.accumulate_op, "grad") == "compute":
            return 0.0, tuple(0.0 for _ in each), sum(each) if each else self._scattered(s, chunk), parts
        return self._scattered(s, chunk), each, 0.0, ()

    def _scatters_each(self, chunk: ChunkFacts, chain: bool) -> bool:
        """Whether an earlier microbatch reduce-scatters bucket by bucket (:meth:`_scatters`)."""
        return gradients(self.facts, self.facts.last_backward, chain, 1).each and chunk.buckets > 1

    def _scattered(self, s: int, chunk: ChunkFacts) -> float:
        """Seconds of an earlier microbatch's whole reduce-scatter into the sharded accumulator (:meth:`_scatters`)."""
        n = max(1, chunk.leaves)
        return n * self.coll.time(self.facts.accumulate_op, self.facts.per_microbatch, s,
                                  chunk.reduced.each_microbatch / n)

    def _scatter(self, s: int, chunk: ChunkFacts) -> float:
        """:meth:`_scatters`' first: an earlier microbatch's reduce-scatter seconds on the grad stream."""
        held = held_stream(self.facts, self.facts.accumulate_op, "grad") == "compute"
        return 0.0 if held else self._scattered(s, chunk)

    def _accumulated(self, s: int, chunk: ChunkFacts, buckets) -> float:
        """Seconds of an earlier microbatch's reduce-scatters of ``buckets`` (ChunkFacts.bucket's (share,
        collectives)) into the sharded accumulator, as testbed.sim.graph.program's tasks."""
        return sum(x for x, _ in self._accumulated_parts(s, chunk, buckets))

    def _accumulated_parts(self, s: int, chunk: ChunkFacts, buckets) -> tuple[Part, ...]:
        """:meth:`_accumulated`'s collectives one after another: (seconds, what each moves)."""
        time, axes = self.coll.time, self.facts.per_microbatch
        each = chunk.reduced.each_microbatch
        op = self.facts.accumulate_op
        return tuple((max(1, m) * time(op, axes, s, each * f / max(1, m)), (op, axes, each * f / max(1, m)))
                     for f, m, _ in buckets)

    def _reduce(self, stage: int, nbytes: float, special: tuple, leaves: float = 0.0,
                tail: tuple[float, float] = (0.0, 0.0), select: bool | None = None, op: str = "") -> Reduced:
        """One gradient bucket's reduction (testbed.sim.graph.program's ``_reduce``, by the facts' reductions): per
        parameter kind, a reduce-scatter over its reduction axes the optimizer state is sharded on (``leaves``
        collectives of the bucket when the parameters are sharded, a share of them per kind; 0: one), then an
        all-reduce over the rest (with ``tail``, ChunkFacts.tail, the token table's apart after a tensor
        all-gather; ``select``: testbed.sim.graph.grad_tasks.reduce_tasks'). Its seconds (those the compiler runs
        blocking held with the compute: step_rules.held_stream, but the sequence-replicated gradients' sum's, on their
        own stream) and its collectives as barriers (testbed.sim.price.barriers), the first first; ``op``: the dense
        reduce-scatter's op where the compiler makes it another (testbed.sim.graph.grad_tasks.reduce_tasks').
        Memoized (a chunk's alike buckets and blocks, and other plans' of the same placement, mesh and reductions)."""
        key = (stage, nbytes, special, leaves, tail, select, op)
        hit = self._reduced.get(key)
        if hit is None:
            hit = self._reduced[key] = self._reduce_of(stage, nbytes, special, leaves, tail, select, op)
        return hit

    def _reduce_of(self, stage: int, nbytes: float, special: tuple, leaves: float, tail: tuple[float, float],
                   select: bool | None, op: str = "") -> Reduced:
        """:meth:`_reduce`, not memoized."""
        mesh, syncs, facts = self.facts.plan.mesh, [], self.facts
        times = {False: 0.0, True: 0.0}  # held with the compute or not -> seconds
        held: list[Part] = []

        def add(op: str, seconds: float, axes: tuple[Axis, ...], each: float) -> None:
            blocking = select is not True and held_stream(facts, op, "grad") == "compute"
            times[blocking] += seconds
            if blocking and seconds:
                held.append((seconds, (op, axes, each)))
        for r in self.facts.reductions:
            size = r.size(nbytes, special)
            if size <= 0 or (select is not None and r.sequence != select):
                continue
            token = tail[0] if not (r.expert or r.sequence or r.sharded) and r.rest else 0.0
            if r.sharded:
                n = max(1.0, leaves * size / nbytes) if leaves else 1.0
                scatter = op if op and not (r.expert or r.sequence) else r.scatter_op
                add(scatter, n * self.coll.time(scatter, r.sharded, stage, size / n), r.sharded, size / n)
                syncs.append((r.ways, n))
            if r.rest and not r.rest_merged:  # a merged one after the stage's last bucket (StepPrices.shard_sum_s)
                n_ar = allreduce_count(self.facts.reductions, leaves, size, nbytes, special[0], r.expert)
                each = (size - token) / r.ways / n_ar
                add("all_reduce", n_ar * self.coll.time("all_reduce", r.rest, stage, each), r.rest, each)
                syncs.append((math.prod(mesh.degree(a) for a in r.rest), n_ar))
            if token:  # the embedding's merged gather over tensor, then the token table's sum
                add("all_gather", self.coll.time("all_gather", (Axis.TENSOR,), stage, tail[1]), (Axis.TENSOR,), tail[1])
                add("all_reduce", self.coll.time("all_reduce", r.rest, stage, token / r.ways), r.rest, token / r.ways)
                syncs += [(mesh.tensor, 1), (math.prod(mesh.degree(a) for a in r.rest), 1)]
        return Reduced(times[False], tuple(syncs), times[True], tuple(held))


def _summed(reduced: list[Reduced]) -> Reduced:
    """Reductions one after another, as one (their barriers' count is not read)."""
    return Reduced(sum(r.seconds for r in reduced), (), sum(r.held for r in reduced),
                   tuple(p for r in reduced for p in r.held_parts))
