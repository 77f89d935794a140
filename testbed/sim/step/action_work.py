"""One action's work, read from its chunk's cost: FLOPs, HBM bytes, activation traffic and tensor collectives.

The one reading of :class:`testbed.model.costs.ChunkCost` per action kind (F, B, W) that the task graph
(testbed.sim.step.facts and testbed.sim.graph.program), the analytic tier (testbed.explore.analytic) and the search's floor
(testbed.explore.floor) all price, so that no tier counts an action's work or its tensor collectives its own way.
"""

from __future__ import annotations

from testbed.model.activations import LOSS_BYTES
from testbed.model.costs import ChunkCost
from testbed.plan.spec import Remat

__all__ = ["action_work", "tensor_transfers"]


def action_work(cost: ChunkCost, kind: str, split: bool, remat: Remat, max_bytes: float = 4.0, matmul_gather: int = 0,
                regather: bool = False, whole: bool = False
                ) -> tuple[float, float, tuple[float, float], tuple[tuple[str, int, int], ...]]:
    """(FLOPs, HBM bytes, (replicated, split) activation bytes, tensor collectives) of one action, one microbatch.

    The backward writes about twice the forward's activation traffic (the
    gradients of each activation and of its inputs), B and W one forward's
    worth each when split, plus what remat writes again. Full remat reruns
    each layer's forward up to the MLP down projection in the backward, so
    the attention output's tensor all-reduce runs again (one per layer);
    selective remat redoes no all-reduce. The tensor collectives are
    ``(op, count, bytes each)`` from :func:`tensor_transfers`
    (all-reduces, or with sequence parallelism all-gathers and reduce-scatters; the loss's all-reduces;
    ``matmul_gather``, ``regather``, ``whole``: its arguments).
    """
    forward = cost.forward_traffic
    if kind == "F":
        return float(cost.forward_flops), float(cost.forward_bytes), tuple(map(float, forward)), \
            tensor_transfers(cost, "F", remat, max_bytes, matmul_gather, whole=whole)
    if kind == "B":
        flops = cost.backward_input_flops + cost.recompute_flops + (0 if split else cost.backward_weight_flops)
        hbm = cost.backward_bytes / 2 if split else cost.backward_bytes
        times = 1 if split else 2
        traffic = tuple(float(times * f + r) for f, r in zip(forward, cost.recompute_traffic))
        return float(flops), float(hbm), traffic, tensor_transfers(cost, "B", remat, matmul_gather=matmul_gather,
                                                                   regather=regather, whole=whole)
    return float(cost.backward_weight_flops), cost.backward_bytes / 2, tuple(map(float, forward)), ()


def tensor_transfers(cost: ChunkCost, kind: str, remat: Remat | str, max_bytes: float = 4.0, matmul_gather: int = 0,
                     regather: bool = False, whole: bool = False) -> tuple[tuple[str, int, int], ...]:
    """``(op, count, bytes each)`` of the tensor collectives of one action, the one decision the task graph
    and the analytic tier read (through :class:`ActionWork`): :meth:`ChunkCost.tensor_collectives`
    (``tensor_allreduce_bytes`` each); the head's forward's vocab-parallel loss, three all-reduces of one
    fp32 value per token (``loss_allreduce_bytes``: the logits' maximum and the target's logit merged, as
    XLA's combiner does, then the sum of exponentials); with sequence parallelism and a learned position
    table, which the runner adds to each rank's sequence shard, the embedding's backward's all-gather of
    the table's gradient (``position_gather_bytes``). ``max_bytes``: bytes of the maximum per token (4: XLA:CPU
    reduces it in fp32; the logits' dtype where the compiler reduces bf16 natively, testbed.sim.step.facts).
    ``matmul_gather``: bytes of each sequence all-gather only matmuls read, every one but the embedding backward's
    (its cotangent feeds the table's scatter-add), where the compiler narrows it (testbed.sim.xla.xla_tpu.
    sequence_gather_bytes; 0: ``tensor_allreduce_bytes``); the embedding's is listed first. ``regather``: the
    backward gathers each of the forward's sequence all-gathers again, of its bytes, after the others but the position
    table's gradient gather, which stays last (testbed.sim.xla.xla_tpu.regathers_sequence: XLA:TPU keeps a
    checkpoint's recomputed gathers). ``whole``: the sequence reduce-scatters are all-reduces of the whole activation,
    of its bytes (testbed.sim.xla.xla_tpu.scatters_whole_sequence: XLA:TPU at one sequence a device)."""
    nbytes = cost.tensor_allreduce_bytes
    out: list[tuple[str, int, int]] = []
    for op, count in cost.tensor_collectives(kind, remat):
        if whole and op == "reduce_scatter":
            op = "all_reduce"
        if op != "all_gather" or not matmul_gather or matmul_gather == nbytes:
            out.append((op, count, nbytes))
            continue
        own = min(count, int(kind == "B" and cost.has_embedding))  # the lookup's cotangent: a scatter-add reads it
        out += [(op, n, b) for n, b in ((own, nbytes), (count - own, matmul_gather)) if n]
    if kind == "F" and cost.loss_allreduce_bytes:
        merged = cost.loss_allreduce_bytes + int(cost.loss_allreduce_bytes * max_bytes / LOSS_BYTES)
        out += [("all_reduce", 1, merged), ("all_reduce", 1, cost.loss_allreduce_bytes)]
    if kind == "B" and regather:
        again = sum(n for op, n in cost.tensor_collectives("F", remat) if op == "all_gather")
        out += [("all_gather", again, matmul_gather or nbytes)] if again else []
    if kind == "B" and cost.position_gather_bytes:
        out.append(("all_gather", 1, cost.position_gather_bytes))
    return tuple(out)
