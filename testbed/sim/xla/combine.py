"""Merge a traced program's independent collectives as XLA's combiners do.

Shardy's partitioning (what the tracer reads) reduces or gathers every parameter leaf on its own; XLA's
all-reduce, all-gather and reduce-scatter combiners merge collectives of one kind over the same device
groups that do not depend on each other into one:

- all-reduces merge whenever they are independent (XLA:CPU: the vision example's three gradient all-reduces
  and its loss's compile to one on 8 emulated devices, and the shard_map example's over ``data`` to one;
  tests/test_program_trace.py), on XLA:TPU within 120 MiB (the topology's
  ``calibration.collectives.allreduce_combine_bytes``, benchmarks/xla_tpu_collectives.py);
- all-gathers and reduce-scatters merge within a bound (testbed.sim.graph.traced passes
  testbed.model.leaves.combine_limit: the topology's ``calibration.collectives.combine_bytes``, 0 on XLA:CPU,
  else XLA's default 30 MiB; the bound plan-driven simulation counts fsdp gathers with,
  testbed.model.leaves.parameter_collectives; None here: no bound); one larger than the bound alone is
  never merged.

The rule is XLA's ``CombineInstructionsByKey`` (xla/service/collective_combiner_utils.h, which the
all-gather, reduce-scatter and all-reduce combiners call): walking the instructions in a topological
order, a group of one key (kind and device groups) takes each next collective of that key while the
group's bytes stay within the bound and the collective is not reachable, in the data-flow graph, from
any member already taken (HloReachabilityMap); the first that fails ends the group and opens the next.
Readers in between do not end a group: a layer's gathers whose operands are ready before the layer
before it has computed (bf16 casts of the fp32 shards, which JAX emits after that layer) merge with
that layer's, as XLA merges them. The combiners run before XLA's latency-hiding scheduler, so
testbed.sim.graph.traced combines the ops in the traced (JAX's) order, before testbed.sim.xla.overlap orders them;
the walk is that order, where XLA walks its own post order (both topological: the groups differ only
where two orders interleave one key's collectives differently).

First, as XLA's ``AllReduceSimplifier`` does ahead of the combiners (the first pass of gpu_compiler.cc's
collective-optimizations pipeline), a collective over groups of one device (an all-reduce, all-gather or
reduce-scatter: the runner's ``psum`` over an axis of size 1) is dropped, its readers reading its operand:
left in, the all-reduce combiner merged such no-ops with each other, so an activation gradient's no-op waited
for a weight gradient's (fsdp x tensor with sequence parallelism: the last layer's backward gathers then
waited for the head's weight-gradient matmul).

A combiner merges within one computation, and a while loop's body is one: the tracer unrolls the loops it
walks, but no merge takes collectives of two loop iterations (``TracedOp.iteration``; XLA keeps the loop of a
``lax.scan``, docs/program.md "Gradient accumulation"), nor one inside a loop with one outside it.

Here the keys are walked together in one pass, each with its open group; reachability counts a merge as
one op (XLA recomputes it after each combined group). A merged collective needs all its members'
operands and is needed by all their readers, so the ops are then put in a topological order, each as
close to its old position as that allows (a merge at its last member's). Bytes are conserved: a merge's
are its members' sum.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import replace

from testbed.model.xla_tpu import packed_merges
from testbed.sim.xla.workload import OpKind, TracedOp, Workload

__all__ = ["PASSES", "combine_collectives", "drop_trivial_collectives"]


#: The combiners' order in XLA's GPU pipeline (gpu_compiler.cc's post-fusion passes): each pass merges one kind,
#: and a later pass sees the earlier passes' merged collectives.
PASSES = ("all_gather", "all_reduce", "reduce_scatter")
#: The kinds XLA's AllReduceSimplifier removes over groups of one device (their result is their operand).
TRIVIAL_KINDS = frozenset(PASSES)


def _key(op: TracedOp) -> tuple:
    """What a collective merges by: its kind, its axes and its combiner (``TracedOp.combiner``)."""
    return op.collective, op.axes, op.combiner


def _merges(ops: tuple[TracedOp, ...], key: tuple, bound: float) -> list[int]:
    """Per op, the merge it belongs to (named by its first member; an op alone is its own), merging the
    collectives of ``key`` (kind, axes, combiner: :func:`_key`) by CombineInstructionsByKey's rule (module docstring). ``after[i]``: the
    newest group of this key op ``i`` depends on (groups open in walk order, so depending on the open one is
    ``after >= first``); the ops' other merges are already single ops, so the data flow is exact."""
    merge = list(range(len(ops)))
    after = [-1] * len(ops)
    first, size = -1, 0.0
    for i, op in enumerate(ops):
        newest = max((after[d] for d in op.deps), default=-1)
        if (op.kind is OpKind.COLLECTIVE and op.count == 1 and _key(op) == key
                and op.nbytes <= bound):  # one over the bound alone is never merged; the group goes on
            if first < 0 or newest >= first or size + op.nbytes > bound or op.iteration != ops[first].iteration:
                first, size = i, 0.0  # reachable from the group, over the bound, or another loop iteration: the next
            merge[i], size, newest = first, size + op.nbytes, first
        after[i] = newest
    return merge


def combine_collectives(workload: Workload, combine_bytes: float | None,
                        allreduce_bytes: float | None = None, packs: bool = False) -> Workload:
    """``workload`` with its independent same-kind, same-axes collectives merged (module docstring): one pass
    per kind in :data:`PASSES`' order (then any other kind, all-to-all or collective-permute, within the bound as
    an all-gather), one key (kind, axes) at a time, each on the last one's result. All-reduces merge within
    ``allreduce_bytes`` (the topology's ``calibration.collectives.allreduce_combine_bytes``; None: no bound);
    ``packs``: as XLA:TPU's all-reduce combiner packs them (:func:`_packed_merges`)."""
    workload = drop_trivial_collectives(workload)
    limit = math.inf if combine_bytes is None else float(combine_bytes)
    reduce_limit = math.inf if allreduce_bytes is None else float(allreduce_bytes)
    kinds = dict.fromkeys(op.collective for op in workload.ops if op.kind is OpKind.COLLECTIVE)
    for kind in (*PASSES, *sorted(set(kinds) - set(PASSES))):
        keys = dict.fromkeys(_key(op) for op in workload.ops
                             if op.kind is OpKind.COLLECTIVE and op.collective == kind)
        for key in keys:
            bound = reduce_limit if kind == "all_reduce" else limit
            packed = kind == "all_reduce" and packs and not key[2] and not math.isinf(bound)
            workload = _merged(workload, (_packed_merges if packed else _merges)(workload.ops, key, bound))
    return workload


def post_order(ops: tuple[TracedOp, ...]) -> list[int]:
    """The ops in XLA's ``MakeInstructionPostOrder`` order: a depth-first walk from the program's results (the ops
    nothing reads, in program order: a step's parameter and optimizer updates, in the parameters' pytree order),
    each op after its operands (in ``deps`` order)."""
    readers = [0] * len(ops)
    for op in ops:
        for d in op.deps:
            readers[d] += 1
    seen, out = [False] * len(ops), []
    for root in (i for i in range(len(ops)) if not readers[i]):
        stack = [(root, 0)]
        while stack:
            i, k = stack.pop()
            if k == 0 and seen[i]:
                continue
            seen[i] = True
            deps = ops[i].deps
            while k < len(deps) and seen[deps[k]]:
                k += 1
            if k < len(deps):
                stack += [(i, k + 1), (deps[k], 0)]
            else:
                out.append(i)
    return out


def _packed_merges(ops: tuple[TracedOp, ...], key: tuple, bound: float) -> list[int]:
    """:func:`_merges` as XLA:TPU's all-reduce combiner merges ``key``'s collectives (testbed.sim.xla.xla_tpu,
    "packed"): walking them in :func:`post_order`, each merge takes every next one still within ``bound``, not
    reachable from a member, and of the first member's loop iteration, passing over the others (left for the next
    merge); one over the bound alone is never merged."""
    merge = list(range(len(ops)))
    order = [i for i in post_order(ops) if ops[i].kind is OpKind.COLLECTIVE and ops[i].count == 1
             and _key(ops[i]) == key and ops[i].nbytes <= bound]
    admits = (lambda taken, i: not taken or (ops[i].iteration == ops[taken[0]].iteration
                                             and not _reaches(ops, set(taken), i)))
    for members in packed_merges(order, lambda i: ops[i].nbytes, bound, admits):
        for i in members:
            merge[i] = members[0]
    return merge


def _reaches(ops: tuple[TracedOp, ...], sources: set[int], target: int) -> bool:
    """Whether ``target`` depends, directly or not, on any op of ``sources``."""
    if not sources:
        return False
    low, stack, seen = min(sources), [target], {target}
    while stack:
        for d in ops[stack.pop()].deps:
            if d in sources:
                return True
            if d >= low and d not in seen:
                seen.add(d)
                stack.append(d)
    return False


def drop_trivial_collectives(workload: Workload) -> Workload:
    """``workload`` without its all-reduces, all-gathers and reduce-scatters over groups of one device (module
    docstring): each op that read one reads what it read instead."""
    ops = workload.ops
    trivial = [op.kind is OpKind.COLLECTIVE and op.group < 2 and op.collective in TRIVIAL_KINDS for op in ops]
    if not any(trivial):
        return workload
    reads: list[tuple[int, ...]] = []  # per op, the kept ops its result stands for (itself when kept)
    index: dict[int, int] = {}
    out: list[TracedOp] = []
    for i, op in enumerate(ops):
        deps = tuple(sorted({k for d in op.deps for k in reads[d]}))
        if trivial[i]:
            reads.append(deps)
            continue
        reads.append((i,))
        index[i] = len(out)
        out.append(replace(op, deps=tuple(index[d] for d in deps)))
    return replace(workload, ops=tuple(out))


def _merged(workload: Workload, merge: list[int]) -> Workload:
    """``workload`` with the ops ``merge`` names together as one, in a topological order near the old one."""
    ops = workload.ops
    members: dict[int, list[int]] = {}
    for i, m in enumerate(merge):
        members.setdefault(m, []).append(i)
    if all(len(ms) == 1 for ms in members.values()):
        return workload
    deps = {m: sorted({merge[d] for i in ms for d in ops[i].deps} - {m}) for m, ms in members.items()}
    readers: dict[int, list[int]] = {m: [] for m in members}
    for m, ds in deps.items():
        for d in ds:
            readers[d].append(m)
    waiting = {m: len(ds) for m, ds in deps.items()}
    where = {m: ms[-1] for m, ms in members.items()}
    ready = [(where[m], m) for m, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    index: dict[int, int] = {}
    out: list[TracedOp] = []
    while ready:
        _, m = heapq.heappop(ready)
        ms, first = members[m], ops[members[m][0]]
        name = first.name if len(ms) == 1 else f"{first.name} x{len(ms)}"
        out.append(replace(first, name=name, deps=tuple(sorted(index[d] for d in deps[m])),
                           nbytes=sum(ops[i].nbytes for i in ms)))
        index[m] = len(out) - 1
        for r in readers[m]:
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, (where[r], r))
    if len(out) != len(members):  # excluded by _merges (a merge never depends on itself); a guard
        raise RuntimeError("merging collectives made the program cyclic")
    return replace(workload, ops=tuple(out))
