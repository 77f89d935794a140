"""The gathered parameters an fsdp/ZeRO-3 device holds at once: whole blocks over the shard axes.

Under fsdp (and ZeRO-3) a device gathers a block's parameters before the block computes and frees them after,
forward and backward (the backward gathers again: testbed.runner.param_shards.ParamShards), so the bytes live at
once are a few blocks' (the one computing and the ``runtime.fsdp_prefetch`` blocks gathered ahead), never the
whole stage. A block is a layer, the embedding, or the head with the tied token table
(:func:`~testbed.plan.sharding.gathered_blocks` says how many are live). testbed.model.memory reads these at each
instant of a stage's peak.

Under XLA:TPU's rules a weight matrix only matmuls read is gathered in the dtype they read (bf16 for fp32 training
at the default matmul precision: the compiler rounds the shard before the all-gather,
testbed.sim.xla.xla_tpu.gather_element_bytes, benchmarks/xla_tpu_narrowing.py), so its gathered copy holds half
the bytes (``narrow``; which leaves: testbed.model.blocks.narrowed, the backward's gathers).
"""

from __future__ import annotations

import functools
import itertools

from testbed.model import layout
from testbed.model.blocks import narrowed
from testbed.plan.sharding import gathered_blocks
from testbed.plan.spec import ModelSpec, Plan

__all__ = ["gathered_bytes", "head_block_bytes", "matmul_element_bytes"]

#: Bytes per element of a gathered weight matrix XLA:TPU's matmuls of the default precision read (one bf16 pass;
#: testbed.sim.xla.xla_tpu.MATMUL_GATHER_BYTES, the traced tier's rule).
_MATMUL_BYTES = 2


def matmul_element_bytes(plan: Plan, narrow: bool) -> int:
    """Bytes per element of a gathered weight matrix (testbed.model.blocks.narrowed): where ``narrow`` (XLA:TPU's
    rules) and the compute dtype is wider than bf16 at the default matmul precision, bf16's; else the compute
    dtype's."""
    c = plan.precision.compute_bytes
    return _MATMUL_BYTES if narrow and c > _MATMUL_BYTES and plan.runtime.matmul_precision != "highest" else c


def gathered_bytes(plan: Plan, stage: int, narrow: bool = False) -> int:
    """Bytes of gathered (whole over the shard axes) parameters live at once on a device of ``stage`` under
    fsdp/ZeRO-3: the ``1 + runtime.fsdp_prefetch`` largest of the stage's blocks (testbed.plan.sharding's
    :func:`~testbed.plan.sharding.gathered_blocks`; a block is a layer, the embedding, or the head with the tied
    token table), after the tensor and expert splits, in compute precision; 0 when nothing is sharded. Forward
    and backward alike: the backward gathers each block again instead of keeping the forward's as residuals
    (testbed.runner.param_shards.ParamShards), so the whole stage is never gathered at once. ``narrow``: the
    weight matrices at :func:`matmul_element_bytes`."""
    blocks = gathered_blocks(plan)
    return sum(_stage_blocks(plan, stage, _bytes(plan, narrow))[:blocks]) if blocks else 0


def _bytes(plan: Plan, narrow: bool) -> tuple[int, int]:
    """Bytes per element of a gathered parameter and of a gathered weight matrix."""
    return plan.precision.compute_bytes, matmul_element_bytes(plan, narrow)


def _gathered_at(plan: Plan, stage: int, bound: int, narrow: bool = False):
    """A function of ``position``: the gathered bytes live while the ``position``-th block of the stage's backward
    (a layer's) computes (the stage's blocks and their running sums worked out once, read per layer): that
    block and the ``runtime.fsdp_prefetch`` blocks after it in the backward's order (the head, the layers last to
    first, the embedding: the blocks the stage holds), the rule :func:`gathered_bytes` bounds by the largest
    blocks. The head's gathered weights die with the head's backward, the embedding's are gathered only after
    the first layer's. Layer instants only: at the loss the bound stays (XLA:CPU keeps more there than the head
    block alone: ``benchmarks/memory_vs_xla.py``'s wide-fsdp8, whose peak is the loss, measures 65.8 MB against
    64.1 MB with the bound and 59.9 MB with the head alone). With one model chunk per stage; interleaved chunks
    keep ``bound``. ``narrow``: the weight matrices at :func:`matmul_element_bytes`."""
    blocks = gathered_blocks(plan)
    if not blocks or plan.schedule.virtual_stages != 1:
        return lambda position: bound
    p, mesh = plan.mesh.stage, plan.mesh
    embed, head = layout.holds(stage, 0, p, 1)
    each = _bytes(plan, narrow)
    sizes = _block_sizes(plan.model, mesh.tensor, mesh.expert, False, False, 1, mesh.expert_tensor, each)
    tables = [_block_sizes(plan.model, mesh.tensor, mesh.expert, e, h, 0, mesh.expert_tensor, each)
              for e, h in ((False, head), (embed, False))]
    running = (0, *itertools.accumulate([*tables[0], *sizes * plan.stage_layers[stage], *tables[1]]))
    last = len(running) - 1
    return lambda position: running[min(position + blocks, last)] - running[min(position, last)]


def head_block_bytes(plan: Plan, stage: int) -> int:
    """Bytes of the head block gathered whole on a device of ``stage`` (its norm, its matrix or the tied token
    table), in compute precision; 0 when nothing is sharded or the stage does not hold the head. XLA:TPU holds
    this block alone at the loss (testbed.model.memory): the recorded compiles' buffer assignments
    (benchmarks/xla_tpu/) show one gathered head table beside the fp32 logits in gpt2k-fsdp256-full,
    llama2k-fsdp64 and gpt2k-fsdp8-tensor8-sp, and the next block's gather issued after them."""
    if not gathered_blocks(plan) or not layout.holds(stage, 0, plan.mesh.stage, 1)[1]:
        return 0
    mesh = plan.mesh
    c = plan.precision.compute_bytes  # the forward's head matrix, which the loss reads whole-width: not narrowed
    return _block_sizes(plan.model, mesh.tensor, mesh.expert, False, True, 0, mesh.expert_tensor, (c, c))[0]


def _stage_blocks(plan: Plan, stage: int, each: tuple[int, int] = (1, 1)) -> tuple[int, ...]:
    """Elements per device of ``stage``'s blocks whole over the shard axes, largest first (bytes at ``each``:
    :func:`_block_sizes`)."""
    p, v, mesh = plan.mesh.stage, plan.schedule.virtual_stages, plan.mesh
    embed = any(layout.holds(stage, c, p, v)[0] for c in range(v))
    head = any(layout.holds(stage, c, p, v)[1] for c in range(v))
    return _block_sizes(plan.model, mesh.tensor, mesh.expert, embed, head, plan.stage_layers[stage], mesh.expert_tensor,
                        each)


@functools.lru_cache(maxsize=4096)  # pure; read per stage of every plan a search meets
def _block_sizes(spec: ModelSpec, tensor: int, expert: int, embed: bool, head: bool, layers: int,
                 expert_tensor: int | None = None, each: tuple[int, int] = (1, 1)) -> tuple[int, ...]:
    """Elements per device of a stage's blocks whole over the shard axes, largest first (the layers as the
    largest layer kind: :func:`_largest_layer`); with ``each`` (bytes a parameter, bytes a weight matrix
    testbed.model.blocks.narrowed gathers narrower in the backward) their bytes."""
    def held(params, piece: str, expert_tensor: int | None = None) -> int:
        return sum(each[narrowed(q, piece, "B")] * layout.held_elements(((q, 1),), tensor, 1, expert,
                                                                         expert_tensor=expert_tensor) for q in params)
    layer = max((held(layout.layer_params(spec, i), "layer", expert_tensor) for i in _layer_kinds(spec)), default=0)
    sizes = [layer] * layers
    if embed:
        sizes.append(held(layout.embedding_params(spec), "embedding"))
    if head:
        tied = (layout.tied_table(spec),) if spec.tied_embeddings else ()
        sizes.append(held((*layout.head_params(spec), *tied), "head"))
    return tuple(sorted(sizes, reverse=True))


def _layer_kinds(spec: ModelSpec) -> tuple[int, ...]:
    """One layer of each kind (MoE and dense layers differ)."""
    return tuple({layout.is_moe_layer(spec, i): i for i in range(spec.layers)}.values()) if spec.experts else (0,)


def _layer_params_per_device(plan: Plan, ways: int = 1) -> int:
    """The largest layer's parameters on one device (MoE and dense layers differ): tensor and expert split,
    then ``ways``-way sharded by the layout's one rule."""
    return _largest_layer(plan.model, plan.mesh.tensor, plan.mesh.expert, ways, plan.mesh.expert_tensor)


@functools.lru_cache(maxsize=4096)  # pure; read per stage of every plan a search meets
def _largest_layer(spec: ModelSpec, tensor: int, expert: int, ways: int, expert_tensor: int | None = None) -> int:
    kinds = {layout.is_moe_layer(spec, i): i for i in range(spec.layers)} if spec.experts else {False: 0}
    return max(layout.held_elements(((p, 1) for p in layout.layer_params(spec, i)), tensor, ways, expert,
                                    expert_tensor=expert_tensor) for i in kinds.values())
