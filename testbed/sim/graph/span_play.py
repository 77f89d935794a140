"""The task graph's tensor-parallel collectives of an action, a mixin of testbed.sim.graph.program: after its compute
(Megatron's all-reduces, or with sequence parallelism all-gathers and reduce-scatters: blocking, the next action
waits; :meth:`SpanPlay._tensor`), GEMM by GEMM with ``runtime.tp_comm_overlap`` (testbed.sim.step.tp_overlap), or span
by span among an fsdp action's blocks (testbed.sim.step.block_spans): the tasks of testbed.sim.step.span_order's plays, the
decision the analytic tier (testbed.explore.span_times) times too.

Where an action gathers its sharded parameters block by block and the blocks are the runner's own pieces (the
embedding, each layer, the head), the runner's program runs each span's blocking tensor collectives right after
that span, before the next span computes, not all after the action's compute; testbed.sim.step.span_order states the
rules of that schedule (measured against the traced program) and writes each block's play, which
:meth:`SpanPlay._span_block` makes tasks of.

Without a tensor axis actions have no collectives between spans: nothing changes.
"""

from __future__ import annotations

from typing import NamedTuple

from testbed.model.gemm import scaled
from testbed.model.blocks import PIECE_PARTS
from testbed.sim.step.block_spans import block_spans, span_reads
from testbed.sim.step.chunk_facts import ActionWork, ChunkFacts
from testbed.sim.graph.grad_play import grad_bucket
from testbed.sim.step.span_order import START, WAITING, BlockPlay, block_plays, merge_of, span_kernels, span_needs
from testbed.sim.graph.tasks import TaskKind, rep_group
from testbed.sim.step.tp_overlap import TpOverlap

__all__ = ["SpanPlay", "action_plays", "BlockWork"]


class BlockWork(NamedTuple):
    """What the spans of one block of an action share (:meth:`SpanPlay._span`): the action's FLOPs, the block's share
    of them, the block's GEMMs, its kernels, and the action's replicated and split activation bytes."""

    flops: float
    part: float
    gemms: tuple
    kernels: int
    replicated: float
    split: float


def action_plays(chunk: ChunkFacts, work: ActionWork, pieces: int, gathered_b: bool, sequence_parallel: bool,
                 reduce: bool) -> tuple[BlockPlay, ...]:
    """testbed.sim.step.span_order's play of each of an action's ``pieces`` blocks (empty: the action's tensor
    collectives follow its compute); ``gathered_b``: the backward gathers the parameters again; ``reduce``: the
    action releases the chunk's gradient buckets."""
    own = chunk.block_shares(work.kind, pieces)
    if work.overlap is not None or not work.spans or pieces != chunk.blocks or not own:
        return ()
    gathered = chunk.cost.has_head and gathered_b
    spans = block_spans(chunk.cost, work.kind, work.spans, work.tensor, gathered, pieces)
    if not spans:
        return ()
    flops = work.work.flops
    return block_plays(spans, tuple(flops * part for part, _ in own), flops, work.kind, sequence_parallel,
                       chunk.cost.has_embedding, tuple(chunk.reads(pieces, k) for k in range(pieces))
                       if reduce else None, _needs(chunk, work, pieces, gathered),
                       tuple(chunk.early(pieces, k) for k in range(pieces)) if reduce and work.kind == "B" else None,
                       chunk.cost.has_head, tuple(chunk.cuts(pieces, k) for k in range(pieces)) if reduce else None)


def _needs(chunk: ChunkFacts, work: ActionWork, pieces: int, gathered: bool) -> tuple | None:
    """Per block of the action, per span, the last of the block's merged gathers it waits for
    (testbed.sim.step.span_order.span_needs of the leaves each span reads and each merge holds); None: not known."""
    holds = chunk.gather_holds(work.kind) if work.kind in ("F", "B") else ()
    reads = span_reads(chunk.cost, work.kind, work.spans, work.tensor, gathered, pieces)
    if len(holds) != pieces or len(reads) != pieces:
        return None
    cost = chunk.cost
    what = ["embedding"] * cost.has_embedding + ["layer"] * cost.layers + ["head"] * cost.has_head
    what = what if work.kind == "F" else what[::-1]
    return tuple(span_needs(r, h, PIECE_PARTS[w]) for r, h, w in zip(reads, holds, what))


class SpanPlay:
    """Methods of testbed.sim.graph.program's task graph that add an action's tensor collectives and play an fsdp
    action's blocks span by span (module docstring); they read its builder ``b``, ``plan``, ``facts``, ``reps``,
    ``tensor`` (each stage's tensor groups), ``block_gemms``, ``span_end`` and its ``_bucket``."""

    def _block_spans(self, chunk: ChunkFacts, work: ActionWork, pieces: int, reduce: bool) -> tuple:
        """:func:`action_plays` of the action (empty: its tensor collectives follow its compute)."""
        return action_plays(chunk, work, pieces, self.facts.gathers("B"), self.plan.sequence_parallel, reduce)

    def _span_block(self, s: int, chunk: ChunkFacts, label: str, k: int, pieces: int, play: BlockPlay,
                    matmuls: BlockWork, deps: list[int], gathers: list[int] | None, accumulate: bool = False
                    ) -> tuple[int, list[int], int]:
        """Block ``k`` of ``pieces`` played (``play``; ``matmuls``: :meth:`_span`'s work; ``deps``: what it starts
        after, the last of each chain of the block's gathers among them where it has some; ``gathers``: the task of
        each of the block's merged gathers, None: it has none; ``accumulate``: its buckets are an earlier
        microbatch's reduce-scatters into the sharded accumulator). Returns the block's last compute task, what the
        next block waits for, the compute tasks, when the block is done and the task that sums its input gradient
        (``play.summed``'s; -1: none)."""
        merges = set(gathers or ())
        previous = [d for d in deps if d not in merges]
        gathered = [d for d in deps if d in merges]  # the last of each chain: all of the block's gathers

        def token(d: int) -> list[int]:
            if d == START:
                return deps
            if d == WAITING:
                return gathered
            m = merge_of(d)
            return [*previous, gathers[min(m, len(gathers) - 1)]] if gathers and m >= 0 else previous
        ids: list[int] = []
        tasks: list[int] = []
        for item in play.items:
            after = [x for d in item.deps for x in ([ids[d]] if d >= 0 else token(d))]
            if item.stream == "compute":
                j, share = item.gemms
                gemms = scaled(self.block_gemms[j], share)
                ids.append(self._span(s, chunk, f"{label}/{k}{item.name}" if item.name[0] == "." else
                                      f"{label}/{item.name}", item.flops, gemms, matmuls, item.nbytes, after,
                                      item.passes))
                tasks.append(ids[-1])
            elif item.stream == "tensor":
                ids.append(self._tensor_chain(s, f"tp {label}/{k}{item.name}", item.transfers, tuple(after)))
            else:
                j, lo, hi = item.bucket
                if accumulate:
                    self._accumulate(s, chunk, f"{label}/{j}", after[0], chunk.bucket(pieces, j)[lo:hi])
                else:
                    self._span_buckets(s, chunk, label, after[0], j, chunk.bucket(pieces, j)[lo:hi])
                ids.append(after[0])

        def when(d: int) -> list[int]:
            return [ids[d]] if d >= 0 else token(d)
        done = [x for d in play.done for x in when(d)]
        return ids[play.last], [x for d in play.after for x in when(d)], tasks, done[-1], \
            ids[play.summed] if play.summed >= 0 else -1

    def _span_buckets(self, s: int, chunk: ChunkFacts, label: str, after: int, k: int, buckets) -> None:
        """Block ``k``'s gradient ``buckets`` (ChunkFacts.bucket), reduced after ``after``."""
        for fraction, count, op in buckets:
            self._bucket(s, after, grad_bucket(chunk, fraction, self.facts.reduce_bytes, f"{label}/{k}", count, op=op))

    def _span(self, s: int, chunk: ChunkFacts, name: str, flops: float, gemms, matmuls: BlockWork, nbytes: float,
              deps: list[int], passes: float = 0.0) -> int:
        """One span of ``flops`` on the compute stream (:meth:`_spans`): a roofline of its matmuls and its
        ``nbytes`` (testbed.sim.price.compute's spans), its FLOPs' share of the block's kernels, and ``passes`` (its
        share of the block's bytes) of the activations' bytes an elementwise calibration prices instead
        (``matmuls``: the block's :class:`BlockWork`)."""
        whole, part, _, kernels, replicated, split = matmuls
        return self.b.add(name=name, device=self.reps[s], stream="compute", kind=TaskKind.COMPUTE, deps=tuple(deps),
                          flops=flops, hbm_bytes=nbytes, replicated_bytes=replicated * part * passes,
                          split_bytes=split * part * passes, tensor_bytes=chunk.cost.tensor_bytes,
                          kernels=span_kernels(kernels, flops, whole * part),
                          pipeline=True, gemms=gemms, spans=((1.0, nbytes),))

    def _tensor(self, s: int, chunk: ChunkFacts, work: ActionWork, label: str, last: int,
                start: tuple[int, ...]) -> int:
        """Megatron's all-reduces, or with sequence parallelism all-gathers and reduce-scatters, after the action's
        compute (tensor stream, blocking: ChunkCost.tensor_collectives, the one decision the analytic tier reads
        too). With ``runtime.tp_comm_overlap`` they start with the compute (after ``start``, the compute's own
        dependencies) and the action ends when both have: an empty join task on the compute stream. Returns the
        action's last task."""
        if self.span_end is not None:  # played span by span (_compute)
            return self.span_end
        if self.plan.mesh.tensor <= 1 or not work.tensor:
            return last
        if work.overlap is not None:  # GEMM by GEMM (_overlap); what sits beside no GEMM blocks after it
            return self._tensor_chain(s, f"tp {label}", work.overlap.after, (last,))
        rep, groups = self.reps[s], self.tensor[s]
        overlap = self.plan.runtime.tp_comm_overlap
        compute, tp = last, start if overlap else (last,)
        for op, count, nbytes in work.tensor:
            tp = (self.b.add(name=f"tp {label}" if op == "all_reduce" else f"tp {label} {op}", device=rep,
                             stream="tensor", kind=TaskKind.COLLECTIVE, deps=tp, op=op, nbytes=nbytes, count=count,
                             group=rep_group(groups, rep), instances=groups, pipeline=True),)
        if not overlap:
            return tp[0]
        return self.b.add(name=f"tp overlap {label}", device=rep, stream="compute", kind=TaskKind.COMPUTE,
                          deps=(compute, tp[0]), pipeline=True)

    def _overlap(self, s: int, chunk: ChunkFacts, overlap: TpOverlap, label: str, last: int) -> int:
        """``runtime.tp_comm_overlap`` GEMM by GEMM (testbed.sim.step.tp_overlap), after the action's other work
        ``last``: per block, its collectives' first chunks (tensor stream), then its GEMMs (compute stream, after
        the previous block's) beside the other chunks; an empty join ends the action when both streams have."""
        rep, compute, tensor = self.reps[s], last, last
        for blk in overlap.blocks:
            first = tensor = self._tensor_chain(s, f"tp {label} {blk.name}", blk.first, (tensor,))
            compute = self.b.add(name=f"{label} {blk.name} gemms", device=rep, stream="compute",
                                 kind=TaskKind.COMPUTE, deps=(compute, first), flops=blk.flops,
                                 hbm_bytes=blk.hbm_bytes,
                                 tensor_bytes=chunk.cost.tensor_bytes, kernels=max(1, len(blk.gemms)), pipeline=True,
                                 gemms=blk.gemms)
            tensor = self._tensor_chain(s, f"tp {label} {blk.name} beside", blk.rest, (first,))
        return self.b.add(name=f"tp overlap {label}", device=rep, stream="compute", kind=TaskKind.COMPUTE,
                          deps=(compute, tensor), pipeline=True)

    def _tensor_chain(self, s: int, name: str, transfers, deps: tuple[int, ...]) -> int:
        """Tensor collectives ``(op, count, bytes each)`` one after another on the tensor stream after ``deps``;
        returns the last (``deps[0]`` when there are none)."""
        rep, groups, last = self.reps[s], self.tensor[s], deps
        for op, count, nbytes in transfers:
            last = (self.b.add(name=f"{name} {op}", device=rep, stream="tensor", kind=TaskKind.COLLECTIVE, deps=last,
                               op=op, nbytes=nbytes, count=count, group=rep_group(groups, rep), instances=groups,
                               pipeline=True),)
        return last[0]
