"""An fsdp action's blocks: how a chunk's pieces (the embedding, each layer, the head) group into the blocks an
action gathers, computes and reduce-scatters one after another, and each block's gathers at their real merged
sizes (its reduce-scatters: testbed.model.block_scatters).

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

__all__ = ["own_blocks", "block_pieces", "block_gathers", "block_ops", "gather_holds", "span_leaves", "narrowed",
           "PIECE_PARTS", "SHARE_QUANTUM"]

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
    return _block_ops(*_gathers_key(plan), stage, chunk, kind, blocks, elements, combine_bytes, bytes_per_element,
                      recompute, matmul_bytes, lowering)


def _gathers_key(plan: Plan) -> tuple:
    """What of ``plan`` a chunk's merged gathers depend on (the first arguments of :func:`_gather_merges`)."""
    return (plan.model, _merge_mesh(plan.mesh), plan.schedule.virtual_stages, plan.stage_layers,
            state_sharding(plan).ways(plan, "params"))


@functools.lru_cache(maxsize=1 << 14)  # a search reads the same chunk's under many plans
def _block_ops(spec: ModelSpec, mesh: MeshSpec, v: int, stage_layers: tuple[int, ...], ways: int, stage: int,
               chunk: int, kind: str, blocks: int, elements: int, combine_bytes: float, bytes_per_element: float,
               recompute: bool, matmul_bytes: float, lowering: Lowering) -> tuple[tuple[str, ...], ...]:
    """:func:`block_ops` from what it depends on."""
    merges = _gather_merges(spec, mesh, v, stage_layers, ways, stage, chunk, kind, blocks, combine_bytes,
                            bytes_per_element, recompute, matmul_bytes, lowering)
    sizes = _block_gathers(spec, mesh, v, stage_layers, ways, stage, chunk, kind, blocks, elements, combine_bytes,
                           bytes_per_element, recompute, matmul_bytes, lowering)
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
    return _gather_holds(*_gathers_key(plan), stage, chunk, kind, blocks, elements, combine_bytes,
                         bytes_per_element, recompute, matmul_bytes, lowering)


@functools.lru_cache(maxsize=1 << 14)  # a search reads the same chunk's under many plans
def _gather_holds(spec: ModelSpec, mesh: MeshSpec, v: int, stage_layers: tuple[int, ...], ways: int, stage: int,
                  chunk: int, kind: str, blocks: int, elements: int, combine_bytes: float, bytes_per_element: float,
                  recompute: bool, matmul_bytes: float, lowering: Lowering
                  ) -> tuple[tuple[frozenset[str] | None, ...], ...]:
    """:func:`gather_holds` from what it depends on."""
    merges = _gather_merges(spec, mesh, v, stage_layers, ways, stage, chunk, kind, blocks, combine_bytes,
                            bytes_per_element, recompute, matmul_bytes, lowering)
    sizes = _block_gathers(spec, mesh, v, stage_layers, ways, stage, chunk, kind, blocks, elements, combine_bytes,
                           bytes_per_element, recompute, matmul_bytes, lowering)
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


#: Shares of a chunk's gradients are multiples of this (a power of two): a whole number of bytes (below 2^37) times
#: each is exact in floating point, so the buckets' bytes sum to the chunk's exactly (bytes per axis compared to the
#: byte); a share is then within 8e-6 of its block's.
SHARE_QUANTUM = 2.0 ** -16
