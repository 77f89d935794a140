"""What each task of an fsdp action's blocks waits for when the blocks are played span by span: the one decision
the task graph (testbed.sim.graph.span_play builds its tasks from it) and the analytic tier (testbed.explore.play times
it with :func:`time_block`) both read.

Where an action gathers its sharded parameters block by block and the blocks are the runner's own pieces (the
embedding, each layer, the head: testbed.sim.step.block_spans), the runner's program runs each span's blocking tensor
collectives (Megatron's all-reduces; under sequence parallelism its all-gathers and reduce-scatters) right after
that span, before the next span computes. Measured against the traced program (``simulate_workload(trace_plan(
plan), topology)``, fsdp x tensor on tpu-v5e-16x16), three more rules of XLA's schedule of that program (its
latency-hiding scheduler, testbed.sim.xla.overlap) hold:

- A block's weight gradients (what it computes beyond its spans' input gradients, which no tensor collective
  waits for) are computed just before the gradient reduce-scatter that reads them: after the block's last
  collectives where the block releases a bucket, else in the first later block that does. Under sequence
  parallelism they start as the block's last span ends, beside its last collectives (the all-gather of the
  cotangent the next block reads), and the next block waits for both; in the embedding's block too (the
  traced TPU fsdp32 x tensor 8 sequence parallel bf16 d_model 2048 seq 2048 step runs them beside its last
  all-gather). The first layer's go with the embedding's block, after the merges that read no held weight
  gradient have left (the table's reads only the scatter-add).
- A merged gradient reduce-scatter leaves once the weight gradients of the blocks it reads are computed
  (testbed.model.block_scatters.scatter_reads; XLA's scheduler starts a collective once its operands are ready), not
  after every held block's. Under sequence parallelism every layer's merge is issued in the embedding's block
  (it reads the backward's one all-reduce of the tensor-replicated gradients), yet the last layer's leaves
  beside the first layer's weight gradients, and a merge that reads the first layer's waits for them.
- A held block's weight gradients are cut by the merges that wait for them last (testbed.model.blocks
  .scatter_cuts): each merge's share (its members' matmuls) is computed and the merge leaves, then the next's;
  what later blocks' merges read after them (the traced TPU fsdp128 x tensor 2 sequence parallel fp32 d_model
  2048 layer: 0.498, 0.499, 0.373 ms of weight-gradient matmuls, a reduce-scatter leaving after each).
- A block is done, for the gathers that wait for it to free its weights (the prefetch rule), once its last
  span's collectives are: the next gathers do not contend with them on the links.
- A span waits for the merged all-gathers holding the leaves it reads (:func:`span_needs`), not for all of its
  block's: XLA starts an op once its operands are ready, and XLA's all-gather combiner splits a block's gathers
  into several merges (testbed.model.blocks.gather_holds), a merge at its last member's place. The traced TPU
  fsdp 128 x tensor 2 sequence parallel bf16 d_model 2048 seq 1024 step computes its first layer's norm and
  attention once the merge holding them (issued with the embedding's block) has landed (0.783 ms), before that
  layer's own merges, its MLP's weights (0.983 and 1.251 ms), and the superpod's traced step the same; the
  embedding's lookup, and its vocab-parallel sum, read only the token table (docs/program.md, "FSDP blocks span by span").
- The backward's gather of the chunk's last layer, which the runner does not link (testbed.model.leaves.linked_layer:
  it waits for its own cotangent, testbed.model.leaves.backward_waits), starts once the head's block has summed
  its input gradient over tensor (the collectives after the head's input-gradient span: Megatron's all-reduce,
  under sequence parallelism the reduce-scatter; without a tensor axis that span itself), not by the prefetch
  rule beside the head's backward (:attr:`BlockPlay.waits`, :attr:`BlockPlay.summed`). Side by side on the
  traced program (the final norm's backward, a few elementwise ops, between): TPU fsdp 32 x tensor 8 bf16
  d_model 2048 seq 2048, traced 4.054 ms, the plan's gather 3.908 at the all-reduce's end (3.229 by the prefetch rule).
- The backward's loss gradient (the head's first span, a span of its own where the head's weight is gathered again
  for the backward: testbed.sim.step.block_spans) reads only the forward's logits, not the head's re-gathered weight
  (testbed.model.blocks.span_leaves): it runs beside the head's backward gather.

:func:`block_plays` writes each block's play as :class:`Item` s whose ``deps`` name earlier items of the block or
one of :data:`START` (what the block starts after: the previous block's and the block's gathers), a
:func:`merged` token (the previous block's and the block's gathers up to one merge) and :data:`WAITING` (the
block's gathers; what the next block waits for includes them).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from testbed.model.leaves import backward_waits

__all__ = ["Item", "BlockPlay", "block_plays", "cotangent_block", "time_block", "span_kernels", "span_needs", "merged", "merge_of",
           "START", "WAITING", "MERGED"]

START, WAITING, MERGED = -1, -3, -4


class Item(NamedTuple):
    """One task of a block's play. ``stream``: ``compute`` (``flops``, ``gemms``: (block, the share of that
    block's GEMMs), ``nbytes`` its HBM bytes, ``passes`` its share of the block's replicated and split bytes),
    ``tensor`` (``transfers``: tensor collectives ``(op, count, bytes)`` one after another) or ``buckets`` (block
    ``bucket[0]``'s gradient reductions ``bucket[1]:bucket[2]`` of ChunkFacts.bucket, ``bucket[2]`` None: to the
    end, leaving once ``deps`` are done)."""

    stream: str
    name: str
    deps: tuple[int, ...]
    flops: float = 0.0
    gemms: tuple[int, float] = (0, 0.0)
    nbytes: float = 0.0
    passes: float = 0.0
    transfers: tuple = ()
    bucket: tuple = ()


class BlockPlay(NamedTuple):
    """One block's :class:`Item` s; ``after``: what the next block starts after; ``done``: the last of these is when
    the block has freed its weights (the prefetch rule); ``last``: its last compute item; ``summed``: the item
    whose end has the block's input gradient summed over tensor (-1: none stated; the head's in the backward);
    ``waits``: the earlier block whose ``summed`` this block's gather also waits for (-1: none; the unlinked
    last layer's in the backward waits for the head's, :func:`cotangent_block`)."""

    items: tuple[Item, ...]
    after: tuple[int, ...]
    done: tuple[int, ...]
    last: int
    summed: int = -1
    waits: int = -1


def cotangent_block(kind: str, k: int, layers: int, head: bool) -> int:
    """The earlier block (backward order) whose summed input gradient block ``k``'s gather waits for beyond the
    prefetch rule, -1 where none: a ``B`` action's unlinked layer (testbed.model.leaves.backward_waits: its gather
    waits for its own cotangent, which the block just before computes), the chunk's last layer after the head.
    A linked layer's gather waits for the cotangent two blocks back, which the prefetch rule's wait covers (that
    block is done, its collectives included, before the gather starts)."""
    if kind != "B" or layers < 1:
        return -1
    waits = backward_waits(layers, head)
    return k - 1 if 0 < k < len(waits) and waits[k] == k - 1 else -1


def _summed(items: list[Item], first: int) -> int:
    """The item that ends the head's input-gradient span in its backward play (its spans ``items[first:]``): the
    first span's collectives (the loss's gradient, a span of its own before it, has none), without a tensor axis
    the last span."""
    return next((i for i in range(first, len(items)) if items[i].stream == "tensor"), len(items) - 1)


def span_kernels(kernels: int, flops: float, block: float) -> int:
    """The kernels of a span of ``flops`` in a block of ``block`` FLOPs and ``kernels`` kernels: its FLOPs' share of
    them, at least one (the task graph's task and the analytic tier's price read it)."""
    return max(1, round(kernels * flops / block)) if block else max(1, kernels)


def merged(m: int) -> int:
    """The token of a span that waits for the previous block's and its block's gathers up to merge ``m`` (-1: none
    of its block's; :func:`merge_of` reads it back)."""
    return MERGED - 1 - m


def merge_of(token: int) -> int:
    """The merge a :func:`merged` token waits for (-1: none of its block's)."""
    return MERGED - 1 - token


def span_needs(reads: tuple[frozenset[str] | None, ...], holds: tuple[frozenset[str] | None, ...],
               parts: frozenset[str]) -> tuple[int | None, ...]:
    """Per span of a block (``reads``: the leaves it reads, testbed.sim.step.block_spans.span_reads; None: all), the
    last of the block's merged gathers (``holds``: each one's leaves of the block, testbed.model.blocks.
    gather_holds; None: anything) it waits for: the last holding a leaf it reads or one ``parts`` (the piece's
    leaves testbed.model.blocks.span_leaves names) does not name; -1 where none of the block's (its leaves came
    in earlier blocks' merges); None: all of them (what it reads is not known)."""
    out: list[int | None] = []
    for read in reads:
        if read is None or not holds:
            out.append(None)
            continue
        out.append(max((m for m, held in enumerate(holds) if held is None or held & read or held - parts),
                       default=-1))
    return tuple(out)


def _spans(spans: tuple, block: float, flops: float, k: int, needs: tuple[int | None, ...] | None,
           items: list[Item]) -> tuple[list[int], float]:
    """Block ``k``'s spans (each its share of the action's ``flops``, at most the block's ``block``), each span's
    tensor collectives after it, each span after the merged gathers it reads (``needs``: :func:`span_needs`;
    None: every span after all of them). Returns what the next item waits for and the FLOPs played."""
    done, deps = 0.0, []
    total = sum(span[1] for span in spans) or 1.0
    for j, (share, nbytes, transfers, beside) in enumerate(spans):
        f = max(0.0, min(block - done, flops * share))  # (the last spans' rounding: never below none)
        done += f
        need = needs[j] if needs is not None and j < len(needs) else None
        token = START if need is None else merged(need)
        after = tuple(deps) + ((token,) if j == 0 or token != START else ())
        items.append(Item("compute", f".{j}", after, f, (k, f / block if block else 1.0), nbytes, nbytes / total))
        span = len(items) - 1
        if transfers:
            items.append(Item("tensor", f".{j}", (span,), transfers=transfers))
        deps = [len(items) - 1]
        if beside:  # after them on the tensor stream, waited for by nothing after (block_spans' BlockSpan)
            items.append(Item("tensor", f".{j} again", (deps[0],), transfers=beside))
    return deps, done


@functools.lru_cache(maxsize=4096)  # pure, of values: plans alike in a chunk's blocks play them alike (a search's many)
def block_plays(spans: tuple, blocks: tuple[float, ...], flops: float, kind: str, sequence_parallel: bool,
                has_embedding: bool, buckets: tuple[tuple[tuple[int, ...], ...], ...] | None,
                needs: tuple[tuple[int | None, ...], ...] | None,
                early: tuple[tuple[float, ...], ...] | None = None, head: bool = False,
                cuts: tuple[tuple[tuple[float, ...], ...], ...] | None = None) -> tuple[BlockPlay, ...]:
    """Each block's play (module docstring). ``spans``: testbed.sim.step.block_spans' per block; ``blocks``: each
    block's FLOPs; ``flops``: the action's; ``buckets``: per block, each of its gradient reductions as the blocks
    whose weight gradients it reads (ChunkFacts.reads; None: the action reduces none); ``needs``: per block, per
    span, the last of the block's merged gathers it waits for (:func:`span_needs`; None: all); ``early``: per
    block, per reduction, the share of the block's weight gradients computed before its spans for that reduction
    to leave (ChunkFacts.early; 0 or None: none); ``head``: the action's chunk holds the head (the backward's first
    block); ``cuts``: per block, per reduction, per block it reads, the share of that block's weight-gradient
    matmuls it reads (ChunkFacts.cuts; None: the held weight gradients are not cut, :func:`_held`)."""
    held: list[tuple[int, float, float]] = []  # (block, weight-gradient FLOPs not played yet, their GEMMs' share)
    out, pieces, reduce = [], len(blocks), buckets is not None
    released: set[tuple[int, int]] = set()  # the reductions left before their block's spans
    for k, (mine, block) in enumerate(zip(spans, blocks)):
        items: list[Item] = []
        first = _first_weights(mine, block, flops, k, early[k] if reduce and early else (), items)
        released |= {(k, it.bucket[1]) for it in items if it.stream == "buckets"}
        spanned = len(items)
        deps, played = _spans(mine, block, flops, k, needs[k] if needs else None, items)
        summed = _summed(items, spanned) if kind == "B" and head and k == 0 else -1
        waits = cotangent_block(kind, k, pieces - int(has_embedding) - int(head), head)
        played += first
        done = tuple(deps)
        last = max(i for i, x in enumerate(items) if x.stream == "compute")
        rest = block - played if block - played > 1e-6 * block else 0.0
        held.append((k, rest, 1 - played / block if block else 0.0))
        first_layer = kind == "B" and has_embedding and k == pieces - 2
        if reduce and (not buckets[k] or first_layer) and k < pieces - 1:
            out.append(BlockPlay(tuple(items), (WAITING, *deps), done, last, summed, waits))
            continue  # its weight gradients wait for the bucket that reads them
        after = last if k < pieces - 1 else deps[-1]
        pending = [p for p in _pending(buckets, held, k) if p[:2] not in released] if reduce else []
        _release(items, pending, set(), after)  # what reads no weight gradient held (the embedding's table)
        last, after, deps = _held(items, held, pending, last, after, deps, sequence_parallel,
                                  _cuts(buckets, cuts, early) if reduce else None)
        _release(items, pending, None, after)
        held = []
        out.append(BlockPlay(tuple(items), (WAITING, *deps), done, last, summed, waits))
    return tuple(out)


def _cuts(buckets: tuple, cuts: tuple | None, early: tuple | None):
    """``cut(block j, reduction m, held block i)``: the share of block ``i``'s weight gradients held to its play
    (those not computed first for ``early`` reductions) that reduction ``m`` of bucket ``j`` reads (``cuts``: per
    block, per reduction, per block of its ``buckets`` reads, the share of that block's weight-gradient matmuls;
    None: the cut is not played)."""
    if cuts is None:
        return None

    def cut(j: int, m: int, i: int) -> float:
        held = 1.0 - (sum(early[i]) if early else 0.0)
        return min(1.0, cuts[j][m][buckets[j][m].index(i)] / held) if held > 1e-9 and i in buckets[j][m] else 0.0
    return cut


def _held(items: list[Item], held: list[tuple[int, float, float]], pending: list, last: int, after: int,
          deps: list[int], beside: bool, cut) -> tuple[int, int, list[int]]:
    """The held blocks' weight gradients (``held``: (block, FLOPs, their GEMMs' share)) computed after ``deps``
    (under sequence parallelism beside the block's last collectives: after its ``last`` compute item), each
    ``pending`` reduction released once the weight gradients it reads are. The cut (``cut``, :func:`_cuts`; None:
    none): a held block's weight gradients are cut by the reductions that wait for that block last, each
    computing its share and leaving after it, before the block's other weight gradients (the traced layer
    computes a merge's weight-gradient matmuls, then that merge's reduce-scatter leaves: XLA starts a
    reduce-scatter once its operands are ready; testbed.model.block_scatters.scatter_cuts). Returns (the last compute
    item, what a release waits for, what the next item waits for)."""
    chain, computed = list(deps), set()
    for i, f, share in ((i, f, share) for i, f, share in held if f):
        ready = [p for p in pending if i in p[2] and p[2] <= computed | {i}] if cut is not None else []
        parts, left = [], f
        for p in ready:
            x = min(left, f * cut(p[0], p[1], i))
            parts.append((p, x))
            left -= x
        for p, x in parts + [(None, left)]:
            if x > 1e-9 * f:
                items.append(Item("compute", f"{i} weights", (last,) if beside else tuple(deps), x,
                                  (i, share * x / f)))
                last = after = len(items) - 1
                deps = [last, *chain] if beside else [last]
            if p is not None:
                _release(items, [p], None, after)
                pending.remove(p)
        computed.add(i)
        _release(items, pending, computed, after)
    return last, after, deps


def _first_weights(spans: tuple, block: float, flops: float, k: int, early: tuple[float, ...], items: list[Item]
                   ) -> float:
    """Block ``k``'s weight gradients that reductions read before its spans (``early``: per reduction, its share
    of the block's weight gradients; testbed.model.block_scatters.scatter_early), each computed first and its reduction
    released after it (XLA starts a reduce-scatter once its operands are ready). Returns their FLOPs."""
    if not any(early):
        return 0.0
    _, played = _spans(spans, block, flops, k, None, [])
    rest, share = max(0.0, block - played), 1 - played / block if block else 0.0
    done = 0.0
    for m, e in ((m, e) for m, e in enumerate(early) if e):
        items.append(Item("compute", f"{k} first weights", (START,), rest * e, (k, share * e)))
        items.append(Item("buckets", "", (len(items) - 1,), bucket=(k, m, m + 1)))
        done += rest * e
    return done


def _pending(buckets: tuple, held: list[tuple[int, float, float]], k: int) -> list[tuple[int, int, set[int]]]:
    """The reductions block ``k`` releases (those of the blocks it holds weight gradients of, then its own), each
    (block, index, the held blocks whose weight gradients it still waits for)."""
    waiting = {i for i, f, _ in held if f}
    return [(j, m, set(reads) & waiting) for j in dict.fromkeys([*(i for i, _, _ in held if i != k), k])
            for m, reads in enumerate(buckets[j])]


def _release(items: list[Item], pending: list[tuple[int, int, set[int]]], computed: set[int] | None,
             after: int) -> None:
    """A ``buckets`` item after ``after`` for each run of ``pending`` reductions whose weight gradients are all
    ``computed`` (None: every one left), in order; removes them. XLA starts a reduce-scatter once its operands are
    ready: a merge leaves once the blocks it reads have computed their weight gradients, not after every block's."""
    ready = [p for p in pending if computed is None or p[2] <= computed]
    for j, m, _ in ready:
        if items and items[-1].stream == "buckets" and items[-1].deps == (after,) and items[-1].bucket[0] == j \
                and items[-1].bucket[2] == m:
            items[-1] = items[-1]._replace(bucket=(j, items[-1].bucket[1], m + 1))
        else:
            items.append(Item("buckets", "", (after,), bucket=(j, m, m + 1)))
    pending[:] = [p for p in pending if p not in ready]


class _Program(NamedTuple):
    """A :class:`BlockPlay` as :func:`time_block` reads it: each item's stream (0 compute, 1 tensor, 2 buckets)
    and the slot (or, waiting for several, the slots) of what it waits for, in a list of times holding
    :data:`START`'s, :data:`WAITING`'s, the previous block's, each of ``tokens`` merges' (a :func:`merged`
    token's) and then each item's end; the slots of ``play.after`` and ``play.done[-1]``, and ``play.summed``'s
    (-1: none)."""

    tokens: int
    steps: tuple[tuple[int, int, tuple[int, ...] | None], ...]
    after: tuple[int, ...]
    done: int
    summed: int


_STREAMS = {"compute": 0, "tensor": 1}
_PROGRAMS: dict[int, tuple[BlockPlay, _Program]] = {}  # id(play) -> (play, its program): plays are reused by many
_MAX_PROGRAMS = 1 << 16  # (emptied past it)


def _program(play: BlockPlay) -> _Program:
    """``play``'s :class:`_Program`, memoized by identity (the play kept, so its id is not reused)."""
    hit = _PROGRAMS.get(id(play))
    if hit is not None and hit[0] is play:
        return hit[1]
    tokens = max((merge_of(d) + 1 for item in play.items for d in item.deps if d < 0 and d not in (START, WAITING)),
                 default=0)
    base = 3 + tokens

    def slot(d: int) -> int:
        if d >= 0:
            return base + d
        if d == START:
            return 0
        if d == WAITING:
            return 1
        return 3 + merge_of(d) if merge_of(d) >= 0 else 2
    steps = tuple((_STREAMS.get(item.stream, 2), slot(item.deps[0]) if len(item.deps) == 1 else 0,
                   tuple(slot(d) for d in item.deps) if len(item.deps) > 1 else None) for item in play.items)
    out = _Program(tokens, steps, tuple(slot(d) for d in play.after), slot(play.done[-1]),
                   base + play.summed if play.summed >= 0 else -1)
    if len(_PROGRAMS) >= _MAX_PROGRAMS:
        _PROGRAMS.clear()
    _PROGRAMS[id(play)] = (play, out)
    return out


def time_block(play: BlockPlay, seconds: tuple[float, ...], start: float, previous: float,
               merges: tuple[float, ...], gathered: float, compute: float, tensor: float
               ) -> tuple[float, float, float, float, list[tuple[int, float]], float, float]:
    """One block's play timed (the analytic tier): each item its ``seconds`` once its stream (``compute`` and
    ``tensor``: when each is free) and its ``deps`` are (:data:`START` at ``start``, a :func:`merged` token once
    ``previous`` (the previous block's) and that merge (``merges``: when each of the block's lands; none: at
    ``gathered``) are, :data:`WAITING` at ``gathered``). Returns (when what the next block waits for is done, when
    the block is done, the compute stream's and the tensor stream's end, each ``buckets`` item's index and when it
    leaves (its seconds: those of its reductions held on the compute stream,
    testbed.sim.step.step_rules.held_stream), when its first compute item starts, when its input gradient is summed:
    ``play.summed``'s end, 0 where none). An item waiting for none starts at ``start``."""
    program = _program(play)
    times = [start, gathered, previous]  # (the slots of _Program)
    if program.tokens:
        n = len(merges)
        for m in range(program.tokens):
            x = merges[m] if m < n else gathered
            times.append(x if x > previous else previous)
    base = len(times)
    releases = []
    first = None
    for (stream, dep, deps), s in zip(program.steps, seconds):
        at = times[dep] if deps is None else max([times[d] for d in deps])
        if stream == 0:
            if compute > at:
                at = compute
            compute = at + s
            if first is None:
                first = at
        elif stream == 1:
            if tensor > at:
                at = tensor
            tensor = at + s
        else:  # a bucket: its reductions leave for the grad stream, those held (``s``) run on the compute stream
            if s:
                if compute > at:
                    at = compute
                compute = at + s
            releases.append((len(times) - base, at))
        times.append(at + s)
    return (max([times[d] for d in program.after]), times[program.done], compute, tensor, releases,
            start if first is None else first, times[program.summed] if program.summed >= 0 else 0.0)
