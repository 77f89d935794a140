"""An fsdp action's gradient reduce-scatters per block (testbed.model.blocks' split): each merged reduce-scatter at
its real size, the blocks whose weight gradients it reads, and the op the compiler makes of it where another
(XLA:TPU's rank-1 gradients' all-reduce). The task graph (testbed.sim.step.chunk_facts) and the analytic tier read
them here.
"""

from __future__ import annotations

import functools
import math

from testbed.model import layout, xla_tpu
from testbed.model.scatter_lowering import lowered_matrix
from testbed.model.blocks import SHARE_QUANTUM, _chunk_pieces, _merge_mesh
from testbed.model.leaves import issue_order
from testbed.plan.sharding import state_sharding
from testbed.plan.spec import MeshSpec, ModelSpec, Plan

__all__ = ["block_scatters", "scatter_ops", "scatter_reads", "scatter_early", "scatter_cuts"]


def block_scatters(plan: Plan, stage: int, chunk: int, blocks: int, combine_bytes: float = math.inf,
                   bytes_per_element: float = 4.0, vectors: bool = False, packed: bool = False
                   ) -> tuple[tuple[float, ...], ...]:
    """Per block of a chunk's backward (from the head, :func:`block_pieces`), each reduce-scatter its gradients
    are, as a share of the chunk's gradient elements: the pieces' leaves from the head, each piece's in
    :func:`issue_order`, merged within ``combine_bytes`` by :func:`combined_sizes`' rule across pieces (XLA's
    combiner: nothing reads a reduce-scatter before the optimizer, so none reaches another), a merge in the
    block of its last leaf, whose gradients end it (unbounded: one per block). The gradient buckets at their real
    merged sizes, where equal shares of the chunk's would price the head's large table as a layer's share and
    split it into equal collectives. ``vectors``: the leaves reduced as rank-1 buffers (a rank-1 leaf, or one held
    flat) are one merged all-reduce at the backward's end, its exact share last (:func:`scatter_ops`;
    testbed.sim.xla.xla_tpu.lowers_vectors). ``packed``: the gradients are all-reduces XLA:TPU's all-reduce
    combiner packs (:func:`_packed_groups`; testbed.sim.xla.xla_tpu, "packed")."""
    return _block_scatters(plan.model, _merge_mesh(plan.mesh), plan.schedule.virtual_stages, plan.stage_layers,
                           state_sharding(plan).ways(plan, "grads"), stage, chunk, blocks, combine_bytes,
                           bytes_per_element, plan.sequence_parallel and plan.mesh.tensor > 1, vectors, packed)


@functools.lru_cache(maxsize=1 << 12)
def _block_scatters(spec: ModelSpec, mesh: MeshSpec, v: int, stage_layers: tuple[int, ...], ways: int, stage: int,
                    chunk: int, blocks: int, combine_bytes: float, bytes_per_element: float, apart: bool = False,
                    vectors: bool = False, packed: bool = False) -> tuple[tuple[float, ...], ...]:
    """:func:`block_scatters` from what it depends on (``apart``: sequence parallelism over tensor ranks)."""
    merges = _scatter_merges(spec, mesh, v, stage_layers, ways, stage, chunk, blocks, combine_bytes,
                             bytes_per_element, apart, vectors, packed)
    return _exact_shares(tuple(tuple(size for size, *_ in block) for block in merges),
                         tuple(tuple(bool(op) for *_, op in block) for block in merges))


def scatter_ops(plan: Plan, stage: int, chunk: int, blocks: int, combine_bytes: float = math.inf,
                bytes_per_element: float = 4.0, vectors: bool = False, packed: bool = False
                ) -> tuple[tuple[str, ...], ...]:
    """Per block of a chunk's backward (as :func:`block_scatters`), per merged reduce-scatter, its op where the
    compiler makes it another (``all_reduce``: the rank-1 gradients' merge where ``vectors``), else empty (the
    parameter kind's own: testbed.sim.step.update_facts.Reduction.scatter_op)."""
    return _scatter_ops(*_merges_key(plan, stage, chunk, blocks, combine_bytes, bytes_per_element, vectors, packed))


def scatter_reads(plan: Plan, stage: int, chunk: int, blocks: int, combine_bytes: float = math.inf,
                  bytes_per_element: float = 4.0, vectors: bool = False, packed: bool = False
                ) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per block of a chunk's backward (as :func:`block_scatters`), per merged reduce-scatter, the blocks (backward
    order) whose weight gradients it reads: those of its members but the tensor-replicated ones under sequence
    parallelism, which it reads from the backward's one merged all-reduce over tensor (:func:`_scatter_walk`).
    XLA issues a reduce-scatter as soon as its operands are ready, so a merge the backward's end holds leaves once
    the weight gradients of its own blocks are computed, not after every block's (testbed.sim.step.span_order); a merge
    XLA's combiner made is one collective reading every member's operand (xla/service/reduce_scatter_combiner.h:
    "combines small non-dependent ReduceScatter ops"), so where all of a small model's gradients fit one merge it
    waits for every layer's weight gradients."""
    return _scatter_reads(*_merges_key(plan, stage, chunk, blocks, combine_bytes, bytes_per_element, vectors,
                                       packed))


def scatter_early(plan: Plan, stage: int, chunk: int, blocks: int, combine_bytes: float = math.inf,
                  bytes_per_element: float = 4.0, vectors: bool = False, packed: bool = False
                ) -> tuple[tuple[float, ...], ...]:
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
    return _scatter_early(*_merges_key(plan, stage, chunk, blocks, combine_bytes, bytes_per_element, vectors,
                                       packed))


def scatter_cuts(plan: Plan, stage: int, chunk: int, blocks: int, combine_bytes: float = math.inf,
                 bytes_per_element: float = 4.0, vectors: bool = False, packed: bool = False
                ) -> tuple[tuple[tuple[float, ...], ...], ...]:
    """Per block of a chunk's backward (as :func:`scatter_reads`), per merged reduce-scatter, for each block it
    reads (:func:`scatter_reads`' order) the share of that block's weight-gradient matmuls (its matrices'
    elements) among the merge's members.

    A merge reads only its members' weight gradients, so XLA's scheduler, which starts a reduce-scatter once its
    operands are ready, computes a merge's weight-gradient matmuls and starts it before the block's other weight
    gradients: the traced layer cuts its weight gradients by the merges that read them (testbed.sim.step.span_order),
    not all of them before its first merge leaves."""
    return _scatter_cuts(*_merges_key(plan, stage, chunk, blocks, combine_bytes, bytes_per_element, vectors,
                                      packed))


def _merges_key(plan: Plan, stage: int, chunk: int, blocks: int, combine_bytes: float, bytes_per_element: float,
                vectors: bool, packed: bool) -> tuple:
    """The arguments of :func:`_scatter_merges`: the plan facts it depends on and those of :func:`scatter_ops` and the
    others."""
    return (plan.model, _merge_mesh(plan.mesh), plan.schedule.virtual_stages, plan.stage_layers,
            state_sharding(plan).ways(plan, "grads"), stage, chunk, blocks, combine_bytes, bytes_per_element,
            plan.sequence_parallel and plan.mesh.tensor > 1, vectors, packed)


@functools.lru_cache(maxsize=1 << 12)  # a search reads the same chunk's under many plans (and below)
def _scatter_ops(*key) -> tuple[tuple[str, ...], ...]:
    """:func:`scatter_ops` of the merges of :func:`_merges_key`'s ``key``."""
    return tuple(tuple(op for *_, op in block) for block in _scatter_merges(*key))


@functools.lru_cache(maxsize=1 << 12)
def _scatter_reads(*key) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """:func:`scatter_reads` of the merges of :func:`_merges_key`'s ``key`` (its eighth: the blocks)."""
    blocks = key[7]
    return tuple(tuple(tuple(sorted(blocks - 1 - b for b in read)) for _, read, *_ in block)
                 for block in _scatter_merges(*key))


@functools.lru_cache(maxsize=1 << 12)
def _scatter_early(*key) -> tuple[tuple[float, ...], ...]:
    """:func:`scatter_early` of the merges of :func:`_merges_key`'s ``key``."""
    return tuple(tuple(early for _, _, early, *_ in block) for block in _scatter_merges(*key))


@functools.lru_cache(maxsize=1 << 12)
def _scatter_cuts(*key) -> tuple[tuple[tuple[float, ...], ...], ...]:
    """:func:`scatter_cuts` of the merges of :func:`_merges_key`'s ``key``."""
    return tuple(tuple(tuple(dict(cuts).get(b, 0.0) for b in sorted(read, reverse=True))
                       for _, read, _, cuts, _ in block) for block in _scatter_merges(*key))


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
                    vectors: bool = False, packed: bool = False
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
    sizes = [q.gathered_elements(mesh.tensor, ways, mesh.expert, mesh.expert_tensor) * bytes_per_element
             for q, *_ in walk]
    for i, (q, block, late, _) in enumerate(walk):
        first.setdefault(block, i)
        size = sizes[i]
        read, member = frozenset(() if late else (block,)), (i, q, block, "late" if late else kinds[block])
        if packed and not math.isinf(combine_bytes):
            continue  # merged below, in the parameters' pytree order
        if vectors and (_rank_one(q, mesh, ways) or lowered_matrix(q, mesh, ways, bytes_per_element)):
            flat = [(flat[0] if flat else 0.0) + size, (flat[1] if flat else []) + [(i, q, block, "late")]]
        elif math.isinf(combine_bytes) or size > combine_bytes:
            groups.append([size, block, i, late, read, [member], ""])  # unbounded: one per block (summed); over: alone
        elif group is not None and group[0] + size <= combine_bytes:
            group[:] = group[0] + size, block, i, group[3] or late, group[4] | read, group[5] + [member], ""
        else:
            group = [size, block, i, late, read, [member], ""]
            groups.append(group)
    if packed and not math.isinf(combine_bytes):
        groups = _packed_groups(walk, sizes, kinds, [what for _, what, _ in pieces], combine_bytes)
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
    """(leaf, block, late, piece: its index in ``pieces``) of a chunk's gradients in the order XLA's reduce-scatter combiner walks them: the pieces
    from the head, each piece's leaves as its transposed gathers issue them (reversed :func:`issue_order`).

    ``apart`` (sequence parallelism over tensor ranks, merges bounded): a tensor-replicated gradient (``late``: a
    norm's, a bias of a row-parallel matmul; not the position table's, whose sequence-sharded gradient is
    gathered over the ranks) is reduce-scattered from its sum over the tensor ranks. XLA's all-reduce combiner
    (which runs first) merges the whole backward's sums into one all-reduce, which the last piece holding such
    a gradient issues before its reduce-scatters: the earlier pieces' are walked there, at that piece's start,
    in its block (the traced program's merges, testbed.sim.xla.combine; one for one in
    tests/test_program_vs_plan.py)."""
    walk = [(q, block, apart and what != "embedding" and q.tensor_dim is None and not q.is_expert, k)
            for k, (block, what, params) in reversed(list(enumerate(pieces))) for q in reversed(issue_order(params))]
    if not any(late for _, _, late, _ in walk):
        return walk
    last = max(i for i, (_, _, late, _) in enumerate(walk) if late)
    start = next(i for i, (_, block, _, _) in enumerate(walk) if block == walk[last][1])
    held = [(q, walk[start][1], True, k) for q, _, late, k in walk[:start] if late]
    return [w for w in walk[:start] if not w[2]] + held + walk[start:]


#: The order JAX flattens a model's parameter tree in (testbed.runner.model: ``{"embed", "head", "layers"}``, keys
#: sorted), by piece kind.
_TREE_ROOTS = {"embedding": 0, "head": 1, "layer": 2}


def _packed_groups(walk: list[tuple], sizes: list[float], kinds: dict[int, str], whats: list[str], bound: float
                   ) -> list[list]:
    """The merged all-reduces XLA:TPU's all-reduce combiner makes of a chunk's gradients (``walk``:
    :func:`_scatter_walk`, ``sizes`` their bytes, ``whats`` each piece's kind) as :func:`_scatter_merges`' groups
    ([bytes, block issued in, walk index of the last member, late, blocks read, members, op]).

    testbed.sim.xla.xla_tpu, "packed": the combiner walks the gradients in the parameters' pytree order (the
    optimizer's update reads them so: embedding, head, then the layers in order, each one's keys sorted), and each
    merge takes every next gradient that still fits the bound, passing over those that do not (left for the next
    merge), rather than closing at the first; one over the bound alone is never merged. Each merge is issued once
    its last-computed member is (the one latest in ``walk``, the backward's order)."""
    order = sorted(range(len(walk)), key=lambda i: (_TREE_ROOTS[whats[walk[i][3]]], walk[i][3], walk[i][0].path))
    return [_group(m, walk, sizes, kinds) for m in xla_tpu.packed_merges(order, sizes.__getitem__, bound)]


def _group(members: list[int], walk: list[tuple], sizes: list[float], kinds: dict[int, str]) -> list:
    """A :func:`_scatter_merges` group of the walk indices ``members`` (:func:`_packed_groups`)."""
    last = max(members)
    late = any(walk[i][2] for i in members)
    read = frozenset(walk[i][1] for i in members if not walk[i][2])
    entries = [(i, walk[i][0], walk[i][1], "late" if walk[i][2] else kinds[walk[i][1]]) for i in sorted(members)]
    return [sum(sizes[i] for i in members), walk[last][1], last, late, read, entries, ""]


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