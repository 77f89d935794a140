"""Order a traced program's ops so that collectives overlap the compute that does not need them.

JAX emits a step's ops in the order it traced them: a gradient's accumulation add right after the
reduction that produces it, ahead of the rest of the backward pass. XLA's latency-hiding scheduler
starts each asynchronous collective as early as its operands allow and waits for it as late as its
consumers allow, running independent compute in between. :func:`defer_consumers` does the same on
the workload, before it becomes a task graph (whose compute stream runs in order): every compute op
that depends, directly or through other compute ops, on a collective is moved to just before its
earliest consumer (the end of the step when only the result reads it), keeping the relative order of
everything else. Data-flow dependencies are kept: an op still follows everything it reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import accumulate

from testbed.sim.xla.workload import OpKind, Workload

__all__ = ["chain_gathers", "defer_consumers", "hoist_collectives"]


def defer_consumers(workload: Workload) -> Workload:
    """``workload`` with collective-dependent compute moved as late as its consumers allow (module docstring)."""
    ops = workload.ops
    n = len(ops)
    waits = [False] * n  # a compute op that (through compute) reads a collective's result
    for i, op in enumerate(ops):
        if op.kind is not OpKind.COLLECTIVE:
            waits[i] = any(ops[d].kind is OpKind.COLLECTIVE or waits[d] for d in op.deps)
    if not any(waits):
        return workload
    consumers = workload.readers()
    # Sort key: (position of the anchoring op that is not deferred, -steps before it); deferred ops sit just
    # before their earliest consumer, chains of them in their order, and no later than just after the last op
    # of their loop iteration (``_iteration_spans``).
    last = {it: end for it, (_, end) in _iteration_spans(workload).items()}
    key: list[tuple[int, int]] = [(i, 0) for i in range(n)]
    for i in range(n - 1, -1, -1):
        if waits[i]:
            anchor = min((key[c] for c in consumers[i]), default=(n, 0))
            key[i] = min((anchor[0], anchor[1] - 1), (last[ops[i].iteration], 1))
    order = sorted(range(n), key=lambda i: (key[i], i))
    index = {old: new for new, old in enumerate(order)}
    moved = tuple(replace(ops[old], deps=tuple(sorted(index[d] for d in ops[old].deps))) for old in order)
    return replace(workload, ops=moved)


def _iteration_spans(workload: Workload) -> dict[int, tuple[int, int]]:
    """Per loop iteration (``TracedOp.iteration``; 0: outside loops), the positions of its first and last op.

    XLA keeps the while loop of a ``lax.scan`` and its scheduler orders one computation at a time, a loop body
    being one: no op of an iteration starts before the iteration does, nor ends after it (the tracer unrolls
    the loop: docs/program.md, "Gradient accumulation"). So the orderings here move no op above its
    iteration's first op nor below its last. An op after an inner loop has its enclosing iteration's number,
    so it may still move across the inner loop, as XLA's scheduler moves it across the inner while."""
    spans: dict[int, tuple[int, int]] = {}
    for i, op in enumerate(workload.ops):
        start, _ = spans.get(op.iteration, (i, i))
        spans[op.iteration] = (start, i)
    return spans


def hoist_collectives(workload: Workload) -> Workload:
    """``workload`` with each collective, and the memory-bound chain making its operand, moved up to just after the
    latest matmul or collective it reads, as XLA's latency-hiding scheduler issues an async start (``kLessStall``,
    xla/service/latency_hiding_scheduler.cc); the chain moves only with its collective; never above a producer, one
    collective in flight per kind and device groups, ties in program order. Why and the cases that set each rule:
    docs/program.md, "Order, as XLA's latency-hiding scheduler would"."""
    ops = workload.ops
    n = len(ops)
    if not any(op.kind is OpKind.COLLECTIVE for op in ops):
        return workload
    feeds = [False] * n  # a memory-bound op a collective reads through memory-bound ops
    for i in range(n - 1, -1, -1):
        if ops[i].kind is OpKind.COLLECTIVE or feeds[i]:
            for d in ops[i].deps:
                feeds[d] = feeds[d] or ops[d].kind is OpKind.MEMORY
    # Sort key (base, index): an op that stays has base = its index and sorts first among equals (index -1);
    # a moved one has the latest base of its dependencies and sorts after that op, in program order.
    base, moved, late = list(range(n)), [False] * n, [False] * n  # late: its latest dependency is a collective
    first = {it: start for it, (start, _) in _iteration_spans(workload).items()}
    for i, op in enumerate(ops):
        if op.kind is OpKind.GEMM or not (op.kind is OpKind.COLLECTIVE or feeds[i]):
            continue
        top, from_collective = first[op.iteration] - 1, False  # not above its loop iteration's first op
        for d in op.deps:
            at = base[d]
            if at > top or (at == top and not from_collective):
                top = at
                from_collective = ops[d].kind is OpKind.COLLECTIVE or late[d]
        if op.kind is OpKind.MEMORY and from_collective:
            continue  # for now (below: with the collective it feeds)
        base[i], moved[i], late[i] = top, True, from_collective and op.kind is OpKind.MEMORY
    for i, op in enumerate(ops):
        if op.kind is OpKind.COLLECTIVE:
            _with_its_chain(ops, i, base, moved, first[op.iteration] - 1)
    order = sorted(range(n), key=lambda i: (base[i], i if moved[i] else -1))
    if order == list(range(n)):
        return workload
    index = {old: new for new, old in enumerate(order)}
    hoisted = tuple(replace(ops[old], deps=tuple(sorted(index[d] for d in ops[old].deps))) for old in order)
    return replace(workload, ops=hoisted)


def _with_its_chain(ops: tuple, g: int, base: list[int], moved: list[bool], floor: int = -1) -> None:
    """Collective ``g`` and the memory-bound ops it reads through memory-bound ops (its operand chain) up to just
    after the latest matmul or collective any of them reads, where that is above ``g``: the ops of the chain below
    that point (those left in place because they read a collective's result) move up with ``g``, none moves down.
    A chain moves only with its collective, so the in-order compute stream waits for a collective only where the
    collective the chain feeds starts at once (a merged all-reduce over data that waits for every layer's
    gradients leaves each layer's chain where it is). Nothing moves above ``floor`` (just before the first op of
    ``g``'s loop iteration)."""
    chain, stack = set(), [g]
    while stack:
        for d in ops[stack.pop()].deps:
            if ops[d].kind is OpKind.MEMORY and d not in chain:
                chain.add(d)
                stack.append(d)
    top = max((base[d] for k in (g, *chain) for d in ops[k].deps if d not in chain), default=floor)
    top = max(top, floor)
    if top >= base[g]:
        return
    for k in (g, *chain):
        if base[k] > top:
            base[k], moved[k] = top, True


def chain_gathers(workload: Workload, seconds: Sequence[float] | None = None) -> Workload:
    """``workload`` with each all-gather placed no earlier than the previous one of its stream can be done, where
    the compute from there to its own first reader covers it (``seconds``: each op's estimated time; None: always),
    else left where :func:`hoist_collectives` put it: XLA's scheduler with all-gathers a resource of their own, one
    in flight (``kScheduleDone``, ``kLessStall``; docs/program.md). A stream is one loop iteration's gathers over one
    set of axes, its order kept; no gather moves below its iteration's last op; reduce-scatters are not chained
    (only the optimizer reads them); the estimate is all or nothing (a split would cut the tracer's roofline
    segments where XLA's kernels are not split)."""
    ops = workload.ops
    n = len(ops)
    first = [n] * n  # each collective's first reader that is not a collective
    read = [n] * n   # each op's first reader
    for i, op in enumerate(ops):
        for d in op.deps:
            read[d] = min(read[d], i)
            if op.kind is not OpKind.COLLECTIVE and ops[d].kind is OpKind.COLLECTIVE:
                first[d] = min(first[d], i)
    streams: dict[tuple, list[int]] = {}
    for i, op in enumerate(ops):
        if op.kind is OpKind.COLLECTIVE and op.collective == "all_gather":
            streams.setdefault((op.axes, op.iteration), []).append(i)
    last = {it: end for it, (_, end) in _iteration_spans(workload).items()}
    covered = list(accumulate((0.0 if op.kind is OpKind.COLLECTIVE or seconds is None else seconds[i]
                               for i, op in enumerate(ops)), initial=0.0))  # compute time before each position
    key = [float(i) for i in range(n)]
    for members in streams.values():
        done_by = n  # the earliest first reader of this gather or a later one of the stream
        bounds = {}
        for g in reversed(members):
            done_by = min(done_by, first[g])
            bounds[g] = done_by
        for before, g in zip(members, members[1:]):
            if bounds[before] == n:
                continue
            at = min(bounds[before], last[ops[g].iteration] + 1, read[g])  # just before this position
            if seconds is not None and covered[min(first[g], n)] - covered[at] < seconds[g]:
                continue  # the compute from there to its reader would not cover it: where it was hoisted
            if at > g:
                key[g] = at - 0.5
        for before, g in zip(reversed(members[:-1]), reversed(members)):  # the stream's order kept (ties: index)
            key[before] = min(key[before], key[g])
    order = sorted(range(n), key=lambda i: (key[i], i))
    if order == list(range(n)):
        return workload
    index = {old: new for new, old in enumerate(order)}
    chained = tuple(replace(ops[old], deps=tuple(sorted(index[d] for d in ops[old].deps))) for old in order)
    return replace(workload, ops=chained)
