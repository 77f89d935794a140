"""The facts of one virtual chunk of one stage: its cost and shapes, each F/B/W action's work, collectives and
sends, how its sharded parameters are gathered block by block and how its gradients are reduced.

:func:`chunk_facts` works them out into a frozen :class:`ChunkFacts` (small named types for its pairs:
:class:`ForwardBackward`, :class:`Moved`, :class:`Reduced`, :class:`Gathered`); testbed.sim.step.facts.step_facts
gathers them, one per chunk (chunks alike worked out once), into the step's facts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from testbed.model.costs import ChunkCost
from testbed.model.gather_lowering import NO_LOWERING, Lowering
from testbed.model.gemm import ChunkGemms, Gemm, gemm_flops, scaled, without
from testbed.model.layout import chunk_params, held_elements
from testbed.model.block_scatters import block_scatters, scatter_cuts, scatter_early, scatter_ops, scatter_reads
from testbed.model.blocks import block_gathers, block_ops, gather_holds, own_blocks
from testbed.model.leaves import (bucket_share, combine_limit, gradient_allreduces, moved_elements, parameter_collectives,
                                  regathered)
from testbed.model.moe import moe_layers
from testbed.model.spans import action_spans
from testbed.pipeline.schedules import Schedule
from testbed.plan.sharding import gathers_parameters
from testbed.plan.spec import Plan, Remat
from testbed.sim.step.action_work import action_work
from testbed.sim.step.grad_bytes import (accumulated_bytes, accumulated_elements, accumulating_gemms, gradient_buckets, in_last_span, reduced_bytes, sequence_reduced,
                                     sequence_replicated, summed_each_microbatch, token_table_last,
                                     without_embedding_gathers)
from testbed.sim.step.memo import cached_chunk_gemms
from testbed.sim.step.moe import Piece, expert_gemms, moe_pieces
from testbed.sim.step.tp_overlap import TpOverlap, tp_overlap
from testbed.sim.xla.xla_tpu import regathers_sequence, scatters_whole_sequence, sequence_gather_bytes

__all__ = ["ActionWork", "ChunkFacts", "Work", "Outgoing", "ForwardBackward", "Moved", "Reduced", "Gathered", "BucketMerge",
           "MATMULS_PER_LAYER", "chunk_facts", "action_sends"]

#: Kernels a layer's FLOPs are divided over where the calibration prices matmuls by size, not by shape
#: (testbed.sim.price.compute.compute_seconds' ``efficiency_half_flops``, fitted with this count): a dense layer's four
#: weight GEMMs, QKV, the attention output and the MLP's two (Narayanan et al. 2021, Sec. 5.1's FLOP count).
MATMULS_PER_LAYER = 4


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ForwardBackward(Generic[T]):
    """One value per direction of a chunk's parameter gathers: the forward's (``F``) and the backward's (any other
    kind of action)."""

    forward: T
    backward: T

    def of(self, kind: str) -> T:
        """The ``kind`` action's value."""
        return self.forward if kind == "F" else self.backward


class Moved(NamedTuple):
    """Elements one collective over the shard axes of a chunk's parameters, gradients and optimizer state moves on
    a device (testbed.model.leaves.moved_elements: padded shards' padding included)."""

    params: int
    grads: int
    optimizer: int


class Reduced(NamedTuple):
    """Bytes a device's reduction of a chunk's gradients moves: a microbatch's reduce-scatter into the sharded
    accumulator (over ``Moved.grads``) and the last one (over ``Moved.optimizer``)."""

    each_microbatch: float
    last: float


class Gathered(NamedTuple):
    """What an action's gathers of a chunk's sharded parameters are on a device: elements moved, collectives."""

    elements: int
    collectives: int



class BucketMerge(NamedTuple):
    """One reduction of a gradient bucket (ChunkFacts.bucket): its share of the chunk's gradients, its collectives
    (0: one) and the op the compiler makes of it where not the parameter kind's own (empty; ``all_reduce``: XLA:TPU's
    rank-1 gradients, testbed.model.block_scatters.scatter_ops)."""

    share: float
    count: int
    op: str = ""


class Work(NamedTuple):
    """An action's work on a device (testbed.sim.step.action_work.action_work): its FLOPs, HBM bytes, and the
    replicated and split activation bytes its elementwise passes read."""

    flops: float
    hbm_bytes: float
    replicated_bytes: float
    split_bytes: float


class Outgoing(NamedTuple):
    """What an action sends another stage: the destination stage, its chunk there, and the bytes."""

    stage: int
    chunk: int
    nbytes: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionWork:
    """One F/B/W action of one chunk, one microbatch: its work, collectives, MoE chain, ring part and sends.

    ``work`` is its :class:`Work` (:func:`action_work`);
    ``tensor`` its tensor collectives as ``(op, count, bytes each)``; ``chain`` the per-layer MoE chain under expert
    parallelism (testbed.sim.step.moe; empty without), after the ring when context parallelism plays one too;
    ``ring_work`` and ``ring_gemms`` what the ring plays (all the work, or all but the routed and shared
    experts' when there is a chain); ``sends`` what it sends other stages (:class:`Outgoing`);
    ``overlap`` its tensor collectives GEMM by GEMM under ``runtime.tp_comm_overlap`` (testbed.sim.step.tp_overlap;
    None: they follow the compute, or with the overlap on an MoE chunk run beside the whole action).
    """

    kind: str
    work: Work
    tensor: tuple[tuple[str, int, int], ...]
    gemms: tuple[Gemm, ...]
    chain: tuple[Piece, ...]
    ring_work: Work
    ring_gemms: tuple[Gemm, ...]
    sends: tuple[Outgoing, ...]
    overlap: TpOverlap | None = None
    #: Its spans between blocking tensor collectives (testbed.model.spans; empty: one span), each a roofline of its
    #: own without an elementwise calibration (testbed.sim.price.compute.compute_seconds).
    spans: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkFacts:
    """One virtual chunk of one stage: its cost, shapes, parameter collectives and actions.

    ``leaves``: the collectives one gather of its sharded parameters (and one reduce-scatter of their
    gradients) is (testbed.model.leaves.parameter_collectives); ``expert_params`` the routed experts'
    parameters on one device (0 when nothing reduces gradients); ``buckets`` the gradient buckets of its
    last backward when gradients reduce while the backward goes on (:func:`gradient_buckets`: one per layer, at
    most :data:`BUCKETS`, or by ``runtime.grad_bucket_bytes``; one per block when the parameters are sharded; one
    when they wait for the backward's end). ``blocks``: the pieces an action that gathers the sharded parameters
    is split into, one per layer (the embedding and the head ride with the first and last), each gathered
    before it computes (testbed.plan.sharding.gathered_blocks). ``moved``: the elements one collective over
    the shard axes of the parameters, the gradients and the optimizer state moves for the chunk on a device
    (testbed.model.leaves.moved_elements: padded shards' padding included, so bytes are conserved).
    ``reduced``: the bytes a device's reduction of the chunk's gradients moves, a microbatch's reduce-scatter
    into the sharded accumulator (over ``moved.grads``) and the last one (over ``moved.optimizer``), at
    :func:`reduce_bytes` each but the norms' parameters' at 4 (:func:`reduced_bytes`); ``sequence_bytes`` of
    the last, the tensor-replicated parameters' under sequence parallelism (:func:`sequence_reduced`).
    """

    cost: ChunkCost
    gemms: ChunkGemms
    kernels: int
    leaves: int
    moe_layers: int
    expert_params: int
    buckets: int
    actions: tuple[ActionWork, ...]
    moved: Moved
    blocks: int = 1
    regather: Gathered = Gathered(0, 0)
    reduced: Reduced = Reduced(0.0, 0.0)
    sequence_bytes: float = 0.0
    block_sizes: ForwardBackward[tuple[tuple[float, ...], ...]] = ForwardBackward((), ())
    #: As ``block_sizes``, each merge's block's own leaves (their first path parts; None: anything), where the
    #: blocks are the chunk's own pieces (testbed.model.blocks.gather_holds); empty: not known.
    block_holds: ForwardBackward[tuple[tuple[frozenset[str] | None, ...], ...]] = ForwardBackward((), ())
    #: As ``block_sizes``, each collective's op (``all_reduce`` where the compiler lowers a gather as one:
    #: testbed.model.gather_lowering); empty: every one an all-gather.
    block_ops: ForwardBackward[tuple[tuple[str, ...], ...]] = ForwardBackward((), ())
    #: Per action kind, (kind, each block's (share of the action's work, its GEMMs)) where the embedding and the
    #: head are blocks of their own (testbed.model.blocks.own_blocks); empty: equal shares of the action.
    block_work: tuple[tuple[str, tuple[tuple[float, tuple[Gemm, ...]], ...]], ...] = ()
    #: Per gradient bucket of the last backward (from the head), each merged reduce-scatter's share of the
    #: gradients, at the blocks' real sizes (testbed.model.block_scatters.block_scatters); empty: equal shares.
    bucket_sizes: tuple[tuple[float, ...], ...] = ()
    #: Per bucket of ``bucket_sizes``, per merged reduce-scatter, the buckets (blocks) whose weight gradients it
    #: reads (testbed.model.block_scatters.scatter_reads); empty: each reads its own.
    bucket_reads: tuple[tuple[tuple[int, ...], ...], ...] = ()
    #: Per bucket of ``bucket_sizes``, per merged reduce-scatter, the share of its block's weight-gradient matmuls
    #: it reads where it leaves before the block's input gradients, else 0 (testbed.model.block_scatters.scatter_early).
    bucket_early: tuple[tuple[float, ...], ...] = ()
    #: Per bucket of ``bucket_sizes``, per merged reduce-scatter, for each bucket of its ``bucket_reads`` the share
    #: of that block's weight-gradient matmuls it reads (testbed.model.block_scatters.scatter_cuts); empty: all of it.
    bucket_cuts: tuple[tuple[tuple[float, ...], ...], ...] = ()
    #: Per bucket of ``bucket_sizes``, per merged reduce-scatter, the op the compiler makes of it where another
    #: (``all_reduce``: XLA:TPU's rank-1 gradients, testbed.model.block_scatters.scatter_ops), else empty; empty: none.
    bucket_ops: tuple[tuple[str, ...], ...] = ()
    #: The merged all-reduces that sum the chunk's replicated gradients (testbed.model.leaves.gradient_allreduces).
    allreduces: int = 1
    #: (token table's gradient bytes summed after the rest, the gather's between): grad_bytes.token_table_last.
    tail: tuple[float, float] = (0.0, 0.0)

    def special(self, share: float, reduce_b: float) -> tuple[float, float]:
        """(routed experts', sequence-replicated) bytes of ``share`` of the chunk's last gradient reduction: the
        parameter kinds reduced over axes of their own (:class:`Reduction`); the rest of ``reduced.last`` is dense."""
        return self.expert_params * share * reduce_b, self.sequence_bytes * share

    def gather(self, kind: str) -> Gathered:
        """(elements, collectives) a ``kind`` action's gathers of the chunk's sharded parameters move on a device:
        the forward all of them (``moved.params``, ``leaves``); the backward all but the embedding's, whose backward
        (a scatter-add of the rows' gradients) reads no weight (``regather``)."""
        return Gathered(self.moved.params, self.leaves) if kind == "F" else self.regather

    def gather_sizes(self, kind: str) -> tuple[tuple[float, ...], ...]:
        """Per block, the bytes of each all-gather a ``kind`` action's gathers issue (``block_sizes``: the
        forward's, then the backward's; testbed.model.blocks.block_gathers): the merges' real sizes."""
        return self.block_sizes.of(kind)

    def gather_ops(self, kind: str) -> tuple[tuple[str, ...], ...]:
        """Per block, per collective of :meth:`gather_sizes`, its op (``block_ops``; else ``all_gather``)."""
        ops = self.block_ops.of(kind) if self.block_ops.forward or self.block_ops.backward else ()
        return ops or tuple(("all_gather",) * len(block) for block in self.gather_sizes(kind))

    def gather_holds(self, kind: str) -> tuple[tuple[frozenset[str] | None, ...], ...]:
        """Per block, per all-gather of :meth:`gather_sizes`, the block's own leaves it holds (``block_holds``;
        empty: not known, every span of a block waits for all of its gathers)."""
        return self.block_holds.of(kind)

    def action(self, kind: str) -> ActionWork:
        return next(a for a in self.actions if a.kind == kind)

    def block_shares(self, kind: str, pieces: int) -> tuple[tuple[float, tuple[Gemm, ...]], ...]:
        """Each of ``pieces`` blocks' (share of a ``kind`` action's work, its GEMMs) where the blocks are the
        embedding's, each layer's and the head's (``block_work``); empty: ``pieces`` equal shares."""
        if pieces != self.blocks:
            return ()
        return next((blocks for k, blocks in self.block_work if k == kind), ())

    def bucket(self, pieces: int, k: int) -> tuple[BucketMerge, ...]:
        """Each reduction of bucket ``k`` of ``pieces`` (:class:`BucketMerge`): each merged reduce-scatter of its
        block at its real size (``bucket_sizes``, its op ``bucket_ops``) where the buckets are the blocks, else one
        equal share of :func:`bucket_share`'s count."""
        if self.bucket_sizes and pieces == len(self.bucket_sizes):
            ops = self.bucket_ops[k] if self.bucket_ops else ("",) * len(self.bucket_sizes[k])
            return tuple(BucketMerge(share, 1, op) for share, op in zip(self.bucket_sizes[k], ops))
        return (BucketMerge(1 / pieces, bucket_share(self.reduction_collectives, pieces, k)),)

    @property
    def reduction_collectives(self) -> int:
        """The collectives one reduction of the chunk's gradients is: its reduce-scatters (``leaves``) when the
        parameters are sharded, else its merged all-reduces where a bound splits them (``allreduces`` > 1), else 0
        (one per bucket); testbed.sim.graph.grad_tasks.allreduce_count shares them per parameter kind."""
        return self.leaves or (self.allreduces if self.allreduces > 1 else 0)

    def reads(self, pieces: int, k: int) -> tuple[tuple[int, ...], ...]:
        """Per reduction of :meth:`bucket` ``k``, the buckets whose weight gradients it reads (``bucket_reads``;
        else its own): a merge leaves once those are computed (testbed.sim.step.span_order)."""
        if self.bucket_reads and pieces == len(self.bucket_reads):
            return self.bucket_reads[k]
        return ((k,),) * len(self.bucket(pieces, k))

    def cuts(self, pieces: int, k: int) -> tuple[tuple[float, ...], ...]:
        """Per reduction of :meth:`bucket` ``k``, per bucket of its :meth:`reads`, the share of that block's
        weight-gradient matmuls it reads (``bucket_cuts``; else all of them)."""
        if self.bucket_cuts and pieces == len(self.bucket_cuts):
            return self.bucket_cuts[k]
        return tuple((1.0,) * len(r) for r in self.reads(pieces, k))

    def early(self, pieces: int, k: int) -> tuple[float, ...]:
        """Per reduction of :meth:`bucket` ``k``, the share of its block's weight-gradient matmuls computed before
        the block's input gradients for it to leave (``bucket_early``; else none)."""
        if self.bucket_early and pieces == len(self.bucket_early):
            return self.bucket_early[k]
        return (0.0,) * len(self.bucket(pieces, k))


def _directions(rule, plan: Plan, s: int, c: int, blocks: int, gathers: dict[str, int], combine: float,
                param_b: float, again: bool, matmul_b: float, lowering: Lowering) -> ForwardBackward:
    """``rule`` (testbed.model.blocks' block_gathers, block_ops or gather_holds) of the forward's and the backward's
    gathers (``gathers``: the elements each moves), as :func:`chunk_facts` reads them."""
    return ForwardBackward(*(rule(plan, s, c, kind, blocks, n, combine, param_b, again and kind == "B", matmul_b,
                                  lowering) for kind, n in gathers.items()))


def _bucket_facts(plan: Plan, s: int, c: int, blocks: int, rule: tuple, per_block: bool, chained: bool) -> dict:
    """:class:`ChunkFacts`' ``bucket_*`` fields of a chunk whose gradients leave a bucket a block (``per_block``;
    else none): each bucket's merged sizes, reads, early parts (``chained``), cuts and, where ``rule`` lowers rank-1
    gradients to all-reduces, their ops (testbed.model.block_scatters, ``rule`` its combiner's arguments)."""
    sizes = block_scatters(plan, s, c, blocks, *rule) if per_block else ()
    return {"bucket_sizes": sizes,
            "bucket_reads": scatter_reads(plan, s, c, blocks, *rule) if sizes else (),
            "bucket_early": scatter_early(plan, s, c, blocks, *rule) if sizes and chained else (),
            "bucket_cuts": scatter_cuts(plan, s, c, blocks, *rule) if sizes else (),
            "bucket_ops": scatter_ops(plan, s, c, blocks, *rule) if sizes and rule[2] else ()}


def chunk_facts(plan: Plan, schedule: Schedule, chunk_costs, s: int, c: int, span, combine: float, param_b: float,
                 reduces: bool, sharded_accumulation: bool, reduce_b: float = 2.0, chained: bool = False,
                 native: bool = False, allreduce_bytes: float | None = None, scatter_allreduce: bool = False,
                 recompute_gathers: bool = False, fused: bool = False, matmul_b: float = 0.0,
                 lowering: Lowering = NO_LOWERING, narrowed: bool = False, whole_slice: bool = False) -> ChunkFacts:
    """:class:`ChunkFacts` of chunk ``c`` of stage ``s`` (``span``: its layers). ``scatter_allreduce``: the
    gradients' reduce-scatters compile to all-reduces, merged within ``allreduce_bytes`` (testbed.sim.xla.xla_tpu);
    ``recompute_gathers``: a full-remat layer's backward gathers its recomputation's leaves apart; ``matmul_b``: bytes
    per element of the weight matrices' gathers (testbed.sim.xla.xla_tpu.matmul_gather_bytes; 0: ``param_b``);
    ``lowering``: the gathers lowered as all-reduces (testbed.model.gather_lowering); ``narrowed``: the compiler
    gathers activations only matmuls read in their dtype (testbed.sim.xla.xla_tpu.sequence_gather_bytes);
    ``whole_slice``: a reduce-scatter over every device is an all-reduce (testbed.sim.xla.xla_tpu.scatters_as_allreduce)."""
    n_moe = moe_layers(plan.model, span)
    cost, shapes = chunk_costs[s][c], accumulating_gemms(plan, cached_chunk_gemms(plan, s, c), fused, n_moe)
    kernels = max(1, MATMULS_PER_LAYER * cost.layers)
    p, v = plan.mesh.stage, plan.schedule.virtual_stages
    expert_params = held_elements(chunk_params(plan.model, s, c, p, v, stage_layers=plan.stage_layers),
                                  plan.mesh.tensor, 1, plan.mesh.expert, True, plan.mesh.expert_tensor) if reduces else 0
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    tail = token_table_last(plan, cost, combine, reduce_b) if reduces else (0.0, 0.0)
    actions = tuple(_action(plan, schedule, chunk_costs, s, c, kind, shapes, kernels, n_moe, bool(tail[1]), native,
                            fused, narrowed, whole_slice) for kind in kinds)
    gathering = gathers_parameters(plan, "F")
    own = (gathering and plan.runtime.fsdp_edge_blocks and (cost.has_embedding or cost.has_head)  # own_blocks
           and cost.layers >= 1 and plan.mesh.context == 1 and not any(a.chain or a.overlap for a in actions))
    blocks = (own_blocks(cost.layers, cost.has_embedding, cost.has_head) if own
              else max(1, cost.layers) if gathering else 1)
    moved = Moved(*(moved_elements(plan, s, c, w) for w in ("params", "grads", "optimizer")))
    during = sharded_accumulation or plan.runtime.grad_reduce_overlap  # buckets reduce while the backward goes on
    buckets = (blocks if blocks > 1 and sharded_accumulation
               else gradient_buckets(plan, cost.layers, moved.optimizer * reduce_b)) if during else 1
    leaves = parameter_collectives(plan, s, c, combine, param_b)
    sequence_b, position_saved = sequence_reduced(plan, s, c, reduce_b, native) if reduces else (0.0, 0.0)
    again = recompute_gathers and plan.remat is Remat.FULL  # XLA:TPU: the recomputation's own gathers
    regather = Gathered(*regathered(plan, s, c, moved.params, leaves, combine, param_b, again))
    gathers = {"F": moved.params, "B": regather.elements}
    sizes, ops, holds = (_directions(rule, plan, s, c, blocks, gathers, combine, param_b, again, matmul_b, lowering)
                         if wanted else ForwardBackward((), ())
                         for rule, wanted in ((block_gathers, leaves), (block_ops, leaves and lowering.active),
                                              (gather_holds, leaves and own)))
    block_work = tuple((a.kind, _block_work(shapes, a, cost, split=schedule.split_backward)) for a in actions) \
        if own else ()
    merge = combine_limit(allreduce_bytes, math.inf) if scatter_allreduce else combine  # the combiner that merges
    vectors = bool(lowering.lanes) and reduces and not scatter_allreduce  # XLA:TPU's rank-1 gradients' all-reduce
    rule = (merge, reduce_b, vectors, scatter_allreduce)  # XLA:TPU packs the all-reduces (xla_tpu: the combiner)
    bucket_facts = _bucket_facts(plan, s, c, blocks, rule, own and buckets == blocks, chained)
    return ChunkFacts(cost=cost, gemms=shapes, kernels=kernels, moe_layers=n_moe, expert_params=expert_params,
                      leaves=leaves, buckets=buckets, actions=actions, moved=moved, blocks=blocks,
                      regather=regather, block_sizes=sizes, block_ops=ops, block_holds=holds, block_work=block_work,
                      **bucket_facts,
                      reduced=Reduced(reduced_bytes(plan, s, c, moved.grads, reduce_b, "grads", native),
                                      reduced_bytes(plan, s, c, moved.optimizer, reduce_b, "optimizer", native)
                                      - position_saved + (sequence_b if summed_each_microbatch(plan)
                                                          and sequence_replicated(plan) else 0.0)),
                      sequence_bytes=sequence_b, tail=tail,
                      allreduces=gradient_allreduces(plan, s, c, reduce_b, allreduce_bytes) if reduces and not leaves
                      else 1)


def _block_work(shapes: ChunkGemms, work: ActionWork, cost: ChunkCost, split: bool
                ) -> tuple[tuple[float, tuple[Gemm, ...]], ...]:
    """Each block's (share of ``work``, its GEMMs) in the order the action computes them (forward: the embedding,
    each layer, the head; backward from the head), the embedding and the head as blocks of their own
    (testbed.model.blocks.own_blocks): the head's share is its GEMMs' FLOPs (its projection, and in the backward
    its input and weight gradients), the embedding's none (a lookup, and its backward a scatter-add), the layers
    the rest in equal shares. Its HBM and activation bytes follow the same shares."""
    kind, layers, head = work.kind, cost.layers, cost.has_head
    own: tuple[Gemm, ...] = ()
    if head:
        own = {"F": (shapes.forward[-1],), "W": (shapes.backward_weight[-1],),
               "B": (shapes.backward_input[-1],) + (() if split else (shapes.backward_weight[-1],))}[kind]
    rest = without(work.gemms, own)
    flops = work.work.flops
    share = gemm_flops(own) / flops if flops > 0 else 0.0
    layer = ((1.0 - share) / layers, scaled(rest, 1 / layers))
    blocks = [(0.0, ())] * int(cost.has_embedding) + [layer] * layers + [(share, own)] * int(head)
    return tuple(blocks if kind == "F" else reversed(blocks))


def _action(plan: Plan, schedule: Schedule, chunk_costs, s: int, c: int, kind: str, shapes: ChunkGemms,
            kernels: int, n_moe: int, tail_gather: bool = False, native: bool = False, fused: bool = False,
            narrowed: bool = False, whole_slice: bool = False) -> ActionWork:
    """:class:`ActionWork` of one ``kind`` action of chunk ``c`` of stage ``s`` (``tail_gather``: ChunkFacts.tail's;
    ``native``: step_facts' ``native_reductions``; ``fused``: its ``fused_updates``, the adds into the accumulator
    in the weight gradients' matmuls; ``narrowed``, ``whole_slice``: :func:`chunk_facts`')."""
    split = schedule.split_backward
    max_b = float(plan.precision.compute_bytes) if native else 4.0
    narrow = sequence_gather_bytes(plan, chunk_costs[s][c].tensor_allreduce_bytes, narrowed)
    flops, hbm, (replicated, split_b), tensor = action_work(chunk_costs[s][c], kind, split, plan.remat, max_b, narrow,
                                                            regathers_sequence(plan, narrowed),
                                                            scatters_whole_sequence(plan, narrowed, whole_slice))
    hbm += (acc := accumulated_bytes(plan, chunk_costs[s][c].params, kind == ("W" if split else "B"), fused,
                                     accumulated_elements(shapes)))
    if tail_gather and kind == "B":
        tensor = without_embedding_gathers(tensor)
    gemms = shapes.action(kind, split)
    chain = moe_pieces(plan, n_moe, kind, split, flops, hbm, (replicated, split_b), gemms, kernels)
    ring_work, ring_gemms = Work(flops, hbm, replicated, split_b), gemms
    if chain and plan.mesh.context > 1:
        # Both rings: the ring plays all but the routed and shared experts' work, then the MoE chain plays those
        # alone (its own rest is empty).
        moe_g = expert_gemms(plan, n_moe, kind, split)
        ring_work, ring_gemms = Work(flops - gemm_flops(moe_g), hbm, replicated, split_b), without(gemms, moe_g)
        chain = moe_pieces(plan, n_moe, kind, split, gemm_flops(moe_g), 0.0, (0.0, 0.0), moe_g, len(moe_g))
    overlap = None if chain or gathers_parameters(plan, kind) else tp_overlap(
        plan, chunk_costs[s][c], kind, split, (flops, hbm, replicated, split_b), gemms, tensor,
        chunk_costs[s][c].layers, n_moe)
    spans = () if chain or overlap else in_last_span(action_spans(plan, chunk_costs[s][c], kind, split, n_moe), acc)
    return ActionWork(kind=kind, work=Work(flops, hbm, replicated, split_b), tensor=tensor, gemms=gemms,
                      chain=tuple(chain), ring_work=ring_work, ring_gemms=ring_gemms,
                      sends=tuple(action_sends(schedule, s, kind, c, chunk_costs)), overlap=overlap, spans=spans)


def action_sends(schedule: Schedule, stage: int, kind: str, chunk: int, chunk_costs) -> list[Outgoing]:
    """What a ``kind`` action of ``chunk`` sends (:class:`Outgoing`): an activation
    forward, a gradient backward, when the next (previous) model chunk is on another stage."""
    g = schedule.model_chunk(stage, chunk)
    if kind == "F" and g < schedule.chunks - 1:
        dst, c = schedule.locate(g + 1)
        if dst != stage:
            return [Outgoing(dst, c, float(chunk_costs[stage][chunk].activation_out_bytes))]
    elif kind == "B" and g > 0:
        dst, c = schedule.locate(g - 1)
        if dst != stage:
            return [Outgoing(dst, c, float(chunk_costs[dst][c].activation_out_bytes))]
    return []
