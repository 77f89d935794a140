"""The task graph's gradient reductions of an action, a mixin of testbed.sim.graph.program: the gradient buckets a chunk's
last backward releases (reduced as they come when they reduce in the backward, StepFacts.reduce_in_backward, else
kept for the stage's one reduction before its update), an earlier microbatch's reduce-scatters into the sharded
accumulator, and the sequence-replicated gradients' sum where it leaves as the backward's compute ends. When each
leaves is testbed.sim.step.step_rules' (gradients, first_tail_bucket, sequence_apart); the tasks of one bucket are
testbed.sim.graph.grad_tasks.reduce_tasks'.
"""

from __future__ import annotations

from typing import NamedTuple

from testbed.model.activations import LOSS_BYTES
from testbed.sim.step.chunk_facts import ChunkFacts
from testbed.sim.graph.grad_tasks import reduce_tasks, shard_sum_task
from testbed.sim.step.step_rules import sequence_apart
from testbed.sim.graph.tasks import TaskKind, rep_group

__all__ = ["GradPlay", "GradBucket", "grad_bucket"]


class GradBucket(NamedTuple):
    """One bucket of a chunk's gradients as the task graph reduces it (testbed.sim.graph.grad_tasks.reduce_tasks): its
    bytes, its special parameters' bytes (ChunkFacts.special), its tasks' label, its collectives (``leaves``; 0:
    one) and the token table's part reduced apart (ChunkFacts.tail)."""

    nbytes: float
    special: tuple[float, float]
    label: str
    leaves: int
    tail: tuple[float, float] = (0.0, 0.0)
    #: The op its dense reduce-scatter compiles to where another (ChunkFacts.bucket's BucketMerge.op; empty: none).
    op: str = ""


def grad_bucket(chunk: ChunkFacts, share: float, reduce_bytes: float, label: str, leaves: int,
                tail: tuple[float, float] = (0.0, 0.0), op: str = "") -> GradBucket:
    """The bucket of ``share`` of ``chunk``'s gradients, reduced in ``reduce_bytes`` per value (``op``: GradBucket's)."""
    return GradBucket(chunk.reduced.last * share, chunk.special(share, reduce_bytes), label, leaves, tail, op)


class GradPlay:
    """The gradient reductions' tasks of testbed.sim.graph.program's graph (its attributes: the builder ``b``, ``facts``,
    ``reps``, the groups, ``reduce_tasks`` and ``once`` per stage, the action's ``tail`` buckets)."""

    def _summed(self, s: int, chunk: ChunkFacts, label: str, last: int) -> None:
        """The sequence-replicated gradients' sum as the action's compute (``last``) ends, on its own stream
        (testbed.sim.step.step_rules.Gradients.summed)."""
        facts = self.facts
        self.reduce_tasks[s].extend(reduce_tasks(
            self.b, facts.reductions, self.groups, self.plan, s, self.reps[s], last, chunk.reduced.last,
            chunk.special(1.0, facts.reduce_bytes), label, 0, select=True, stream="sequence"))

    def _buckets_of(self, s: int, chunk: ChunkFacts, label: str, pieces: int, k: int, last: int, tail: bool) -> None:
        """Bucket ``k`` of ``pieces``, its share of the chunk's gradients (ChunkFacts.bucket), after ``last``:
        reduced while the backward continues when they accumulate sharded, else once the stage's backward is done;
        ``tail``: only after the action's tensor collectives (step_rules.first_tail_bucket)."""
        for fraction, count, op in chunk.bucket(pieces, k):
            bucket_of = grad_bucket(chunk, fraction, self.facts.reduce_bytes, label if pieces == 1 else f"{label}/{k}",
                                    count, chunk.tail if pieces == 1 else (0.0, 0.0), op)
            if tail:
                self.tail.append(bucket_of)
            else:
                self._bucket(s, last, bucket_of)

    def _bucket(self, s: int, after: int, bucket_of: GradBucket) -> None:
        """One bucket of gradients: reduced at once when they accumulate sharded, else kept for the update."""
        if self.facts.reduce_in_backward:
            loss = LOSS_BYTES if self._carries_loss(s, bucket_of) else 0.0
            self.reduce_tasks[s].extend(self._reduce(s, after, *bucket_of, loss=loss))
        else:
            self.once[s].append(bucket_of)

    def _carries_loss(self, s: int, bucket_of: GradBucket) -> bool:
        """Whether the loss's sum rides in this bucket's all-reduce (testbed.plan.sharding.loss_merged): the stage's
        first that is one over the loss's axes (every bucket's where the dense gradients are unsharded or their
        reduce-scatter is that all-reduce; else the rank-1 gradients' all-reduce, testbed.sim.xla.xla_tpu.merges_loss)."""
        facts = self.facts
        if not facts.loss_merged or self.loss_placed[s]:
            return False
        dense = [r for r in facts.reductions if not (r.expert or r.sequence)]
        whole = all(not r.sharded or r.scatter_op == "all_reduce" for r in dense)
        self.loss_placed[s] = whole or bucket_of.op == "all_reduce"
        return self.loss_placed[s]

    def _accumulate(self, s: int, chunk: ChunkFacts, label: str, after: int, buckets) -> None:
        """An earlier microbatch's ``buckets`` (ChunkFacts.bucket of one block) reduce-scattered into the sharded
        accumulator once ``after`` is done: in a loop XLA keeps, bucket by bucket as the backward makes them."""
        for fraction, count, _ in buckets:
            self.reduce_tasks[s].append(self._scatter(s, chunk, label, after, fraction, count))

    def _scatter(self, s: int, chunk: ChunkFacts, label: str, last: int, fraction: float = 1.0,
                 count: int = 0) -> int:
        """An earlier microbatch's gradients (``fraction`` of them, in ``count`` collectives; default all, one per
        leaf) reduce-scattered into the sharded accumulator (grad stream)."""
        rep, groups, leaves = self.reps[s], self.g_groups[s], count or max(1, chunk.leaves)
        op = self.facts.accumulate_op
        return self.b.add(name=f"{op} {label} (accumulate)", device=rep, stream="grad",
                          kind=TaskKind.COLLECTIVE, deps=(last,), op=op,
                          nbytes=chunk.reduced.each_microbatch * fraction / leaves, count=leaves,
                          group=rep_group(groups, rep), instances=groups)

    def _reduce(self, s: int, after: int, nbytes: float, special: tuple[float, float], label: str,
                leaves: int, tail: tuple[float, float] = (0.0, 0.0), op: str = "", loss: float = 0.0) -> list[int]:
        """One bucket's gradient reduction tasks (testbed.sim.graph.grad_tasks.reduce_tasks; ``tail``: ChunkFacts.tail),
        but the sequence-replicated parameters' where they left at the backward's end
        (testbed.sim.step.step_rules.sequence_apart); returns the last one(s)."""
        return reduce_tasks(self.b, self.facts.reductions, self.groups, self.plan, s, self.reps[s], after, nbytes,
                            special, label, leaves, tail, select=False if sequence_apart(self.facts) else None,
                            loss=loss, op=op)

    def reduce_kept(self, s: int) -> None:
        """The replicas' one reduction of the buckets kept for stage ``s``'s update, after its last action (the loss's
        sum merged into the first: testbed.plan.sharding.loss_merged), then the stage's merged all-reduces of its
        gradient shards (StepFacts.shard_sum: testbed.sim.graph.grad_tasks.shard_sum_task). Called once per stage."""
        for k, bucket_of in enumerate(self.once[s]):
            loss = LOSS_BYTES if k == 0 and self.facts.loss_merged else 0.0
            self.reduce_tasks[s].extend(self._reduce(s, self.previous[s], *bucket_of, loss=loss))
        sums = self.facts.shard_sum(s)
        if sums is not None:  # the merged shard all-reduces, after every bucket
            self.reduce_tasks[s].append(shard_sum_task(self.b, self.groups, self.plan, s, self.reps[s],
                                                       tuple(self.reduce_tasks[s]), sums))
