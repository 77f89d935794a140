"""Tensor-parallel communication overlapped GEMM by GEMM (``runtime.tp_comm_overlap``), as TransformerEngine's
userbuffers run it: the one decision the task graph and the analytic tier both play.

With NeMo/Megatron-Core's ``tp_comm_overlap`` each tensor collective of a layer runs beside the GEMM that
consumes or produces it, never beside the rest of the layer (TransformerEngine
``transformer_engine/pytorch/module/base.py`` ``initialize_ub`` and Megatron-Bridge's userbuffers configurations,
``TransformerLayerTPOverlapCfg``): in the forward the sequence all-gather before QKV and before the MLP's input
projection runs beside that GEMM, the reduce-scatter after the out projection and after the MLP's out projection
beside it; in the backward the all-gather of the output gradient beside the row-parallel GEMMs' input gradient,
and the column-parallel GEMMs' input all-gather and gradient reduce-scatter beside their input- and weight-gradient
GEMMs ("bulk" overlap). A chunked collective leaves one chunk exposed, the rest runs beside the GEMM, exposed
where it outlasts it (:func:`exposed_share`, from NeMo's ``tp_overlap_configs/userbuffers.py``, e.g.
``userbuffers_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192``): a ring-exchange all-gather (``qkv_fprop``, ``fc1_fprop``,
``proj_dgrad``, ``fc2_dgrad``) sends one rank's ``1/t`` share per step, ``t`` the tensor degree, and the first
share must arrive before any GEMM piece starts; a pipelined reduce-scatter (``proj_fprop``, ``fc2_fprop``:
``PipelineOverlapCfg(num_splits=4)``) reduces each of 4 GEMM pieces as the next computes, the last one's after
them; a bulk overlap (``qkv_dgrad``, ``qkv_wgrad``, ``fc1_dgrad``, ``fc1_wgrad``) runs the whole collective beside
the whole GEMM, nothing exposed but what outlasts it. In the backward half the all-gathers are ring exchanges
(row-parallel input gradients), half bulk (the column-parallel weight gradients' inputs), the reduce-scatters bulk.

Priced per block of the layer (testbed.model.gemm.projection_sides): the attention block's projections (QKV and
out) beside half of the layer's collectives, the MLP's beside the other half (Megatron's layer runs the same
collectives around each block). An action plays, after its other work (attention core, elementwise, the ring's
steps), for each block: the first chunks of its collectives (blocking), then its GEMMs beside the remaining
chunks; the MLP block's chunks follow the attention block's on the tensor stream. The collectives that sit beside
no GEMM (the loss's all-reduces, the position table's gather) block after the action, as without overlap.

Not priced: the SMs the overlap kernels take from the GEMMs (userbuffers' ``num_sm``), MoE layers (their
actions keep the whole-action overlap: testbed.sim.graph.program's join).
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.model.costs import ChunkCost
from testbed.model.gemm import Gemm, gemm_flops, projection_sides, scaled, without
from testbed.model.ring import rank_spec
from testbed.plan.spec import Plan

__all__ = ["OverlapBlock", "TpOverlap", "tp_overlap", "overlap_end", "slowed_overlap", "exposed_share",
           "PIPELINE_SPLITS"]

Transfers = tuple[tuple[str, int, float], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class OverlapBlock:
    """One block's GEMMs of an action (their FLOPs and their share of the action's HBM bytes, by FLOPs) and the
    collectives beside them: ``first``, each collective's first chunk (exposed before the GEMMs), ``rest`` the other
    chunks (beside them), as ``(op, count, bytes each)``."""

    name: str
    gemms: tuple[Gemm, ...]
    flops: float
    hbm_bytes: float
    first: Transfers
    rest: Transfers


@dataclass(frozen=True, slots=True, kw_only=True)
class TpOverlap:
    """An action under ``runtime.tp_comm_overlap``: its ``blocks`` (attention, MLP); the rest of its work
    (``work``: FLOPs, HBM bytes, replicated and split activation bytes, and ``gemms``) run before them; and the
    collectives beside no GEMM (``after``, blocking after the blocks)."""

    blocks: tuple[OverlapBlock, ...]
    work: tuple[float, float, float, float]
    gemms: tuple[Gemm, ...]
    after: Transfers


#: Pieces of a pipelined reduce-scatter (userbuffers' ``PipelineOverlapCfg(num_splits=4)`` in every NeMo config).
PIPELINE_SPLITS = 4


def exposed_share(op: str, kind: str, tensor: int) -> float:
    """The share of a ``kind`` action's ``op`` over ``tensor`` ranks that cannot run beside its GEMM (module
    docstring): a ring exchange's first ``1/t``, a pipelined reduce-scatter's last ``1/4``, nothing of a bulk one."""
    if kind == "F":
        return 1 / PIPELINE_SPLITS if op == "reduce_scatter" else 1 / tensor
    if op == "all_gather":
        return 1 / (2 * tensor)  # half ring exchanges (row-parallel dgrad), half bulk
    return 0.0 if op == "reduce_scatter" else 1 / tensor


def _block_gemms(block: tuple[Gemm, ...], kind: str, split: bool) -> tuple[Gemm, ...]:
    """One layer's GEMMs of a block in a ``kind`` action: the forward products, or their input gradients (and the
    weight gradients unless the backward is split)."""
    if kind == "F":
        return block
    return tuple(g.input_grad() for g in block) + (() if split else tuple(g.weight_grad() for g in block))


def tp_overlap(plan: Plan, cost: ChunkCost, kind: str, split: bool, work: tuple[float, float, float, float],
               gemms: tuple[Gemm, ...], transfers: Transfers, layers: int, moe: int) -> TpOverlap | None:
    """The per-GEMM overlap of one F or B action of a chunk of ``layers`` layers (``moe`` of them MoE) whose work,
    GEMMs and tensor collectives (testbed.sim.step.action_work.tensor_transfers) are given; None where it does not apply
    (no ``tp_comm_overlap``, no tensor parallelism, W actions, chunks with MoE layers or no layers)."""
    if not plan.runtime.tp_comm_overlap or plan.mesh.tensor <= 1 or kind == "W" or moe or layers < 1:
        return None
    t = plan.mesh.tensor
    spec = rank_spec(plan)
    sides = projection_sides(plan, spec, plan.microbatch_size * spec.seq_len, t)
    # ChunkCost.tensor_collectives' entries come first (their gathers perhaps narrowed); the loss's and the
    # position table's after them sit beside no GEMM
    extra = 2 if kind == "F" and cost.loss_allreduce_bytes else int(kind == "B" and bool(cost.position_gather_bytes))
    paired, after = list(transfers[:len(transfers) - extra]), list(transfers[len(transfers) - extra:])
    flops, hbm, replicated, split_b = work
    blocks = []
    for i, (name, side) in enumerate(zip(("attention", "mlp"), sides)):
        own = [(op, count // 2 if i == 0 else count - count // 2, b) for op, count, b in paired]
        own = [x for x in own if x[1] > 0]
        g = scaled(_block_gemms(tuple(side), kind, split), layers)
        # The roofline's HBM bytes go with the FLOPs (a GEMM-bound action stays GEMM-bound piece by piece).
        blocks.append(OverlapBlock(name=name, gemms=g, flops=gemm_flops(g), hbm_bytes=hbm * gemm_flops(g) / flops,
                                   first=tuple((op, n, b * exposed_share(op, kind, t)) for op, n, b in own),
                                   rest=tuple((op, n, b * (1 - exposed_share(op, kind, t))) for op, n, b in own)))
    side_gemms = tuple(g for blk in blocks for g in blk.gemms)
    return TpOverlap(blocks=tuple(blocks), work=(flops - gemm_flops(side_gemms),
                                                 hbm - sum(b.hbm_bytes for b in blocks), replicated, split_b),
                     gemms=without(gemms, side_gemms), after=tuple(after))


def overlap_end(blocks: tuple[tuple[float, float, float], ...]) -> float:
    """Seconds from the end of an action's other work to the end of its blocks, each block ``(first chunks,
    GEMMs, other chunks)`` seconds: a block's GEMMs start after its first chunks, which follow the previous
    block's chunks on the tensor stream, and after the previous block's GEMMs (the task graph's order)."""
    compute = tensor = 0.0
    for first, gemm, rest in blocks:
        ready = tensor + first
        compute = max(compute, ready) + gemm
        tensor = ready + rest
    return max(compute, tensor)


def slowed_overlap(blocks: tuple[tuple[float, float, float], ...], slowdown: float) -> tuple[float, float]:
    """:func:`overlap_end` with each GEMM ``1 + slowdown`` times slower while the tensor stream's chunks are in flight
    beside it (``device.comm_slowdown``, as the task graph's engine slows a compute task beside its device's
    communication): (the blocks' end, the GEMMs' seconds). The tensor stream waits for no GEMM, so its chunks run
    back to back from the start to its end."""
    if not slowdown:
        return overlap_end(blocks), sum(gemm for _, gemm, _ in blocks)
    end = sum(first + rest for first, _, rest in blocks)  # the tensor stream's end
    compute = tensor = busy = 0.0
    for first, gemm, rest in blocks:
        ready = tensor + first
        start = max(compute, ready)
        slowed = gemm * (1.0 + slowdown)
        compute = start + slowed if start + slowed <= end else max(start, end) + gemm - max(0.0, end - start) / (
            1.0 + slowdown)
        busy += compute - start
        tensor = ready + rest
    return max(compute, tensor), busy

