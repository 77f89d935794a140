"""MoE layers in the task graph: an action's work cut into per-layer pieces around the all-to-alls.

Under expert parallelism (``mesh.expert`` > 1) every MoE layer of a pipeline action moves its tokens
twice over the expert group: the *dispatch* all-to-all before the routed experts and the *combine*
all-to-all after them (the backward runs the same two in reverse, on the gradients; full remat's
recomputed forward runs both again). testbed.sim.graph.program therefore plays an F or B action of a chunk
holding ``n`` MoE layers as ``n`` links of a chain, each::

    rest of the layer (compute) -> dispatch (all_to_all, stream "expert")  || shared experts, first half
                                -> routed experts (compute, after the dispatch)
                                -> combine (all_to_all, stream "expert")    || shared experts, second half

so the shared experts' compute overlaps the all-to-alls (it needs no dispatched token) and the next
layer waits for the combine. Under ``runtime.moe_sequence_dispatch`` (testbed.model.moe.sequence_dispatch:
Megatron-Core's dispatcher with sequence parallelism) each all-to-all carries the rank's own sequence shard,
``1 / tensor`` of the buffer, and the experts' tensor ranks all-gather what arrived before the routed experts
and reduce-scatter their outputs before the combine (both on the same stream, over the tensor groups). The routed and shared experts' GEMMs are exactly theirs
(testbed.model.gemm.moe_gemms, with the action's gradients and recompute); the rest of the action
(attention, router, norms, dense layers, embedding and head) is split evenly into ``n + 1`` parts: one
before each link and one after the last combine (under context parallelism the ring takes all of it,
testbed.sim.graph.program: the chain then runs the experts' work alone). The
all-to-alls are timed by the collective timing of ``all_to_all`` over the placement's expert groups
(whose links the placement decides), ``testbed.model.moe.dispatch_bytes`` each. W actions (split
backward) move no tokens: they stay one task.
"""

from __future__ import annotations

from dataclasses import replace

from testbed.model import moe
from testbed.model.gemm import Gemm, fp8_scaled, gemm_flops, grouped_kernel, moe_gemms, scaled, without
from testbed.plan.spec import Plan, Remat
from testbed.sim.step.pieces import ActionTask

__all__ = ["A2A_STREAM", "Piece", "expert_gemms", "moe_pieces", "exposed_stream_s"]

#: The stream the dispatch and combine all-to-alls run on (beside compute).
A2A_STREAM = "expert"


#: One task of an action's MoE chain (a transfer on the ``expert`` stream is an all-to-all).
Piece = ActionTask


def _action_gemms(forward: list[Gemm], kind: str, split: bool, remat: Remat) -> list[Gemm]:
    """The GEMMs of an F or B action over one MoE block's ``forward`` list (testbed.model.gemm's conventions:
    B holds the input gradients, the weight gradients unless ``split``, and full remat's recompute of all but
    the out projection, the last of ``forward``)."""
    if kind == "F":
        return list(forward)
    out = [g.input_grad() for g in forward] + ([] if split else [g.weight_grad() for g in forward])
    return out + (list(forward[:-1]) if remat is Remat.FULL else [])


def _layer_gemms(plan: Plan, kind: str, split: bool) -> tuple[tuple[Gemm, ...], tuple[Gemm, ...]]:
    """(routed experts', shared experts') GEMMs of one MoE layer in an F or B action on one rank."""
    spec, mesh = plan.model, plan.mesh
    ins, outs = moe_gemms(spec, moe.local_tokens(plan), moe.expert_tokens(plan), mesh.tensor, mesh.expert,
                          mesh.expert_tensor, grouped_kernel(plan))
    inner = spec.mlp_matrices - 1
    routed = _action_gemms([*ins[1:1 + inner], outs[0]], kind, split, plan.remat)
    shared = _action_gemms([*ins[1 + inner:], *outs[1:]], kind, split, plan.remat) if spec.shared_experts else []
    return fp8_scaled(plan, tuple(routed)), fp8_scaled(plan, tuple(shared))  # tagged as the action's (chunk_gemms)


def expert_gemms(plan: Plan, moe_layers: int, kind: str, split: bool) -> tuple[Gemm, ...]:
    """The routed and shared experts' GEMMs of an F or B action holding ``moe_layers`` MoE layers (what its
    chain runs beside the all-to-alls; the rest of the action is everything else)."""
    routed, shared = _layer_gemms(plan, kind, split)
    return scaled(routed + shared, moe_layers)


def moe_pieces(plan: Plan, moe_layers: int, kind: str, split: bool, flops: float, hbm: float,
               traffic: tuple[float, float], gemms: tuple[Gemm, ...], kernels: int) -> list[Piece]:
    """The chain of an F or B action holding ``moe_layers`` MoE layers (module docstring); [] when the action
    runs no all-to-all (no MoE layer, expert degree 1, or a W action). ``flops``, ``hbm``, ``traffic``,
    ``gemms`` and ``kernels`` are the whole action's (testbed.sim.step.facts' ``action_work``)."""
    if not moe_layers or plan.mesh.expert <= 1 or kind == "W":
        return []
    routed, shared = _layer_gemms(plan, kind, split)
    n = moe_layers
    rest = without(gemms, scaled(routed + shared, n))
    rest_flops = max(0.0, flops - n * (gemm_flops(routed) + gemm_flops(shared)))
    full = plan.remat is Remat.FULL and kind == "B"
    shard = moe.sequence_dispatch(plan)  # each tensor rank all-to-alls its own sequence shard, then a tensor gather
    a2a = dict(nbytes=moe.dispatch_bytes(plan) / (plan.mesh.tensor if shard else 1),
               count=2 if full else 1)  # full remat redoes the forward's too
    tensor = dict(nbytes=moe.dispatch_bytes(plan), count=a2a["count"], axis="tensor")
    per = max(1, kernels // (n + 1))
    share = dict(hbm_bytes=hbm / (n + 1), replicated_bytes=traffic[0] / (n + 1), split_bytes=traffic[1] / (n + 1),
                 flops=rest_flops / (n + 1), kernels=per, gemms=tuple(replace(g, count=g.count / (n + 1)) for g in rest))
    half = tuple(replace(g, count=g.count / 2) for g in shared)
    pieces: list[Piece] = [Piece(name="/moe0 pre", stream="compute", **share)]
    for layer in range(n):
        tag, pre = f"/moe{layer}", len(pieces) - 1
        pieces.append(Piece(name=f"{tag} dispatch", stream=A2A_STREAM, after=(pre,), **a2a))
        dispatch = len(pieces) - 1
        if half:
            pieces.append(Piece(name=f"{tag} shared", stream="compute", after=(pre,), flops=gemm_flops(half),
                                gemms=half))
        if shard:  # the experts' tensor ranks gather the rows each received
            pieces.append(Piece(name=f"{tag} gather", stream=A2A_STREAM, after=(dispatch,), op="all_gather", **tensor))
            dispatch = len(pieces) - 1
        pieces.append(Piece(name=f"{tag} experts", stream="compute", after=(dispatch,),
                            flops=gemm_flops(routed), gemms=routed, kernels=len(routed)))
        experts = len(pieces) - 1
        if shard:  # and reduce-scatter the experts' partial outputs before the combine
            pieces.append(Piece(name=f"{tag} scatter", stream=A2A_STREAM, after=(experts,), op="reduce_scatter",
                                **tensor))
        pieces.append(Piece(name=f"{tag} combine", stream=A2A_STREAM, after=(len(pieces) - 1,), **a2a))
        combine = len(pieces) - 1
        if half:
            pieces.append(Piece(name=f"{tag} shared", stream="compute", after=(experts,), flops=gemm_flops(half),
                                gemms=half))
        # The next part of the action needs the layer's output: the combine (and, FIFO, the shared experts).
        name = f"/moe{layer + 1} pre" if layer + 1 < n else "/moe post"
        pieces.append(Piece(name=name, stream="compute", after=(combine,), layer_end=True, **share))
    return pieces


def exposed_stream_s(timeline, stream: str = A2A_STREAM) -> float:
    """Seconds the busiest representative spends in ``stream``'s spans while its compute stream is idle:
    the exposed all-to-all time of an expert-parallel plan (0 without such spans)."""
    device = timeline.busiest()
    mine = [(s.start, s.end) for s in timeline.spans(device) if s.stream == stream and s.end > s.start]
    if not mine:
        return 0.0
    compute = sorted((s.start, s.end) for s in timeline.spans(device) if s.stream == "compute" and s.end > s.start)
    return sum(_uncovered(a, b, compute) for a, b in _union(sorted(mine)))


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _uncovered(a: float, b: float, covers: list[tuple[float, float]]) -> float:
    """Length of ``[a, b]`` outside the (sorted) ``covers``."""
    left, at = 0.0, a
    for c, d in covers:
        if d <= at:
            continue
        if c >= b:
            break
        left += max(0.0, c - at)
        at = max(at, d)
        if at >= b:
            return left
    return left + max(0.0, b - at)
