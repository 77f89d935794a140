"""Which parameter leaves a pass over sharded parameters gathers, and how many collectives that is.

testbed.plan.sharding decides which mesh axes shard the model state; which of
a chunk's parameter leaves that actually splits is the layout's one shard rule
(testbed.model.layout), and a combiner (XLA's all-gather and reduce-scatter
combiners, under the topology's ``calibration.collectives.combine_bytes``)
merges consecutive leaves' collectives. The simulator's task graph and the
analytic tier count a chunk's gathers and gradient reduce-scatters here
(:func:`parameter_collectives`), as testbed.runner.param_shards.ParamShards issues them.
"""

from __future__ import annotations

import functools
import math

from testbed.model import layout
from testbed.plan.runtime import XLA_COMBINE_BYTES
from testbed.plan.sharding import state_sharding
from testbed.plan.spec import MeshSpec, ModelSpec, Plan

__all__ = ["gathered_leaves", "moved_elements", "padded_params", "runner_whole_params", "combined_sizes", "backward_merges", "backward_groups", "backward_waits", "linked_layer",
           "XLA_COMBINE_BYTES", "combine_limit", "issue_order", "parameter_collectives", "regathered", "regathered_in_backward", "recomputed", "backward_walk", "RECOMPUTE_SKIPS", "bucket_share", "gradient_allreduces", "NORM_PARTS", "norm_elements"]

#: The norms' parameters (LayerNorm/RMSNorm scale and shift), by the first name on their path. The runner's
#: norms (testbed.runner.norms) sum their gradients over the tokens with ``jnp.sum``, which accumulates bf16 in
#: fp32: the partitioner reduces those partial sums across devices in fp32, before the cast back.
NORM_PARTS = ("ln1", "ln2", "norm")


def gathered_leaves(plan: Plan, stage: int, chunk: int | None, which: str = "params") -> tuple[int, ...]:
    """Elements of each parameter leaf of a chunk that fsdp/ZeRO-3 all-gathers, in layout order; () when unsharded.

    Every leaf is gathered when the shard count exceeds 1: by the layout's one shard rule each is split over
    the parameters' shard axes, evenly along a dim or flattened and padded
    (:meth:`testbed.model.layout.ParamSpec.gathered_elements`: the gathered size, padding included); the
    gathered leaf is whole over them and split as the device holds it by ``tensor`` and ``expert``.
    testbed.runner.param_shards.ParamShards issues one ``all_gather`` per leaf where a piece of the model uses
    it (a padded leaf's flat shards, testbed.runner.padding) and one ``psum_scatter`` of its gradient. In the
    order the runner issues them, which a combiner's merges follow (:func:`issue_order`): the embedding, each
    layer, the head, each piece's leaves in its pytree's order.

    ``chunk`` None: every chunk of the stage, in chunk order. ``which="optimizer"``: the leaves sharded with the
    optimizer state instead, which ZeRO-1/2 all-gathers over ``data`` after the update (XLA's partitioner,
    leaf by leaf as well).
    """
    v = plan.schedule.virtual_stages
    if chunk is None:
        return tuple(n for c in range(v) for n in gathered_leaves(plan, stage, c, which))
    ways = state_sharding(plan).ways(plan, which)
    if ways <= 1:
        return ()
    return _gathered(plan.model, plan.mesh, v, plan.stage_layers, ways, stage, chunk)


@functools.lru_cache(maxsize=65536)  # a search prices each chunk of thousands of plans sharing a mesh
def _gathered(spec: ModelSpec, mesh: MeshSpec, v: int, stage_layers: tuple[int, ...], ways: int, stage: int,
              chunk: int) -> tuple[int, ...]:
    """:func:`gathered_leaves` of one chunk, from what it depends on."""
    embed, head = layout.holds(stage, chunk, mesh.stage, v)
    span = layout.chunk_layers(spec, mesh.stage, v, stage_layers)[stage][chunk]
    params = list(issue_order(layout.embedding_params(spec)) if embed else ())
    for i in span:
        params += issue_order(layout.layer_params(spec, i))
    params += issue_order(layout.head_params(spec)) if head else ()
    return tuple(p.gathered_elements(mesh.tensor, ways, mesh.expert, mesh.expert_tensor) for p in params)


def issue_order(piece) -> list[layout.ParamSpec]:
    """A piece's parameters (the embedding, a layer, the head) in the order the runner issues their collectives:
    its pytree's leaf order, which for nested dicts is JAX's (keys sorted at every level: ``attn/bo``,
    ``attn/bqkv``, ..., ``mlp/w2``), not the layout table's. XLA's combiners merge consecutive collectives in
    program order, so where the bound splits a piece's collectives this order decides how many there are."""
    return sorted(piece, key=lambda p: p.path)


def moved_elements(plan: Plan, stage: int, chunk: int | None, which: str = "params") -> int:
    """Elements one collective over the shard axes of ``which`` (params, grads, optimizer) moves for a chunk's
    parameters on a device: a gather's output, a reduce-scatter's input. ``ways`` times the device's shards,
    so the padding of the padded parameters (:meth:`testbed.model.layout.ParamSpec.padded`) moves too and
    bytes are conserved (each rank's shard times the shard count); the chunk's unsharded elements when
    nothing shards ``which``. Every held parameter counts, a tied token-table copy included (as
    :attr:`testbed.model.costs.ChunkCost.params`, which it equals when every shard divides evenly).
    ``chunk`` None: the stage's chunks together. testbed.sim.graph.program's collectives carry these bytes."""
    v, mesh = plan.schedule.virtual_stages, plan.mesh
    if chunk is None:
        return sum(moved_elements(plan, stage, c, which) for c in range(v))
    ways = max(1, state_sharding(plan).ways(plan, which))
    return _moved(plan.model, stage, chunk, mesh.stage, v, plan.stage_layers, mesh.tensor, ways, mesh.expert,
                  mesh.expert_tensor)


@functools.lru_cache(maxsize=1 << 16)
def _moved(spec: ModelSpec, stage: int, chunk: int, stages: int, v: int, stage_layers: tuple[int, ...], tensor: int, ways: int,
           expert: int, expert_tensor: int | None = None) -> int:
    """:func:`moved_elements` of one chunk, memoized on what it reads (a search asks for the same chunk under
    every schedule, microbatch count and remat of a mesh)."""
    held = layout.chunk_params(spec, stage, chunk, stages, v, stage_layers=stage_layers)
    return ways * layout.held_elements(held, tensor, ways, expert, expert_tensor=expert_tensor)


def norm_elements(plan: Plan, stage: int, chunk: int, which: str = "optimizer") -> int:
    """Of :func:`moved_elements`, the norms' parameters' (:data:`NORM_PARTS`)."""
    v, mesh = plan.schedule.virtual_stages, plan.mesh
    ways = max(1, state_sharding(plan).ways(plan, which))
    held = layout.chunk_params(plan.model, stage, chunk, mesh.stage, v, stage_layers=plan.stage_layers)
    norms = ((p, n) for p, n in held if p.path[0] in NORM_PARTS)
    return ways * layout.held_elements(norms, mesh.tensor, ways, mesh.expert)


def padded_params(plan: Plan, which: str = "optimizer") -> tuple[str, ...]:
    """Names (layout order, each once) of the parameters whose ``which`` state is sharded flattened and padded:
    no free dim divides the shard count (:meth:`testbed.model.layout.ParamSpec.padded`). The memory model and
    the simulator count them sharded padded; so does the JAX runner (testbed.runner.padding: its optimizer
    state, and under fsdp / ZeRO-3 its held parameters and their gradients, flat and padded), but for the
    gradients :func:`runner_whole_params` names."""
    ways, mesh = state_sharding(plan).ways(plan, which), plan.mesh
    if ways <= 1:
        return ()
    names: dict[str, None] = {}
    for p in layout.model_params(plan.model):
        if p.padded(mesh.tensor, ways, mesh.expert, mesh.expert_tensor):
            names.setdefault(p.name)
    return tuple(names)


def runner_whole_params(plan: Plan) -> dict[str, tuple[str, ...]]:
    """Per kind of state sharded by the plan, the parameters the JAX runner does not shard padded where the rule
    does (:func:`padded_params`): only gradients, only under ZeRO-2 (the gradients cut into more pieces than
    the parameters). The runner's gradients have its held parameters' shapes, so a leaf the rule pads for the
    gradients is held whole, or where the parameters are held flat (fsdp under ZeRO-2) flat over the
    parameters' axes alone. Its parameters (fsdp, ZeRO-3) and optimizer state it does shard padded
    (testbed.runner.padding), so they never appear. Empty when nothing else is padded."""
    sharding = state_sharding(plan)
    if sharding.ways(plan, "grads") == sharding.ways(plan, "params"):
        return {}
    names = padded_params(plan, "grads")
    return {"grads": names} if names else {}


def combine_limit(combine_bytes: float | None, runtime_bytes: float = XLA_COMBINE_BYTES) -> float:
    """The bytes a combined all-gather or reduce-scatter of parameters stays within: the topology's
    ``calibration.collectives.combine_bytes`` where it states one (0 on XLA:CPU, which combines none), else the
    program's ``runtime.gather_combine_bytes``. Read by the plan's model (testbed.sim.step.facts) and the traced
    program's combiner (testbed.sim.graph.traced)."""
    return float(combine_bytes) if combine_bytes is not None else float(runtime_bytes)


def combined_sizes(sizes: tuple[float, ...], combine_bytes: float) -> tuple[float, ...]:
    """``sizes`` (bytes of collectives issued one after another) as a combiner merges them: consecutive ones
    joined while the merged collective stays within ``combine_bytes`` (XLA's all-gather and reduce-scatter
    combiners' threshold rule, CombineInstructionsByKey: one over the bound alone merges with none and does not
    end the open merge). 0: none merged; ``math.inf``: all of them one collective."""
    out: list[float] = []
    group = -1  # the open merge's index in out
    for size in sizes:
        if size > combine_bytes:
            out.append(float(size))
        elif group >= 0 and out[group] + size <= combine_bytes:
            out[group] += size
        else:
            out.append(float(size))
            group = len(out) - 1
    return tuple(out)


def linked_layer(k: int, layers: int) -> bool:
    """Whether layer ``k`` (forward order) of a run of ``layers`` under fsdp hands the layer after it a link, so
    that its backward gather waits for the link's cotangent, which the next layer gives as soon as its own
    cotangent arrives (a prefetch one layer ahead: the gather runs while the next layer's backward computes),
    rather than for its own cotangent, which that backward computes: every layer of a run but its last, whose
    gather waits for its own cotangent (the head's backward, or the next stage's, computes it). The one rule
    testbed.runner.model links its layers by (testbed.runner.param_shards.ParamShards.apply) and
    :func:`backward_waits` reads."""
    return k + 1 < layers


def backward_waits(layers: int, head: bool) -> tuple[int, ...]:
    """Per piece of a chunk's backward (the head if held, then its ``layers`` layers from the last), the index of
    the piece whose backward computes the cotangent its gather waits for, -1 where none of the chunk's does (the
    head's waits for the loss's; the last layer's, without a head, for the next stage's). A linked layer
    (:func:`linked_layer`) waits for the cotangent into the piece after it, computed two pieces back; an unlinked
    one for its own, computed by the piece just before it (whose gather then reaches it)."""
    out = [-1] * int(head)
    for j in range(layers):
        k = len(out)
        linked = linked_layer(layers - 1 - j, layers)
        out.append(max(-1, k - 2) if linked else k - 1)
    return tuple(out)


def backward_merges(pieces: list[tuple[float, ...]], combine_bytes: float, waits: tuple[int, ...] | None = None
                    ) -> list[tuple[float, int]]:
    """(bytes, piece) of each backward gather of a chunk, ``pieces`` the bytes of each piece's regathered leaves
    in the backward's order (the head, then the layers from the last): XLA's combiner rule
    (CombineInstructionsByKey, testbed.sim.xla.combine) on the runner's program, where piece ``k``'s gather waits for
    the backward of piece ``waits[k]`` (:func:`backward_waits`; default: every piece linked, ``k - 2``), so it is
    reachable from the gathers of that piece and those before it: a merge takes the next piece's leaves while
    none of its pieces is among those, runs while its bytes stay within ``combine_bytes``, and a leaf over it
    alone merges with none (nor ends a merge). ``piece``: the index of the merge's first leaf's piece, the first
    the backward reads."""
    return [(size, k) for size, k, _ in backward_groups(pieces, combine_bytes, waits)]


def backward_groups(pieces: list[tuple[float, ...]], combine_bytes: float, waits: tuple[int, ...] | None = None,
                    alone: frozenset[int] = frozenset()) -> list[tuple[float, int, tuple[int, ...]]]:
    """:func:`backward_merges` with each merge's members: (bytes, piece, the members' indices in the walk of every
    piece's leaves one after another), in the order the merges open; those of ``alone`` (walk indices: gathers the
    compiler makes another collective, testbed.model.gather_lowering) each alone, as one over the bound."""
    waits = tuple(max(-1, k - 2) for k in range(len(pieces))) if waits is None else waits
    out: list[list] = []
    group: list | None = None  # [bytes, first piece, members]
    t = 0
    for k, sizes in enumerate(pieces):
        for size in sizes:
            if size > combine_bytes or t in alone:
                out.append([size, k, [t]])
            elif group is not None and group[1] > waits[k] and group[0] + size <= combine_bytes:
                group[0] += size
                group[2].append(t)
            else:
                group = [size, k, [t]]
                out.append(group)
            t += 1
    return [(size, k, tuple(members)) for size, k, members in out]


def parameter_collectives(plan: Plan, stage: int, chunk: int | None, combine_bytes: float = math.inf,
                          bytes_per_element: float = 4.0, which: str = "params") -> int:
    """How many all-gathers one gather of a chunk's sharded parameters is (as many reduce-scatters for their
    gradients): one per gathered leaf (:func:`gathered_leaves`) as ``combine_bytes`` merges them
    (:func:`combined_sizes`; the topology's ``calibration.collectives.combine_bytes``: 0 on XLA:CPU, which
    combines none, unbounded where one flat buffer per chunk moves). At least 1 whenever parameters are
    sharded, so a chunk whose leaves all stay whole still counts its one gather, as testbed.sim.graph.program prices
    it; 0 when nothing shards them. ``chunk`` and ``which`` as in :func:`gathered_leaves`."""
    if not state_sharding(plan).split_axes(plan, which):
        return 0
    leaves = gathered_leaves(plan, stage, chunk, which)
    return max(1, len(combined_sizes(tuple(n * bytes_per_element for n in leaves), combine_bytes)))


def backward_walk(piece, recompute: bool = False) -> list[layout.ParamSpec]:
    """A piece's leaves its backward gathers, in order: with ``recompute`` (a full-remat layer on XLA:TPU) its
    :func:`recomputed` ones for the recomputation first, then those :func:`regathered_in_backward` for its
    gradients; each in :func:`issue_order`."""
    order = issue_order(piece)
    return [q for q in order if recompute and recomputed(q)] + [q for q in order if regathered_in_backward(q)]


def regathered_in_backward(param: layout.ParamSpec) -> bool:
    """Whether a backward pass all-gathers ``param`` again under fsdp/ZeRO-3: every parameter the backward reads,
    so all but the additive ones (:attr:`~testbed.model.param_spec.ParamSpec.additive`: biases, LayerNorm
    shifts), whose gradients need no value (XLA drops a gather nothing reads). The one rule :func:`regathered`
    counts and testbed.runner.param_shards executes: where a recomputed forward reads an additive leaf, the
    runner keeps the forward's gathered copy (a bias is small) instead of gathering it again."""
    return not param.additive


#: A layer's leaves (path) a full-remat recomputation does not read: the MLP's output projection, whose output only
#: joins the residual sum (testbed.sim.xla.xla_tpu: XLA:TPU gathers the others again for the recomputation).
RECOMPUTE_SKIPS = (("mlp", "w2"), ("mlp", "b2"))


def recomputed(param: layout.ParamSpec) -> bool:
    """Whether a layer's full-remat recomputation reads ``param`` (all the layer's leaves but
    :data:`RECOMPUTE_SKIPS`): the leaves XLA:TPU gathers a second time in the layer's backward (testbed.sim.xla.xla_tpu)."""
    return tuple(param.path[:2]) not in RECOMPUTE_SKIPS


def regathered(plan: Plan, s: int, c: int, moved: int, leaves: int, combine_bytes: float = math.inf,
               bytes_per_element: float = 4.0, recompute: bool = False) -> tuple[int, int]:
    """(elements, collectives) of the backward's gathers of a chunk: all but the embedding's leaves (its backward,
    a scatter-add of the rows' gradients, reads no table) and the additive ones (:func:`regathered_in_backward`).
    Collectives: under a finite ``combine_bytes`` (:func:`combine_limit`) as :func:`backward_merges` merges the
    pieces' leaves in :func:`issue_order`, from the head (XLA's combiner rule on the runner's program: a merge
    spans at most two adjacent pieces); unbounded, the whole chunk's count. ``recompute``: each layer's
    backward also gathers its :func:`recomputed` leaves for its recomputation (XLA:TPU under full remat), first."""
    if not leaves:
        return moved, leaves
    again = _recompute_elements(plan, s, c) if recompute else 0
    if not math.isinf(combine_bytes):
        return moved - _unread(plan, s, c) + again, _regathered_collectives(plan, s, c, combine_bytes,
                                                                            bytes_per_element, recompute)
    return moved - _unread(plan, s, c) + again, leaves


def _recompute_elements(plan: Plan, s: int, c: int) -> int:
    """Elements of a chunk's layers' :func:`recomputed` leaves, as gathered (:func:`regathered`)."""
    ways, mesh, spec = state_sharding(plan).ways(plan, "params"), plan.mesh, plan.model
    ends = set(layout.embedding_params(spec)) | set(layout.head_params(spec))
    held = layout.chunk_params(spec, s, c, mesh.stage, plan.schedule.virtual_stages, stage_layers=plan.stage_layers,
                               tied_copy=False)
    again = tuple((q, n) for q, n in held if q not in ends and recomputed(q))
    return ways * layout.held_elements(again, mesh.tensor, ways, mesh.expert, expert_tensor=mesh.expert_tensor)


def _unread(plan: Plan, s: int, c: int) -> int:
    """Elements of a chunk's gathered leaves its backward does not gather again (:func:`regathered`)."""
    ways, mesh = state_sharding(plan).ways(plan, "params"), plan.mesh
    embed, _ = layout.holds(s, c, mesh.stage, plan.schedule.virtual_stages)
    held = layout.chunk_params(plan.model, s, c, mesh.stage, plan.schedule.virtual_stages,
                               stage_layers=plan.stage_layers)
    skipped = tuple((q, n) for q, n in held
                    if (embed and q in layout.embedding_params(plan.model)) or not regathered_in_backward(q))
    return ways * layout.held_elements(skipped, mesh.tensor, ways, mesh.expert, expert_tensor=mesh.expert_tensor)


def _regathered_collectives(plan: Plan, s: int, c: int, combine_bytes: float, bytes_per_element: float,
                            recompute: bool = False) -> int:
    """The backward's gather collectives of a chunk (pieces: a layer; the head), as :func:`backward_merges`."""
    mesh = plan.mesh
    return _regathered_count(plan.model, mesh.stage, plan.schedule.virtual_stages, plan.stage_layers, s, c,
                             state_sharding(plan).ways(plan, "params"), mesh.tensor, mesh.expert, mesh.expert_tensor,
                             combine_bytes, bytes_per_element, recompute)


@functools.lru_cache(maxsize=8192)  # a search prices the chunks of thousands of plans that differ elsewhere
def _regathered_count(spec: ModelSpec, stages: int, v: int, stage_layers: tuple[int, ...], s: int, c: int, ways: int,
                      tensor: int, expert: int, expert_tensor: int | None, combine_bytes: float,
                      bytes_per_element: float, recompute: bool = False) -> int:
    """:func:`_regathered_collectives` of the plan facts it depends on."""
    _, head = layout.holds(s, c, stages, v)
    pieces = [(layout.layer_params(spec, i), recompute)
              for i in layout.chunk_layers(spec, stages, v, stage_layers)[s][c]]
    pieces += [(layout.head_params(spec), False)] if head else []
    sizes = [tuple(q.gathered_elements(tensor, ways, expert, expert_tensor) * bytes_per_element
                   for q in backward_walk(piece, again)) for piece, again in reversed(pieces)]
    return max(1, len(backward_merges(sizes, combine_bytes, backward_waits(len(pieces) - int(head), head))))


def gradient_allreduces(plan: Plan, stage: int, chunk: int, bytes_per_element: float,
                        allreduce_bytes: float | None) -> int:
    """How many all-reduces sum a chunk's replicated dense gradients (nothing shards them): XLA's all-reduce
    combiner merges the independent per-leaf sums in the backward's order (the head, the layers from the last,
    each piece's leaves in :func:`issue_order`, the embedding's last: the backward's last gradient) while a merge
    stays within ``allreduce_bytes`` (the topology's ``calibration.collectives.allreduce_combine_bytes``; None:
    every one merged, one all-reduce) by :func:`combined_sizes`' rule; the recorded XLA:TPU compiles
    (benchmarks/xla_tpu/) merge exactly so."""
    if allreduce_bytes is None or math.isinf(allreduce_bytes):
        return 1
    mesh = plan.mesh
    return _allreduce_count(plan.model, mesh.stage, plan.schedule.virtual_stages, plan.stage_layers, stage, chunk,
                            mesh.tensor, float(allreduce_bytes), float(bytes_per_element))


@functools.lru_cache(maxsize=8192)
def _allreduce_count(spec: ModelSpec, stages: int, v: int, stage_layers: tuple[int, ...] | None, s: int, c: int,
                     tensor: int, bound: float, bytes_per_element: float) -> int:
    """:func:`gradient_allreduces` of the plan facts it depends on."""
    embed, head = layout.holds(s, c, stages, v)
    pieces = [layout.head_params(spec)] if head else []
    pieces += [layout.layer_params(spec, i) for i in reversed(layout.chunk_layers(spec, stages, v, stage_layers)[s][c])]
    pieces += [layout.embedding_params(spec)] if embed else []
    sizes = tuple(q.device_elements(tensor) * bytes_per_element for piece in pieces for q in issue_order(piece)
                  if not q.is_expert)
    return max(1, len(combined_sizes(sizes, bound)))


def bucket_share(leaves: int, buckets: int, k: int) -> int:
    """Of a chunk's ``leaves`` gradient collectives, those bucket ``k`` of ``buckets`` reduces (0 stays 0: the
    parameters are not sharded, one reduction per bucket). Whole numbers summing to ``leaves``, at least 1."""
    if leaves <= 0:
        return 0
    return max(1, leaves * (k + 1) // buckets - leaves * k // buckets)
