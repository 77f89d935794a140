"""An fsdp action's blocks span by span, each span's tensor collectives after it, where the blocks are the runner's.

Plan-driven simulation plays an action's blocking tensor collectives (Megatron's all-reduces, or sequence
parallelism's all-gathers and reduce-scatters; the vocab-parallel loss's) after the action's compute, and prices
the compute as a roofline per span between them (testbed.model.spans). Where the action is split into blocks that
each gather their parameters first (fsdp, ZeRO-3) and the blocks are the runner's own pieces (the embedding, each
layer, the head: testbed.model.leaves.own_blocks), that order hides the later blocks' gathers behind compute
alone, and the collectives then run beside the next action's first gathers on shared links. In the runner's
program each span's collective follows that span, before the next computes: a block's gathers hide behind its
spans and their collectives together. :func:`block_spans` cuts each block into its spans, each with the
collectives that follow it; testbed.sim.step.span_order decides what each span waits for, which the task graph
(testbed.sim.graph.span_play) and the analytic tier (testbed.explore.span_times) both play.

Which collective follows which span (forward; backward their transposes, in reverse): the embedding's lookup,
the vocab-parallel sum (an all-reduce, under sequence parallelism a reduce-scatter); a layer's attention and MLP,
each its out projection's all-reduce (reduce-scatter); under sequence parallelism each norm, the all-gather of
the sequence before the next column-parallel matmul; the head, the loss's first all-reduce (the logits' maximum
and the target's logit); the loss's sum of exponentials, its second. Backward: the loss's gradient none, the
head's input gradient its all-reduce (reduce-scatter), each layer's MLP and attention their input gradients'
all-reduces (reduce-scatters), each norm the all-gather of its cotangent, the embedding's scatter-add the
position table's gradient gather where there is one.
"""

from __future__ import annotations

from collections import Counter
from testbed.model.blocks import span_leaves
from testbed.model.costs import ChunkCost

__all__ = ["block_spans", "span_reads"]

Transfer = tuple[str, int, int]
#: One span of a block: (share of the action's matmul work, HBM bytes, the tensor collectives after it, those after
#: them on the tensor stream that no later span waits for: the backward's sequence all-gathers again, :func:`_regathers`).
BlockSpan = tuple[float, float, tuple[Transfer, ...], tuple[Transfer, ...]]


def _labels(cost: ChunkCost, kind: str, gathered: bool) -> list[tuple[str, str, int]]:
    """(piece, what, which of the piece's spans of that kind in forward order) of each span of a ``kind`` action in
    testbed.model.spans' order."""
    sp, per = cost.sequence_parallel, 1 if cost.parallel_block else 2
    layer = [(w, n) for n in range(per) for w in (["norm", "block"] if sp else ["block"])]
    head = (["norm"] if sp else []) + ["head"]
    if kind == "F":
        return ([("embedding", "lookup", 0)] * cost.has_embedding
                + [(f"layer{i}", w, n) for i in range(cost.layers) for w, n in layer]
                + [("head", w, 0) for w in head + ["loss"]] * cost.has_head)
    return ([("head", "lossgrad", 0)] * (cost.has_head and gathered)
            + [("head", w, 0) for w in head[::-1]] * cost.has_head
            + [(f"layer{i}", w, n) for i in reversed(range(cost.layers)) for w, n in layer[::-1]]
            + [("embedding", "lookup", 0)] * cost.has_embedding)


def _after(cost: ChunkCost, kind: str, what: str, loss: list[Transfer], position: list[Transfer], gather: int,
           whole: bool = False) -> list[tuple[str, int]]:
    """(op, bytes) of the collectives after one span (module docstring; ``gather``: a norm's all-gather's bytes;
    ``whole``: sequence parallelism's reduce-scatters are all-reduces of the whole activation, :func:`_whole`)."""
    main = "reduce_scatter" if cost.sequence_parallel and not whole else "all_reduce"
    nbytes = cost.tensor_allreduce_bytes
    if not nbytes:  # no tensor axis: no collective between the spans
        return []
    if what == "norm":
        return [("all_gather", gather)]
    if kind == "F":
        if what in ("lookup", "block"):
            return [(main, nbytes)]
        return [(op, b) for op, _, b in loss[:1]] if what == "head" else [(op, b) for op, _, b in loss[1:]]
    if what in ("head", "block"):
        return [(main, nbytes)]
    return [(op, b) for op, _, b in position] if what == "lookup" else []


def _whole(cost: ChunkCost, transfers: tuple[Transfer, ...]) -> bool:
    """Whether an action's sequence-parallel reduce-scatters are all-reduces of the whole activation, as its
    transfers say (testbed.sim.step.action_work.tensor_transfers decides it once: testbed.sim.xla.xla_tpu.
    scatters_whole_sequence): sequence parallelism, and an all-reduce of the activation's bytes but no reduce-scatter
    among them."""
    return cost.sequence_parallel and not any(op == "reduce_scatter" for op, _, _ in transfers) and any(
        op == "all_reduce" and b == cost.tensor_allreduce_bytes for op, _, b in transfers)


def _norm_gathers(cost: ChunkCost, kind: str, labels: list[tuple[str, str, int]], transfers: tuple[Transfer, ...]
                  ) -> list[int]:
    """Per span of ``labels``, the bytes of the sequence all-gather after it where it is a norm: those of
    ``transfers``' gathers only matmuls read (testbed.sim.step.action_work.tensor_transfers' ``matmul_gather``), but the
    backward's last norm's in a chunk holding the embedding (the lookup's cotangent: ``tensor_allreduce_bytes``)."""
    nbytes = cost.tensor_allreduce_bytes
    narrowed = next((b for op, _, b in transfers if op == "all_gather" and b != nbytes), nbytes)
    norms = [i for i, (_, what, _) in enumerate(labels) if what == "norm"]
    own = norms[-1] if kind == "B" and cost.has_embedding and norms else -1
    return [nbytes if i == own else narrowed for i in range(len(labels))]


def _regathers(cost: ChunkCost, kind: str, labels: list[tuple[str, str, int]], transfers: tuple[Transfer, ...]
               ) -> list[list[tuple[str, int]]]:
    """Per span of ``labels``, the backward's sequence all-gathers again after it (testbed.sim.step.action_work.
    tensor_transfers' ``regather``: one a forward norm's gather, the last all-gather entry but the position table's),
    which no later span waits for: each block's input gathered again after the span before that block's (a norm's,
    after its cotangent's gather), in flight while the block's backward runs, as the traced program issues it once
    its checkpoint's barrier lets it and reads it in the block's weight gradients (testbed.sim.xla.xla_tpu.
    regathered); the head's after its own span where no span comes before it. Empty lists where there are none."""
    norms = [i for i, (_, what, _) in enumerate(labels) if what == "norm"]
    gathers = [(n, b) for op, n, b in transfers if op == "all_gather"]
    out: list[list[tuple[str, int]]] = [[] for _ in labels]
    if kind != "B" or not norms or sum(n for n, _ in gathers) != 2 * len(norms) or gathers[-1][0] != len(norms):
        return out
    readers = [i for i, (_, what, _) in enumerate(labels) if what in ("head", "block")]
    for i in readers:
        out[max(i - 1, 0)].append(("all_gather", gathers[-1][1]))
    return out


def block_spans(cost: ChunkCost, kind: str, spans: tuple[tuple[float, float], ...], transfers: tuple[Transfer, ...],
                gathered: bool, blocks: int) -> tuple[tuple[BlockSpan, ...], ...]:
    """Per block of a ``kind`` action (F from the embedding, B from the head), its spans with the collectives
    after each (module docstring); empty where the blocks are not the chunk's own pieces, the action is one span,
    or the collectives are not exactly one per span boundary as above (full remat's redone ones).
    ``spans``: the action's (testbed.model.spans.action_spans); ``transfers``: its tensor collectives
    (testbed.sim.step.action_work.tensor_transfers); ``gathered``: the head's weight is gathered again for the backward."""
    return _cut(cost, kind, spans, transfers, gathered, blocks)[0]


def span_reads(cost: ChunkCost, kind: str, spans: tuple[tuple[float, float], ...], transfers: tuple[Transfer, ...],
               gathered: bool, blocks: int) -> tuple[tuple[frozenset[str] | None, ...], ...]:
    """Per block and span of :func:`block_spans`, the block's leaves the span reads (their first path parts;
    None: all of them): testbed.model.blocks.span_leaves of each piece of work the span is made of."""
    return _cut(cost, kind, spans, transfers, gathered, blocks)[1]


#: :func:`_cut`'s answers by (the chunk cost's id, the rest of its arguments), each beside its cost object (so the id
#: is not reused while kept): many plans share one memoized chunk cost (testbed.sim.step.memo).
_CUTS: dict[tuple, tuple] = {}


def _cut(cost: ChunkCost, kind: str, spans: tuple[tuple[float, float], ...], transfers: tuple[Transfer, ...],
         gathered: bool, blocks: int) -> tuple[tuple, tuple]:
    """(:func:`block_spans`, :func:`span_reads`) of one action, memoized (:data:`_CUTS`)."""
    key = (id(cost), kind, spans, transfers, gathered, blocks)
    hit = _CUTS.get(key)
    if hit is not None and hit[0] is cost:
        return hit[1]
    cut = _cut_spans(cost, kind, spans, transfers, gathered, blocks)
    out = (tuple(tuple((share, nbytes, tuple((op, 1, b) for op, b in a), tuple((op, 1, b) for op, b in beside))
                       for share, nbytes, a, _, beside in block) for block in cut), _reads(cost, kind, cut))
    if len(_CUTS) > 20_000:
        _CUTS.clear()
    _CUTS[key] = (cost, out)
    return out


def _reads(cost: ChunkCost, kind: str, cut: list[list[list]]) -> tuple[tuple[frozenset[str] | None, ...], ...]:
    """:func:`span_reads` of :func:`_cut_spans`' blocks."""
    out = []
    for block in cut:
        mine = []
        for _, _, _, labels, _ in block:
            reads = [span_leaves(p, what, n, kind, cost.sequence_parallel, cost.parallel_block)
                     for p, what, n in labels]
            mine.append(None if any(r is None for r in reads) else frozenset().union(*reads))
        out.append(tuple(mine))
    return tuple(out)


def _cut_spans(cost: ChunkCost, kind: str, spans: tuple[tuple[float, float], ...], transfers: tuple[Transfer, ...],
               gathered: bool, blocks: int) -> list[list[list]]:
    """:func:`block_spans`' spans, each as [share, bytes, its collectives (op, bytes), its labels, the collectives beside
    (op, bytes)]."""
    pieces = int(cost.has_embedding) + cost.layers + int(cost.has_head)
    labels = _labels(cost, kind, gathered) if kind in ("F", "B") else []
    if not spans or blocks != pieces or cost.layers < 1 or len(labels) != len(spans):
        return []
    extra = 2 if kind == "F" and cost.loss_allreduce_bytes else int(kind == "B" and bool(cost.position_gather_bytes))
    tail = list(transfers[len(transfers) - extra:])
    gathers = _norm_gathers(cost, kind, labels, transfers[:len(transfers) - extra])
    again = _regathers(cost, kind, labels, transfers[:len(transfers) - extra])
    whole = _whole(cost, transfers)
    after = [_after(cost, kind, what, tail if kind == "F" else [], tail if kind == "B" else [], g, whole)
             for (_, what, _), g in zip(labels, gathers)]
    expected: Counter = Counter()
    for op, n, b in transfers:
        expected[(op, b)] += n
    if Counter(x for a in after + again for x in a) != expected:
        return []
    by_piece: dict[str, list[list]] = {}  # each piece's spans, the pieces in their first span's order
    for label, (share, nbytes), a, beside in zip(labels, spans, after, again):
        mine = by_piece.setdefault(label[0], [])
        if mine and not mine[-1][2] and not mine[-1][4] and label[1] != "head":
            mine[-1][0] += share
            mine[-1][1] += nbytes
            mine[-1][2] = a
            mine[-1][3].append(label)
            mine[-1][4] = beside
        else:  # (the head's matmuls after the loss's gradient read its gathered weight: a segment of their own)
            mine.append([share, nbytes, a, [label], beside])
    return list(by_piece.values())
