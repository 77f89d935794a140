"""An fsdp action's blocks: how a chunk's pieces (the embedding, each layer, the head) group into the blocks an
action gathers, computes and reduce-scatters one after another, and each block's collectives at their real merged
sizes.

The runner (testbed.runner.param_shards.ParamShards) gathers, computes and reduce-scatters each piece of a JAX
program as a unit of its own; XLA's combiners merge the collectives of consecutive pieces
(:mod:`testbed.model.leaves` counts them). The task graph (testbed.sim.step.facts, testbed.sim.graph.grad_tasks) and the
analytic tier read the one split and the merged sizes here.
"""

from __future__ import annotations

import functools
import math

from testbed.model import layout
from testbed.model.gather_lowering import NO_LOWERING, Lowering, backward_segments, lowered_merges
from testbed.model.leaves import (backward_groups as backward_merges_members, backward_waits, backward_walk, issue_order,
                                  recomputed)
from testbed.plan.sharding import state_sharding
from testbed.plan.spec import MeshSpec, ModelSpec, Plan

__all__ = ["own_blocks", "block_pieces", "block_gathers", "block_ops", "block_scatters", "scatter_ops", "scatter_reads",
           "scatter_early", "scatter_cuts", "gather_holds", "span_leaves", "narrowed", "PIECE_PARTS", "SHARE_QUANTUM"]

#: One mesh per (stage, tensor, expert, expert_tensor) degrees: the memoized merges below read no other field of the
#: mesh, so plans whose meshes differ only in data, fsdp, context, order or tile share their entries.
_MESHES: dict[tuple, MeshSpec] = {}


def _merge_mesh(mesh: MeshSpec) -> MeshSpec:
    """The mesh the memoized merges are keyed on for ``mesh`` (:data:`_MESHES`)."""
    key = (mesh.stage, mesh.tensor, mesh.expert, mesh.expert_tensor)
    hit = _MESHES.get(key)
    if hit is None:
        if len(_MESHES) > 4096:
            _MESHES.clear()
        hit = _MESHES[key] = mesh
    return hit


def own_blocks(layers: int, embed: bool, head: bool) -> int:
    """Blocks an fsdp action of a chunk of ``layers`` layers is split into when the embedding and the head are
    blocks of their own (``embed``, ``head``: the chunk holds them): each layer, and the embedding and the head
    apart, under ``runtime.fsdp_edge_blocks``: the runner (testbed.runner.param_shards.ParamShards)
    gathers, computes and reduce-scatters the embedding, each layer and the head as pieces of their own (its
    backward computes the head's gradients and reduce-scatters them once the head's tables are gathered, before
    any layer's; MaxText's scanned layers leave the embedding and the head outside the loop likewise). A PyTorch
    stack's split is its wrapping policy, which differs (torchtitan wraps the token embedding and the norm with
    the output as units of their own; Composer's FSDP keeps them in the root unit with the model) and is not
    stated per stack: there the layers' blocks stay, the embedding riding with the first, the head with the last.
    The one split the plan's model (testbed.sim.step.chunk_facts.ChunkFacts.blocks) and its gathers (:func:`block_gathers`)
    read."""
    return max(1, layers) + int(embed) + int(head)


def block_pieces(layers: int, embed: bool, head: bool, blocks: int) -> tuple[int, ...]:
    """Per piece of a chunk in forward order (the embedding if held, each layer, the head if held), the block of
    ``blocks`` (forward order) it belongs to: its own block where ``blocks`` is :func:`own_blocks`'s; else the
    layers' blocks, the embedding riding with the first and the head with the last."""
    last = blocks - 1
    if blocks == own_blocks(layers, embed, head) and blocks > max(1, layers):
        return tuple(range(int(embed) + layers + int(head)))
    return (0,) * int(embed) + tuple(min(j, last) for j in range(layers)) + (last,) * int(head)


def narrowed(param: layout.ParamSpec, piece: str, kind: str) -> bool:
    """Whether a ``kind`` action's gather of ``param`` (of a ``piece``: embedding, layer, head) moves the dtype its
    matmuls read rather than the parameter's own (``matmul_bytes`` of :func:`block_gathers`; XLA:TPU under fp32:
    testbed.sim.xla.xla_tpu.matmul_gather_bytes): a weight matrix of a layer or of the head (drawn at random; the
    biases and norms start constant), read only by matmuls, so the compiler rounds it before the gather. Not the
    embedding's tables (a lookup, an addition), not the norms' scales or the biases, 2-D ones (``attn/bqkv``
    [3, d]) included (elementwise: the traced program's adds read them, testbed.sim.xla.xla_tpu.lowered_gathers),
    and not the head's matrix in the forward, whose gathered copy the loss's piece also reads whole-width (a
    corner kept for its backward's gather: testbed.runner.param_shards)."""
    return (param.part is not layout.Part.EMBEDDING and len(param.shape) >= 2
            and param.init in (layout.Init.NORMAL, layout.Init.NORMAL_RESIDUAL)
            and not (piece == "head" and kind == "F"))


def block_gathers(plan: Plan, stage: int, chunk: int, kind: str, blocks: int, elements: int,
                  combine_bytes: float = math.inf, bytes_per_element: float = 4.0, recompute: bool = False,
                  matmul_bytes: float = 0.0, lowering: Lowering = NO_LOWERING) -> tuple[tuple[float, ...], ...]:
    """Bytes of each all-gather a ``kind`` action's block of a chunk's sharded parameters issues, per block in the
    order the action computes them (the backward's from the head): the
    real merged sizes, not equal shares (at many ranks a collective's time is concave in its bytes, so equal
    shares of unequal merges would overprice them). Each piece (the embedding, a layer, the head) gathers in its
    block (:func:`block_pieces`); a merged collective belongs to the block of its first leaf, the first the runner
    reads. Merges as :func:`parameter_collectives` (forward:
    the chunk's leaves in :func:`issue_order`) and :func:`regathered` (backward: :func:`backward_merges`) count
    them; unbounded ``combine_bytes``: one collective per block (a flat parameter per unit).
    ``elements`` (the action's gathered elements, :meth:`testbed.sim.step.chunk_facts.ChunkFacts.gather`) above the leaves'
    (a tied table's copy on the head's chunk) is one more collective of the last block. The one split the task
    graph and the analytic tier both price. ``recompute``: as testbed.model.leaves.regathered's; ``matmul_bytes``:
    bytes per element of the leaves :func:`narrowed` gathers (0: ``bytes_per_element``); ``lowering``: the gathers
    lowered as all-reduces and merged (:class:`Lowering`; their ops: :func:`block_ops`)."""
    return _block_gathers(plan.model, _merge_mesh(plan.mesh), plan.schedule.virtual_stages, plan.stage_layers,
                          state_sharding(plan).ways(plan, "params"), stage, chunk, kind, blocks, elements,
                          combine_bytes, bytes_per_element, recompute, matmul_bytes, lowering)


def block_ops(plan: Plan, stage: int, chunk: int, kind: str, blocks: int, elements: int,
              combine_bytes: float = math.inf, bytes_per_element: float = 4.0, recompute: bool = False,
              matmul_bytes: float = 0.0, lowering: Lowering = NO_LOWERING) -> tuple[tuple[str, ...], ...]:
    """As :func:`block_gathers`, each collective's op: ``all_gather``, or ``all_reduce`` where ``lowering`` lowers
    it (testbed.model.gather_lowering)."""
    mesh = _merge_mesh(plan.mesh)
    merges = _gather_merges(plan.model, mesh, plan.schedule.virtual_stages, plan.stage_layers,
                            state_sharding(plan).ways(plan, "params"), stage, chunk, kind, blocks, combine_bytes,
                            bytes_per_element, recompute, matmul_bytes, lowering)
    sizes = block_gathers(plan, stage, chunk, kind, blocks, elements, combine_bytes, bytes_per_element, recompute,
                          matmul_bytes, lowering)
    ordered = merges if kind == "F" else tuple(reversed(merges))
    return tuple(tuple(op for *_, op in block) + ("all_gather",) * (len(total) - len(block))
                 for block, total in zip(ordered, sizes))


def _chunk_pieces(spec: ModelSpec, mesh: MeshSpec, v: int, stage_layers: tuple[int, ...], stage: int, chunk: int,
                  blocks: int) -> list[tuple[int, str, list]]:
    """(block, what it is, its parameters) of each piece of a chunk, forward order (:func:`block_pieces`)."""
    embed, head = layout.holds(stage, chunk, mesh.stage, v)
    span = layout.chunk_layers(spec, mesh.stage, v, stage_layers)[stage][chunk]
    where = block_pieces(len(span), embed, head, blocks)
    pieces = ([("embedding", layout.embedding_params(spec))] if embed else [])
    pieces += [("layer", layout.layer_params(spec, i)) for i in span]
    pieces += [("head", layout.head_params(spec))] if head else []
    return [(b, what, params) for b, (what, params) in zip(where, pieces)]


@functools.lru_cache(maxsize=1 << 14)  # a search prices the same chunk under many schedules and microbatch counts
def _block_gathers(spec: ModelSpec, mesh: MeshSpec, v: int, stage_layers: tuple[int, ...], ways: int, stage: int,
                   chunk: int, kind: str, blocks: int, elements: int, combine_bytes: float,
                   bytes_per_element: float, recompute: bool = False, matmul_bytes: float = 0.0,
                   lowering: Lowering = NO_LOWERING) -> tuple[tuple[float, ...], ...]:
    """:func:`block_gathers` from what it depends on."""
    merges = _gather_merges(spec, mesh, v, stage_layers, ways, stage, chunk, kind, blocks, combine_bytes,
                            bytes_per_element, recompute, matmul_bytes, lowering)
    out = [[size for size, *_ in block] for block in merges]
    rest = elements * bytes_per_element  # what the action gathers beyond its leaves (a tied table's copy)
    if matmul_bytes:
        rest += sum(map(sum, out)) - sum(size for block in _gather_merges(
            spec, mesh, v, stage_layers, ways, stage, chunk, kind, blocks, combine_bytes, bytes_per_element,
            recompute) for size, *_ in block)
    return _with_rest(out, rest, blocks - 1, reverse=kind != "F")


@functools.lru_cache(maxsize=1 << 14)
def _gather_merges(spec: ModelSpec, mesh: MeshSpec, v: int, stage_layers: tuple[int, ...], ways: int, stage: int,
                   chunk: int, kind: str, blocks: int, combine_bytes: float, bytes_per_element: float,
                   recompute: bool = False, matmul_bytes: float = 0.0, lowering: Lowering = NO_LOWERING
                   ) -> tuple[tuple[tuple[float, frozenset[tuple[int, str]], str], ...], ...]:
    """Per block (forward order), each merged all-gather of a ``kind`` action as (bytes, its members as (block,
    the leaf's first path part), its op: ``all_gather``, or ``all_reduce`` where ``lowering`` lowers and merges
    it, at its first member's place: :func:`_lowered`), in the order the traced program issues them: a merge at its last member's
    place (testbed.sim.xla.combine; XLA's combiner puts the combined collective after all its operands), so a leaf
    over the bound (the token table) goes before the open merge it interrupts. A merge is in the block of its
    first member (:func:`block_gathers`); ``recompute``: a layer's backward gathers its recomputation's leaves
    first (testbed.model.leaves.backward_walk)."""
    held = _chunk_pieces(spec, mesh, v, stage_layers, stage, chunk, blocks)
    pieces = [(b, params, what) for b, what, params in held if kind == "F" or what != "embedding"]
    order = [(j, (block, piece)) for j, (block, piece, _) in enumerate(pieces)]
    walk = [(block, j, q, what, phase) for j, (block, piece, what) in (reversed(list(enumerate(pieces)))
                                                                      if kind != "F" else enumerate(pieces))
            for phase, q in _phased(piece, kind, recompute and what == "layer")]
    sizes = [q.gathered_elements(mesh.tensor, ways, mesh.expert, mesh.expert_tensor)
             * (matmul_bytes if matmul_bytes and narrowed(q, what, kind) else bytes_per_element)
             for _, _, q, what, _ in walk]
    groups: list[tuple[float, int, tuple[int, ...]]] = []  # (bytes, block, members' walk indices)
    # The gathers the compiler lowers as all-reduces one by one, before its all-gather combiner merges the rest.
    alone = frozenset(i for i, (_, _, q, *_) in enumerate(walk)
                      if lowering.lanes and _misaligned(q, mesh, ways, lowering.lanes))
    if kind != "F" and not math.isinf(combine_bytes):
        each: dict[int, list[float]] = {}  # each piece's leaves' sizes, in walk order
        for (_, i, *_), n in zip(walk, sizes):
            each.setdefault(i, []).append(n)
        backward = [(block, tuple(each.get(j, ()))) for j, (block, _) in reversed(order)]
        head = any(what == "head" for _, what, _ in held)
        waits = backward_waits(len(backward) - int(head), head)
        groups = [(size, backward[k][0], members) for size, k, members in
                  backward_merges_members([n for _, n in backward], combine_bytes, waits, alone)]
    else:
        run: list | None = None  # the open merge: [bytes, block, members, key, its index]
        for i, ((block, *_), size) in enumerate(zip(walk, sizes)):
            key = block if math.isinf(combine_bytes) else 0  # what merges: the whole chunk; a block, unbounded
            if size > combine_bytes or i in alone:
                groups.append((size, block, (i,)))  # combined_sizes' rule: alone, the open merge goes on
            elif run is not None and run[3] == key and run[0] + size <= combine_bytes:
                run[0], run[2] = run[0] + size, run[2] + (i,)
                groups[run[4]] = (run[0], run[1], run[2])
            else:
                run = [size, block, (i,), key, len(groups)]
                groups.append((size, block, (i,)))
    ops = ["all_gather"] * len(groups)
    if lowering.active:
        vectors = frozenset(k for k, (_, _, members) in enumerate(groups) if members[0] in alone)
        groups, ops = _lowered(groups, walk, kind, lowering, vectors)
    out: list[list] = [[] for _ in range(blocks)]
    for (size, block, members), op in sorted(zip(groups, ops), key=lambda g: g[0][2][0 if g[1] == "all_reduce" else -1]):
        out[block].append((size, frozenset((walk[i][0], walk[i][2].path[0]) for i in members), op))
    return tuple(tuple(block) for block in out)


def _phased(piece, kind: str, recompute: bool) -> list[tuple[int, layout.ParamSpec]]:
    """A piece's gathered leaves in a ``kind`` action, in order, each with its set (0; the backward's under
    ``recompute``: 0 for the recomputation's, 1 for the gradients': testbed.model.leaves.backward_walk)."""
    if kind == "F":
        return [(0, q) for q in issue_order(piece)]
    again = sum(1 for q in issue_order(piece) if recompute and recomputed(q))
    return [(int(k >= again), q) for k, q in enumerate(backward_walk(piece, recompute))]


def _misaligned(q: layout.ParamSpec, mesh: MeshSpec, ways: int, lanes: int) -> bool:
    """Whether ``q`` is gathered ``ways`` ways as a rank-1 buffer (a rank-1 leaf, or one held flat and padded:
    ParamSpec.padded) whose shard per device is not a whole number of ``lanes`` elements: the vectors
    testbed.sim.xla.xla_tpu.vector_gather_lowers gathers by an all-reduce."""
    args = (mesh.tensor, ways, mesh.expert, mesh.expert_tensor)
    if ways < 2 or not (len(q.shape) == 1 or q.padded(*args)):
        return False
    return q.device_elements(*args) % lanes != 0


def _lowered(groups: list, walk: list, kind: str, lowering: Lowering,
             vectors: frozenset[int] = frozenset()) -> tuple[list, list[str]]:
    """``groups`` (bytes, block, members) with those ``lowering`` lowers (by size, and ``vectors``: the rank-1
    leaves' gathers it lowers) merged into all-reduces (the block of their first member), and each one's op
    (testbed.model.gather_lowering)."""
    if kind == "F":
        segments = [0] * len(groups)
    else:
        segments = backward_segments([(walk[m[0]][3] == "head", (walk[m[0]][1], walk[m[0]][4]))
                                      for _, _, m in groups])
    lowered, merges = lowered_merges([g[0] for g in groups], segments, lowering.nbytes, lowering.allreduce_bytes,
                                     vectors)
    kept = [g for i, g in enumerate(groups) if i not in lowered]
    merged = [(m.nbytes, groups[m.members[0]][1], tuple(sorted(x for i in m.members for x in groups[i][2])))
              for m in merges]
    return kept + merged, ["all_gather"] * len(kept) + ["all_reduce"] * len(merged)


def gather_holds(plan: Plan, stage: int, chunk: int, kind: str, blocks: int, elements: int,
                 combine_bytes: float = math.inf, bytes_per_element: float = 4.0, recompute: bool = False,
                 matmul_bytes: float = 0.0, lowering: Lowering = NO_LOWERING
                 ) -> tuple[tuple[frozenset[str] | None, ...], ...]:
    """Per block of a ``kind`` action (in the order it computes them, as :func:`block_gathers`), per merged
    all-gather (as its sizes), the first path parts (``attn``, ``ln1``, ``mlp``, ``tokens``, ...) of the block's
    own leaves the merge holds (None: what :func:`block_gathers` adds beyond the leaves, a tied table's copy,
    holding anything). XLA starts an op once its operands are ready: a span of the block waits for the merges
    holding the leaves it reads (testbed.sim.step.span_order), not for all of its block's."""
    spec, mesh = plan.model, _merge_mesh(plan.mesh)
    merges = _gather_merges(spec, mesh, plan.schedule.virtual_stages, plan.stage_layers,
                            state_sharding(plan).ways(plan, "params"), stage, chunk, kind, blocks, combine_bytes,
                            bytes_per_element, recompute, matmul_bytes, lowering)
    sizes = block_gathers(plan, stage, chunk, kind, blocks, elements, combine_bytes, bytes_per_element, recompute,
                          matmul_bytes, lowering)
    ordered = merges if kind == "F" else tuple(reversed(merges))
    out = []
    for k, (block, total) in enumerate(zip(ordered, sizes)):
        own = blocks - 1 - k if kind != "F" else k
        holds = [frozenset(part for b, part in members if b == own) for _, members, _ in block]
        out.append(tuple(holds) + (None,) * (len(total) - len(holds)))
    return tuple(out)


#: The leaves (first path parts) a layer's spans read, forward order: under sequence parallelism each norm a span
#: of its own (before the all-gather of the sequence), else computed in the span of the matmuls after it.
_LAYER_READS = {True: (("norm", 0, ("ln1",)), ("block", 0, ("attn",)), ("norm", 1, ("ln2",)), ("block", 1, ("mlp",))),
                False: (("block", 0, ("ln1", "attn")), ("block", 1, ("ln2", "mlp")))}


def span_leaves(piece: str, what: str, nth: int, kind: str, sequence_parallel: bool, parallel_block: bool
                ) -> frozenset[str] | None:
    """The leaves (first path parts) of its piece a span of an fsdp block's work reads (testbed.sim.step.block_spans'
    labels: ``piece`` embedding, layer<i> or head; ``what`` the span; ``nth`` which of the piece's spans of that
    kind, forward order), None where all of them. XLA starts an op once its operands are ready, so a span waits
    only for the merged all-gathers holding these (testbed.sim.step.span_order). The embedding's lookup reads the token
    table (the position table is added after the lookup's vocab-parallel sum: testbed.runner.model.embed, so the
    next block's first span reads it); a layer's attention its ``attn`` leaves, its MLP its ``mlp`` leaves, each
    norm its own (the backward their transposes: the same weights); the head its norm and weight; the loss, and
    the backward's loss gradient (it reads the forward's logits), none. Leaves none of these name
    (:data:`PIECE_PARTS`) are read by every span (testbed.sim.step.span_order). A parallel block keeps waiting for all
    of its block's gathers."""
    if piece == "embedding":
        return frozenset(("tokens",)) if kind == "F" else frozenset()
    if piece == "head":
        reads = {"norm": ("norm",), "head": ("w",) if sequence_parallel else ("norm", "w"), "loss": (), "lossgrad": ()}
        return None if what not in reads else frozenset(reads[what])
    if parallel_block:
        return None
    return next((frozenset(r) for w, n, r in _LAYER_READS[sequence_parallel] if (w, n) == (what, nth)), None)


#: Per piece, the leaves (first path parts) :func:`span_leaves` names; a merge holding another is read by every span.
PIECE_PARTS = {"embedding": frozenset(("tokens", "positions")), "layer": frozenset(("ln1", "attn", "ln2", "mlp")),
               "head": frozenset(("norm", "w"))}


def _with_rest(out: list[list[float]], total: float, last: int, reverse: bool) -> tuple[tuple[float, ...], ...]:
    """``out`` with what ``total`` has above its collectives (a tied table's copy) one more of block ``last``,
    per block in forward order, or reversed (the backward's)."""
    rest = total - sum(map(sum, out))
    if rest > 1e-6 * max(1.0, total):
        out[last].append(rest)
    return tuple(tuple(sizes) for sizes in (reversed(out) if reverse else out))


def block_scatters(plan: Plan, stage: int, chunk: int, blocks: int, combine_bytes: float = math.inf,
                   bytes_per_element: float = 4.0, vectors: bool = False) -> tuple[tuple[float, ...], ...]:
    """Per block of a chunk's backward (from the head, :func:`block_pieces`), each reduce-scatter its gradients
    are, as a share of the chunk's gradient elements: the pieces' leaves from the head, each piece's in
    :func:`issue_order`, merged within ``combine_bytes`` by :func:`combined_sizes`' rule across pieces (XLA's
    combiner: nothing reads a reduce-scatter before the optimizer, so none reaches another), a merge in the
    block of its last leaf, whose gradients end it (unbounded: one per block). The gradient buckets at their real
    merged sizes, where equal shares of the chunk's would price the head's large table as a layer's share and
    split it into equal collectives. ``vectors``: the leaves reduced as rank-1 buffers (a rank-1 leaf, or one held
    flat) are one merged all-reduce at the backward's end, its exact share last (:func:`scatter_ops`;
    testbed.sim.xla.xla_tpu.lowers_vectors)."""
    return _block_scatters(plan.model, _merge_mesh(plan.mesh), plan.schedule.virtual_stages, plan.stage_layers,
                           state_sharding(plan).ways(plan, "grads"), stage, chunk, blocks, combine_bytes,
                           bytes_per_element, plan.sequence_parallel and plan.mesh.tensor > 1, vectors)


@functools.lru_cache(maxsize=1 << 12)
def _block_scatters(spec: ModelSpec, mesh: MeshSpec, v: int, stage_layers: tuple[int, ...], ways: int, stage: int,
                    chunk: int, blocks: int, combine_bytes: float, bytes_per_element: float, apart: bool = False,
                    vectors: bool = False) -> tuple[tuple[float, ...], ...]:
    """:func:`block_scatters` from what it depends on (``apart``: sequence parallelism over tensor ranks)."""
    merges = _scatter_merges(spec, mesh, v, stage_layers, ways, stage, chunk, blocks, combine_bytes,
                             bytes_per_element, apart, vectors)
    return _exact_shares(tuple(tuple(size for size, *_ in block) for block in merges),
                         tuple(tuple(bool(op) for *_, op in block) for block in merges))


def scatter_ops(plan: Plan, stage: int, chunk: int, blocks: int, combine_bytes: float = math.inf,
                bytes_per_element: float = 4.0, vectors: bool = False) -> tuple[tuple[str, ...], ...]:
    """Per block of a chunk's backward (as :func:`block_scatters`), per merged reduce-scatter, its op where the
    compiler makes it another (``all_reduce``: the rank-1 gradients' merge where ``vectors``), else empty (the
    parameter kind's own: testbed.sim.step.update_facts.Reduction.scatter_op)."""
    merges = _scatter_merges(plan.model, _merge_mesh(plan.mesh), plan.schedule.virtual_stages, plan.stage_layers,
                             state_sharding(plan).ways(plan, "grads"), stage, chunk, blocks, combine_bytes,
                             bytes_per_element, plan.sequence_parallel and plan.mesh.tensor > 1, vectors)
    return tuple(tuple(op for *_, op in block) for block in merges)


def scatter_reads(plan: Plan, stage: int, chunk: int, blocks: int, combine_bytes: float = math.inf,
                  bytes_per_element: float = 4.0, vectors: bool = False) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per block of a chunk's backward (as :func:`block_scatters`), per merged reduce-scatter, the blocks (backward
    order) whose weight gradients it reads: those of its members but the tensor-replicated ones under sequence
    parallelism, which it reads from the backward's one merged all-reduce over tensor (:func:`_scatter_walk`).
    XLA issues a reduce-scatter as soon as its operands are ready, so a merge the backward's end holds leaves once
    the weight gradients of its own blocks are computed, not after every block's (testbed.sim.step.span_order); a merge
    XLA's combiner made is one collective reading every member's operand (xla/service/reduce_scatter_combiner.h:
    "combines small non-dependent ReduceScatter ops"), so where all of a small model's gradients fit one merge it
    waits for every layer's weight gradients."""
    merges = _scatter_merges(plan.model, _merge_mesh(plan.mesh), plan.schedule.virtual_stages, plan.stage_layers,
                             state_sharding(plan).ways(plan, "grads"), stage, chunk, blocks, combine_bytes,
                             bytes_per_element, plan.sequence_parallel and plan.mesh.tensor > 1, vectors)
    return tuple(tuple(tuple(sorted(blocks - 1 - b for b in read)) for _, read, *_ in block) for block in merges)


def scatter_early(plan: Plan, stage: int, chunk: int, blocks: int, combine_bytes: float = math.inf,
                  bytes_per_element: float = 4.0, vectors: bool = False) -> tuple[tuple[float, ...], ...]:
    """Per block of a chunk's backward (as :func:`scatter_reads`), per merged reduce-scatter, the share of its
    block's weight-gradient matmuls it reads where it leaves before the block's input gradients, else 0.

    A layer's backward starts with its MLP's output projection (``mlp/w2``), whose weight gradient reads only the
    layer's incoming cotangent and a saved activation: JAX's transpose of that matmul emits the weight gradient
    first, and where XLA's combiner closes a merge on that gradient alone (the next leaf does not fit the combine
    bound: d_model 2048 at tensor 1 or 2) the reduce-scatter is ready at once, so XLA's scheduler computes that
    weight gradient and starts its reduce-scatter before the layer's input gradients (the traced TPU fsdp x tensor
    2 sequence parallel bf16 d_model 2048 step: the last layer's ``w2`` gradient, a third of its weight-gradient
    matmuls, at the layer's start), not with the weight gradients held to its end. Only where all-gathers are a
    scheduler resource of their own (testbed.sim.step.facts.step_facts' ``chained_gathers``): the input gradient
    waits for the layer's re-gathered weights, which arrive one gather after another; where they do not (the
    superpod's traced step) the weight gradient follows the layer's input gradients."""
    merges = _scatter_merges(plan.model, _merge_mesh(plan.mesh), plan.schedule.virtual_stages, plan.stage_layers,
                             state_sharding(plan).ways(plan, "grads"), stage, chunk, blocks, combine_bytes,
                             bytes_per_element, plan.sequence_parallel and plan.mesh.tensor > 1, vectors)
    return tuple(tuple(early for _, _, early, *_ in block) for block in merges)


def scatter_cuts(plan: Plan, stage: int, chunk: int, blocks: int, combine_bytes: float = math.inf,
                 bytes_per_element: float = 4.0, vectors: bool = False) -> tuple[tuple[tuple[float, ...], ...], ...]:
    """Per block of a chunk's backward (as :func:`scatter_reads`), per merged reduce-scatter, for each block it
    reads (:func:`scatter_reads`' order) the share of that block's weight-gradient matmuls (its matrices'
    elements) among the merge's members.

    A merge reads only its members' weight gradients, so XLA's scheduler, which starts a reduce-scatter once its
    operands are ready, computes a merge's weight-gradient matmuls and starts it before the block's other weight
    gradients: the traced layer cuts its weight gradients by the merges that read them (testbed.sim.step.span_order),
    not all of them before its first merge leaves."""
    merges = _scatter_merges(plan.model, _merge_mesh(plan.mesh), plan.schedule.virtual_stages, plan.stage_layers,
                             state_sharding(plan).ways(plan, "grads"), stage, chunk, blocks, combine_bytes,
                             bytes_per_element, plan.sequence_parallel and plan.mesh.tensor > 1, vectors)
    return tuple(tuple(tuple(dict(cuts).get(b, 0.0) for b in sorted(read, reverse=True))
                       for _, read, _, cuts, _ in block) for block in merges)


#: The leaves whose weight gradients read only their layer's incoming cotangent (:func:`scatter_early`).
_COTANGENT_ONLY = (("mlp", "w2"), ("mlp", "b2"))


def _cut_shares(members: list, matrices: dict[int, int]) -> tuple[tuple[int, float], ...]:
    """(forward-order block, its share of that block's weight-gradient matmuls) of a merge's ``members`` ((walk
    index, leaf, block, what)), the tensor-replicated (``late``) ones aside (:func:`scatter_cuts`)."""
    own: dict[int, int] = {}
    for _, q, block, what in members:
        if what != "late" and len(q.shape) >= 2:
            own[block] = own.get(block, 0) + math.prod(q.shape)
    return tuple(sorted((block, n / matrices[block]) for block, n in own.items() if matrices.get(block)))


def _early_share(members: list, first: dict[int, int], matrices: dict[int, int]) -> float:
    """The share of its block's weight-gradient matmuls of a merge's ``members`` ((walk index, leaf, block, what))
    where they are their layer's first leaves and only the output projection's (:func:`scatter_early`), else 0."""
    blocks = {block for _, _, block, _ in members}
    if len(blocks) != 1 or members[0][0] != first[members[0][2]] or any(
            what != "layer" or q.path[-2:] not in _COTANGENT_ONLY for _, q, _, what in members):
        return 0.0
    own = sum(math.prod(q.shape) for _, q, _, _ in members if len(q.shape) >= 2)
    return own / matrices[members[0][2]] if matrices.get(members[0][2]) else 0.0


@functools.lru_cache(maxsize=1 << 12)
def _scatter_merges(spec: ModelSpec, mesh: MeshSpec, v: int, stage_layers: tuple[int, ...], ways: int, stage: int,
                    chunk: int, blocks: int, combine_bytes: float, bytes_per_element: float, apart: bool,
                    vectors: bool = False
                    ) -> tuple[tuple[tuple[float, frozenset[int], float, tuple[tuple[int, float], ...], str], ...], ...]:
    """Per block of a chunk's backward (from the head), each merged reduce-scatter as (bytes, the forward-order
    blocks of the members it reads but the tensor-replicated ones, :func:`scatter_early`'s share,
    :func:`scatter_cuts`' shares per forward-order block, its op: :func:`scatter_ops`): :func:`block_scatters`'
    merges."""
    merged: list[list[list]] = [[] for _ in range(blocks)]
    group: list | None = None  # the open merge: [bytes, block of its last member, its index, late, blocks read]
    groups: list[list] = []
    ended = 1 << 30  # past every leaf: where the merges that wait for the backward's end are issued
    pieces = _chunk_pieces(spec, mesh, v, stage_layers, stage, chunk, blocks)
    kinds = {block: what for block, what, _ in pieces}
    matrices = {block: sum(math.prod(q.shape) for q in params if len(q.shape) >= 2) for block, _, params in pieces}
    walk = _scatter_walk(pieces, apart and not math.isinf(combine_bytes))
    first: dict[int, int] = {}
    flat: list = []  # the rank-1 gradients' one all-reduce (``vectors``): [bytes, members]
    for i, (q, block, late) in enumerate(walk):
        first.setdefault(block, i)
        size = q.gathered_elements(mesh.tensor, ways, mesh.expert, mesh.expert_tensor) * bytes_per_element
        read, member = frozenset(() if late else (block,)), (i, q, block, "late" if late else kinds[block])
        if vectors and _rank_one(q, mesh, ways):
            flat = [(flat[0] if flat else 0.0) + size, (flat[1] if flat else []) + [(i, q, block, "late")]]
        elif math.isinf(combine_bytes) or size > combine_bytes:
            groups.append([size, block, i, late, read, [member], ""])  # unbounded: one per block (summed); over: alone
        elif group is not None and group[0] + size <= combine_bytes:
            group[:] = group[0] + size, block, i, group[3] or late, group[4] | read, group[5] + [member], ""
        else:
            group = [size, block, i, late, read, [member], ""]
            groups.append(group)
    if flat:  # after every other merge of the backward's last block (the compiled programs' last collective)
        groups.append([flat[0], 0, len(walk), True, frozenset(), flat[1], "all_reduce"])
    # A merged collective is issued once its last member is (XLA's combiner puts it after all its operands); one
    # holding a tensor-replicated gradient reads the merged all-reduce of the backward's last layer: it is issued
    # in the backward's last block, after the others (after its tensor collectives: testbed.sim.graph.grad_tasks).
    for g in groups:
        if g[3]:
            g[1], g[2] = 0, ended + g[2]
    for size, block, _, _, read, members, op in sorted(groups, key=lambda g: g[2]):
        if math.isinf(combine_bytes) and merged[block] and not op and not merged[block][0][4]:
            merged[block][0][0] += size
            merged[block][0][1] |= read
            merged[block][0][3] += members
        else:
            early = 0.0 if math.isinf(combine_bytes) or op else _early_share(members, first, matrices)
            merged[block].append([size, read, early, list(members), op])
    return tuple(tuple((size, frozenset(read), early, _cut_shares(members, matrices), op)
                       for size, read, early, members, op in block) for block in reversed(merged))


def _rank_one(q: layout.ParamSpec, mesh: MeshSpec, ways: int) -> bool:
    """Whether ``q``'s gradient is reduce-scattered ``ways`` ways as a rank-1 buffer: a rank-1 leaf, or one held
    flat and padded (ParamSpec.padded)."""
    return ways > 1 and (len(q.shape) == 1 or q.padded(mesh.tensor, ways, mesh.expert, mesh.expert_tensor))


def _scatter_walk(pieces: list[tuple[int, str, list]], apart: bool) -> list[tuple]:
    """(leaf, block, late) of a chunk's gradients in the order XLA's reduce-scatter combiner walks them: the pieces
    from the head, each piece's leaves as its transposed gathers issue them (reversed :func:`issue_order`).

    ``apart`` (sequence parallelism over tensor ranks, merges bounded): a tensor-replicated gradient (``late``: a
    norm's, a bias of a row-parallel matmul; not the position table's, whose sequence-sharded gradient is
    gathered over the ranks) is reduce-scattered from its sum over the tensor ranks. XLA's all-reduce combiner
    (which runs first) merges the whole backward's sums into one all-reduce, which the last piece holding such
    a gradient issues before its reduce-scatters: the earlier pieces' are walked there, at that piece's start,
    in its block (the traced program's merges, testbed.sim.xla.combine; one for one in
    tests/test_program_vs_plan.py)."""
    walk = [(q, block, apart and what != "embedding" and q.tensor_dim is None and not q.is_expert)
            for block, what, params in reversed(pieces) for q in reversed(issue_order(params))]
    if not any(late for _, _, late in walk):
        return walk
    last = max(i for i, (_, _, late) in enumerate(walk) if late)
    start = next(i for i, (_, block, _) in enumerate(walk) if block == walk[last][1])
    held = [(q, walk[start][1], True) for q, _, late in walk[:start] if late]
    return [w for w in walk[:start] if not w[2]] + held + walk[start:]


#: Shares of a chunk's gradients are multiples of this (a power of two): a whole number of bytes (below 2^37) times
#: each is exact in floating point, so the buckets' bytes sum to the chunk's exactly (bytes per axis compared to the
#: byte); a share is then within 8e-6 of its block's.
SHARE_QUANTUM = 2.0 ** -16


def _exact_shares(sizes: tuple[tuple[float, ...], ...], exact: tuple[tuple[bool, ...], ...] = ()
                  ) -> tuple[tuple[float, ...], ...]:
    """``sizes`` (bytes per merged collective, per block) as shares of their sum, each a multiple of
    :data:`SHARE_QUANTUM` but those ``exact`` marks (their own ratio: a small merge of another kind, whose bytes are
    compared apart), the last other taking what the rest leave so that they sum to 1 exactly."""
    total = sum(map(sum, sizes)) or 1.0
    marks = [m for block in exact for m in block] or [False] * sum(map(len, sizes))
    flat = [n / total if m else max(1, round(n / total / SHARE_QUANTUM)) * SHARE_QUANTUM
            for n, m in zip((n for block in sizes for n in block), marks)]
    rest = [i for i, m in enumerate(marks) if not m]
    if rest:
        flat[rest[-1]] = 1.0 - sum(f for i, f in enumerate(flat) if i != rest[-1])
    out, k = [], 0
    for block in sizes:
        out.append(tuple(flat[k:k + len(block)]))
        k += len(block)
    return tuple(out)