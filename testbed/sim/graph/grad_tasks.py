"""A step's gradient reduction tasks (the task graph's ``grad`` stream), one rule per bucket.

Parameter and gradient sharding (same conventions as testbed.model.memory):
parameters are sharded over ``P`` = fsdp (+ data when zero = 3) and
all-gathered block by block in every forward and backward action
(:func:`~testbed.plan.sharding.gathers_parameters`): each block's compute waits
for its gather, which waits for block ``i - 1 - runtime.fsdp_prefetch`` to finish
(across actions too), so gathers overlap the blocks before; optimizer state over
``O`` = fsdp (+ data when zero >= 1). Gradients are reduced in buckets: the
last backward (or W) of each chunk is split into up to :data:`BUCKETS`
pieces; when gradients accumulate sharded (fsdp, ZeRO >= 2: the runner
reduce-scatters them inside each backward) each piece's gradients start
reducing at once, overlapping the rest of the backward pass. When no axis
shards them (ZeRO 0/1 data parallelism) every replica accumulates its own
and the runner sums them once, in the stage's update program
(testbed.runner.replicas.sum_replicas): the buckets then reduce one after another
once the stage's last backward is done, not overlapping it (Megatron-LM's
own DDP, ``--DDP-impl local``, does the same). Each kind of parameter is summed over its
axes (testbed.plan.sharding.reduction_axes: dense ones over the batch axes
data, fsdp, expert and context; routed experts' weights over those but
expert): a reduce-scatter over those of them ``O`` spans, then an all-reduce
of the shard over the rest (an all-reduce over the replicas when nothing is
sharded, one reduce-scatter when ``O`` spans them all, HSDP otherwise). Gradients sharded over an axis (fsdp; data when
zero >= 2) accumulate sharded, so each earlier microbatch's last backward
action also reduce-scatters the chunk's gradients over those axes (as the
runner and DeepSpeed do); over the axes they are replicated on, gradients
are reduced once per step. After the optimizer, parameters sharded in ``O``
but not in ``P`` are all-gathered over the data axis.

How many collectives a gather and a gradient reduce-scatter of a chunk's sharded
parameters is: the runner (testbed.runner.param_shards.ParamShards) gathers every sharded
leaf on its own and reduce-scatters its gradient on its own, which XLA:CPU runs
as that many collectives and XLA:GPU combines; testbed.plan.sharding's
:func:`~testbed.model.leaves.parameter_collectives` counts them under the
topology's ``calibration.collectives.combine_bytes``, and the task carries the
count (``count`` back-to-back collectives of an equal share of the bytes; a
bucket's reduce-scatter its share of them).
"""

from __future__ import annotations

from testbed.plan.spec import Axis, Plan
from testbed.sim.graph.tasks import Builder, TaskKind, axis_groups_cached, rep_group

__all__ = ["reduce_tasks", "tied_task", "shard_sum_task"]


def allreduce_count(reductions: tuple, leaves: float, size: float, nbytes: float, experts: float = 0.0,
                    expert: bool = False) -> int:
    """All-reduces one parameter kind's share (``size`` of the bucket's ``nbytes``) of a bucket is summed in: where
    nothing shards the gradients, the bucket's ``leaves`` are XLA's merged all-reduces of its dense gradients
    (ChunkFacts.bucket, testbed.model.leaves.gradient_allreduces: the routed experts' left out, as their sums run
    over other axes), a share of them per dense kind by its part of the dense bytes (``nbytes`` less the routed
    experts' ``experts``), the routed experts' (``expert``) by their part of the bucket; else one (a shard's sum
    after the reduce-scatter). The one rule the task graph and the analytic tier count by."""
    if not leaves or any(r.sharded for r in reductions):
        return 1
    return max(1, round(leaves * size / (nbytes if expert else max(nbytes - experts, size))))


def reduce_tasks(b: Builder, reductions: tuple, groups: dict, plan: Plan, s: int, rep: int, after: int, nbytes: float,
                 special: tuple[float, float], label: str, leaves: int, tail: tuple[float, float] = (0.0, 0.0),
                 select: bool | None = None, stream: str = "grad", loss: float = 0.0, op: str = "") -> list[int]:
    """Gradient reduction tasks of one bucket of ``nbytes`` of stage ``s`` (representative ``rep``), after task
    ``after``; returns the last task of each parameter kind. ``special``: those of the bytes that are routed
    experts' weights and sequence-replicated parameters' (ChunkFacts.special); ``leaves``: the collectives the
    bucket's reduce-scatter is when the parameters are sharded (testbed.sim.step.facts.bucket_share; 0: one);
    ``groups``: the graph's memo of groups by axes; ``tail``: the token table's bytes summed after the rest of the
    dense ones and the tensor all-gather between (ChunkFacts.tail); ``select``: only the sequence-replicated
    parameters' reduction (True), all but it (False), or all (None), on ``stream``; ``loss``: the loss's bytes the
    dense parameters' all-reduce carries besides (testbed.plan.sharding.loss_merged); ``op``: the collective the
    dense parameters' reduce-scatter compiles to where another (XLA:TPU's rank-1 gradients' all-reduce,
    testbed.model.block_scatters.scatter_ops; empty: Reduction.scatter_op).

    Each kind of parameter is summed over its axes (testbed.plan.sharding.reduction_axes: dense ones over
    data, fsdp, expert and context, routed experts' over those but expert): a reduce-scatter over those of
    them the optimizer state is sharded on (fsdp; data with ZeRO >= 1), then an all-reduce of the shard over
    the rest (HSDP: data without ZeRO; expert, context), but where the compiler merges the shards' all-reduces
    across the backward (Reduction.rest_merged: :func:`shard_sum_task`, after the stage's last bucket).
    """
    out = []
    for r in reductions:
        size = r.size(nbytes, special)
        if size <= 0 or (select is not None and r.sequence != select):
            continue
        kind, last = " experts" if r.expert else " sequence" if r.sequence else "", after
        if r.sharded:  # a reduce-scatter, or the all-reduce XLA:TPU makes of it (Reduction.scatter_op)
            g = axis_groups_cached(groups, plan, list(r.sharded), s)
            # Of the bucket's collectives, the parameter kinds' shares (a piece of each as its bytes are).
            n = max(1, round(leaves * size / nbytes)) if leaves else 1
            scatter = op if op and not (r.expert or r.sequence) else r.scatter_op
            # The loss rides in a whole slice's all-reduce of the dense gradients, or of the rank-1 ones
            # (testbed.sim.xla.xla_tpu.merges_loss).
            merged = loss if scatter == "all_reduce" and not (r.expert or r.sequence or r.rest) else 0.0
            last = b.add(name=f"{scatter} {label}{kind}", device=rep, stream=stream,
                         kind=TaskKind.COLLECTIVE, deps=(last,), op=scatter, nbytes=(size + merged) / n, count=n,
                         group=rep_group(g, rep), instances=g)
        token = tail[0] if not (r.expert or r.sequence or r.sharded) else 0.0
        extra = loss if not (r.expert or r.sequence or r.sharded) else 0.0
        if r.rest and not r.rest_merged:  # a merged one leaves after the stage's last bucket (shard_sum_task)
            g = axis_groups_cached(groups, plan, list(r.rest), s)
            n = allreduce_count(reductions, leaves, size, nbytes, special[0], r.expert)
            last = b.add(name=f"all_reduce {label}{kind}", device=rep, stream=stream, kind=TaskKind.COLLECTIVE,
                         deps=(last,), op="all_reduce", nbytes=((size - token) / r.ways + extra) / n, count=n,
                         group=rep_group(g, rep), instances=g)
        if token and r.rest:  # the embedding's merged gather over tensor, then the token table's sum
            t = axis_groups_cached(groups, plan, [Axis.TENSOR], s)
            last = b.add(name=f"gather {label} embedding", device=rep, stream=stream, kind=TaskKind.COLLECTIVE,
                         deps=(last,), op="all_gather", nbytes=tail[1], group=rep_group(t, rep), instances=t)
            last = b.add(name=f"all_reduce {label} tokens", device=rep, stream=stream, kind=TaskKind.COLLECTIVE,
                         deps=(last,), op="all_reduce", nbytes=token / r.ways, group=rep_group(g, rep), instances=g)
        out.append(last)
    return out


def shard_sum_task(b: Builder, groups: dict, plan: Plan, s: int, rep: int, after: tuple[int, ...], sums) -> int:
    """The stage's merged all-reduces of its gradient shards (``sums``: testbed.sim.step.facts.StepFacts.shard_sum;
    testbed.sim.xla.xla_tpu.merges_shard_sums), once every task of ``after`` (the stage's reductions: its last
    reduce-scatter among them) is done."""
    g = axis_groups_cached(groups, plan, list(sums.axes), s)
    return b.add(name="all_reduce shards (merged)", device=rep, stream="grad", kind=TaskKind.COLLECTIVE,
                 deps=tuple(sorted(set(after))), op="all_reduce", nbytes=sums.each_bytes, count=sums.count,
                 group=rep_group(g, rep), instances=g)


def tied_task(b: Builder, nbytes: float, reps: tuple[int, ...], previous: dict[int, int],
              reduce_tasks: dict[int, list[int]], pairs: tuple[tuple[int, int], ...]) -> None:
    """The tied token table's gradient summed between the first stage's table and the last stage's copy
    (testbed.sim.step.grad_bytes.tied_copy_bytes: ``nbytes``) once both stages' last actions (``previous``) and
    reductions are done: one all-reduce over each of ``pairs`` (a first-stage device and its last-stage peer), on
    the grad stream; both stages' updates wait for it (it joins their ``reduce_tasks``)."""
    ends = (0, len(reps) - 1)
    deps = {previous[s] for s in ends} | {t for s in ends for t in reduce_tasks[s]}
    task = b.add(name="all_reduce tied embedding", device=reps[0], stream="grad", kind=TaskKind.COLLECTIVE,
                 deps=tuple(sorted(deps)), op="all_reduce", nbytes=nbytes, group=(reps[0], reps[-1]), instances=pairs)
    for s in ends:
        reduce_tasks[s].append(task)
