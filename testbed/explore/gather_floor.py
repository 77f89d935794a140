"""The search's gather floor: a lower bound of a step's seconds from its fsdp/ZeRO-3 parameter gathers alone.

The analytic tier plays every forward and backward's gathers of a chunk's sharded parameters block by block on the
stage's one gather stream (testbed.explore.play ``_gather``: ``_blocks`` and testbed.explore.span_times.play_blocks
start each block's gather once the one before it has ended, ``gather_free`` carrying that across actions; a
shared host's wait only adds), and the stage's last block computes after its gather, so a stage's step is at least
the sum of its actions' gather seconds: ``microbatches`` times each chunk's forward and backward gathers
(testbed.plan.sharding.gathers_parameters), each block's collectives priced as the tier prices them
(``StepPrices._block_gather_seconds``: every all-gather of testbed.model.blocks.block_gathers at its merged size, by
``StageCollectives.time``). The task graph runs the same collectives one after another on its ``gather`` stream
(testbed.sim.graph.program), each timed by testbed.collectives.timing and slowed only by sharing links
(tests/test_gather_floor.py checks both tiers on sampled plans). A chunk's blocks follow whether the embedding
and the head are blocks of their own (testbed.sim.step.facts: ``runtime.fsdp_edge_blocks`` where no action overlaps or
chains); where they may be, the cheaper of both splits is taken. The first, middle and last stages are summed (the
slowest of them bounds the slowest of all), chunks alike in their layers' kinds, embedding and head priced once.
An MoE chain's actions (expert parallelism: testbed.sim.step.moe) gather their chunk whole, one block of all its
collectives, as both tiers play them. Only plans testbed.explore.floor bounds (no context parallelism, no shared
host) are bounded here.
"""

from __future__ import annotations

from collections import Counter

from testbed.collectives.routed import memoized
from testbed.explore.stage_collectives import StageCollectives
from testbed.model.blocks import block_gathers, block_ops, own_blocks
from testbed.model.gather_lowering import NO_LOWERING, Lowering
from testbed.model.leaves import combine_limit, moved_elements, parameter_collectives, regathered
from testbed.model.layout import chunk_layers
from testbed.model.memory import state_bytes_per_param
from testbed.model.moe import moe_layers
from testbed.plan.placement import place
from testbed.plan.sharding import gathers_parameters, state_sharding
from testbed.plan.spec import Plan
from testbed.sim.step.memo import cached_chunk_cost
from testbed.sim.xla.xla_tpu import gather_lowering, matmul_gather_bytes, narrows_gathers
from testbed.topology import Topology

__all__ = ["gather_floor", "gather_seconds_per_microbatch", "gather_key", "middle_gathers"]


def gather_floor(plan: Plan, topology: Topology) -> float:
    """A lower bound of both tiers' step seconds from ``plan``'s parameter gathers (module docstring); 0 where
    nothing shards the parameters or it is not bounded (context parallelism, a shared host)."""
    return plan.batch.microbatches * gather_seconds_per_microbatch(plan, topology)


def gather_key(plan: Plan) -> tuple:
    """What :func:`gather_seconds_per_microbatch` reads of ``plan`` (not its microbatches, their size or remat):
    plans alike in it share one bound."""
    return (plan.model, plan.mesh, plan.zero, plan.runtime, plan.precision, plan.schedule.virtual_stages,
            plan.stage_layers)


def gather_seconds_per_microbatch(plan: Plan, topology: Topology) -> float:
    """The gather seconds of one microbatch (every chunk's forward and backward gathers, the analytic tier's
    prices) on the slowest of the first, middle and last stages, memoized per topology on :func:`gather_key`."""
    return memoized(topology, "gather_floor", gather_key(plan), lambda: _per_microbatch(plan, topology))


def _gathered(plan: Plan, topology: Topology) -> bool:
    """Whether the gathers are bounded here: parameters sharded two ways or more and gathered, no context
    parallelism, no shared host."""
    return (gathers_parameters(plan, "F") and state_sharding(plan).ways(plan, "params") >= 2
            and plan.mesh.context == 1 and topology.calibration.host is None)


def middle_gathers(plan: Plan, topology: Topology) -> dict[tuple[int, int, str], float]:
    """``(stage, chunk, kind) -> seconds`` of each gathering action's gathers (as the analytic tier prices its
    ``ActionPrice.gather``: its blocks' summed) of the chunks of the first, middle and last stages that hold neither
    the embedding nor the head (their blocks the layers', one split), dense chunks only (no MoE chain); empty where
    :func:`gather_floor` bounds nothing. Memoized per topology on :func:`gather_key`."""
    return memoized(topology, "middle_gathers", gather_key(plan), lambda: _middle_gathers(plan, topology))


def _middle_gathers(plan: Plan, topology: Topology) -> dict[tuple[int, int, str], float]:
    """:func:`middle_gathers`, not memoized."""
    if not _gathered(plan, topology) or plan.model.experts:
        return {}
    coll, axes, combine, param_b, matmul_b, lowering = _pricing(plan, topology)
    p, v, priced, sizes, out = plan.mesh.stage, plan.schedule.virtual_stages, {}, {}, {}
    kinds = [kind for kind in ("F", "B") if gathers_parameters(plan, kind)]
    for s in sorted({0, p // 2, p - 1}):
        for c in range(v):
            cost = cached_chunk_cost(plan, s, c)
            if cost.has_embedding or cost.has_head:
                continue
            if cost.layers not in sizes:  # a dense chunk's gathers follow its layer count (as _per_microbatch's)
                sizes[cost.layers] = _chunk_sizes(plan, s, c, combine, param_b, cost, False, matmul_b, lowering)
            for split in sizes[cost.layers]:
                for kind, blocks in zip(kinds, split):
                    out[(s, c, kind)] = _block_seconds(coll, axes, s, blocks, priced)
    return out


def _pricing(plan: Plan, topology: Topology) -> tuple:
    """(the stage collectives of ``plan``'s placement, the parameters' axes, the combiner's bound, bytes per
    parameter, per weight matrix's gathered element, the gathers' lowering), as both tiers read them."""
    sharding = state_sharding(plan)
    param_b = state_bytes_per_param(plan)[0]
    matmul_b = matmul_gather_bytes(plan, param_b) if narrows_gathers(topology) else 0.0
    lowering = gather_lowering(topology, plan, sharding.ways(plan, "params"))
    combine = combine_limit(topology.calibration.collectives.combine_bytes, plan.runtime.gather_combine_bytes)
    coll = StageCollectives(topology, place(plan, topology).device_ids)
    return coll, sharding.params, combine, param_b, matmul_b, lowering


def _per_microbatch(plan: Plan, topology: Topology) -> float:
    """:func:`gather_seconds_per_microbatch`, not memoized."""
    if not _gathered(plan, topology):
        return 0.0
    coll, axes, combine, param_b, matmul_b, lowering = _pricing(plan, topology)
    priced, sizes, p, v = {}, {}, plan.mesh.stage, plan.schedule.virtual_stages
    spans = chunk_layers(plan.model, p, v, plan.stage_layers) if plan.model.experts else None
    worst = 0.0
    for s in sorted({0, p // 2, p - 1}):  # a few stages (the ends, which hold the embedding and head): a bound
        total = 0.0
        for c in range(v):
            cost = cached_chunk_cost(plan, s, c)
            # a chunk's gathers follow its layers' kinds (a dense model's: their count), embedding and head alone
            kinds = cost.layers if spans is None else tuple(map(plan.model.is_moe_layer, spans[s][c]))
            alike = (kinds, cost.has_embedding, cost.has_head)
            if alike not in sizes:
                chained = spans is not None and plan.mesh.expert > 1 and moe_layers(plan.model, spans[s][c]) > 0
                sizes[alike] = _chunk_sizes(plan, s, c, combine, param_b, cost, chained, matmul_b, lowering)
            total += min((sum(_block_seconds(coll, axes, s, kind, priced) for kind in split) for split in sizes[alike]),
                         default=0.0)
        worst = max(worst, total)
    return worst


def _chunk_sizes(plan: Plan, s: int, c: int, combine: float, param_b: float, cost, chained: bool,
                 matmul_b: float = 0.0, lowering: Lowering = NO_LOWERING) -> list[tuple]:
    """Per way the chunk's blocks may be split, each gathering action's block gathers' bytes
    (testbed.model.blocks.block_gathers; ``chained``: its F and B actions are MoE chains, testbed.sim.step.moe, which
    gather the chunk whole; ``lowering``: the gathers lowered as all-reduces, each block's as (size, op) pairs);
    empty when the chunk gathers nothing."""
    leaves = parameter_collectives(plan, s, c, combine, param_b)
    if not leaves:
        return []
    moved = moved_elements(plan, s, c, "params")
    if chained:  # an MoE chain's actions gather whole: one block of the chunk's collectives, as the tiers price it
        whole = (tuple((moved * param_b / leaves, "all_gather") for _ in range(leaves)),)
        return [tuple(whole for kind in ("F", "B") if gathers_parameters(plan, kind))]
    elements = {"F": moved, "B": regathered(plan, s, c, moved, leaves, combine, param_b)[0]}
    splits = {max(1, cost.layers)}
    if plan.runtime.fsdp_edge_blocks and (cost.has_embedding or cost.has_head) and cost.layers >= 1:
        splits.add(own_blocks(cost.layers, cost.has_embedding, cost.has_head))
    args = {"matmul_bytes": matmul_b, "lowering": lowering}
    return [tuple(_paired(block_gathers(plan, s, c, kind, blocks, n, combine, param_b, **args),
                          block_ops(plan, s, c, kind, blocks, n, combine, param_b, **args) if lowering.active
                          else None)
                  for kind, n in elements.items() if gathers_parameters(plan, kind)) for blocks in splits]


def _paired(sizes: tuple[tuple[float, ...], ...], ops: tuple[tuple[str, ...], ...] | None) -> tuple:
    """Per block, each collective as (bytes, op) (``ops`` None: every one an all-gather)."""
    if ops is None:
        return tuple(tuple((n, "all_gather") for n in block) for block in sizes)
    return tuple(tuple(zip(block, block_ops)) for block, block_ops in zip(sizes, ops))


def _block_seconds(coll: StageCollectives, axes: tuple, s: int, sizes: tuple[tuple[float, ...], ...],
                   priced: dict) -> float:
    """Seconds of an action's block gathers ``sizes`` (per block, each collective's (bytes, op)), as
    ``StepPrices._block_gather_seconds`` prices them (each block memoized in ``priced``)."""
    total = 0.0
    for block in sizes:
        key = (s, block)
        if key not in priced:
            priced[key] = sum(count * coll.time(op, axes, s, n) for (n, op), count in Counter(block).items())
        total += priced[key]
    return total
