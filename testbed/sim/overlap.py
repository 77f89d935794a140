"""Order a traced program's ops so that collectives overlap the compute that does not need them.

JAX emits a step's ops in the order it traced them: a gradient's accumulation add right after the
reduction that produces it, ahead of the rest of the backward pass. XLA's latency-hiding scheduler
starts each asynchronous collective as early as its operands allow and waits for it as late as its
consumers allow, running independent compute in between. :func:`defer_consumers` does the same on
the workload, before it becomes a task graph (whose compute stream runs in order): every compute op
that depends, directly or through other compute ops, on a collective is moved to just before its
earliest consumer (the end of the step when only the result reads it), keeping the relative order of
everything else, but compute a collective reads (through compute), which the scheduler runs first so that the
collective can start. Data-flow dependencies are kept: an op still follows everything it reads.
"""

from __future__ import annotations

from dataclasses import replace

from testbed.sim.workload import OpKind, Workload

__all__ = ["defer_consumers", "hoist_collectives"]


def defer_consumers(workload: Workload) -> Workload:
    """``workload`` with collective-dependent compute moved as late as its consumers allow (module docstring)."""
    ops = workload.ops
    n = len(ops)
    waits = [False] * n  # a compute op that (through compute) reads a collective's result
    for i, op in enumerate(ops):
        if op.kind is not OpKind.COLLECTIVE:
            waits[i] = any(ops[d].kind is OpKind.COLLECTIVE or waits[d] for d in op.deps)
    feeds = _feeds_collectives(workload)
    waits = [w and not f for w, f in zip(waits, feeds)]
    if not any(waits):
        return workload
    consumers: list[list[int]] = [[] for _ in range(n)]
    for i, op in enumerate(ops):
        for d in op.deps:
            consumers[d].append(i)
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


def _feeds_collectives(workload: Workload) -> list[bool]:
    """Per op, whether it is compute a collective reads, directly or through other compute: XLA's latency-hiding
    scheduler starts an asynchronous collective as early as it can, so it runs the compute that makes the
    collective's operand before independent compute, and :func:`defer_consumers` leaves such an op in its place.
    (The runner's fsdp backward: the head's input gradient, which waits for the head's gathered weights, is the
    cotangent the last layers' backward gathers wait for; deferred after the head's weight gradient, it held those
    gathers 3.6 ms on the superpod, d_model 2048 seq 2048 fp32: docs/program.md.)"""
    ops = workload.ops
    feeds = [False] * len(ops)
    for i in range(len(ops) - 1, -1, -1):
        if ops[i].kind is OpKind.COLLECTIVE or feeds[i]:
            for d in ops[i].deps:
                feeds[d] = feeds[d] or ops[d].kind is not OpKind.COLLECTIVE
    return feeds


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
    """``workload`` with each collective moved up to just after the last matmul or collective it reads.

    XLA's latency-hiding scheduler issues an asynchronous collective's start as soon as its operands are
    ready, so the compute between its last producer and its first consumer runs beside it. The tracer's
    compute segments run in program order (one in-order stream), so a collective JAX emits after
    unrelated compute would otherwise wait for that compute: the runner's fsdp backward gather of a
    block, whose link (a slice of the residual stream's gradient) JAX emits after the next block's
    backward, waited for it. The rule, by data flow: a collective, with the memory-bound ops it reads
    through memory-bound ops only (the small fusions that make its operand: a cast, a link's add), goes
    just after the latest matmul or collective it depends on (the program's start when none). A
    memory-bound op whose latest such dependency is a collective stays where it is (moved up, it would
    hold the in-order compute stream until that collective is done, which XLA's scheduler avoids by
    placing it before its first consumer: :func:`defer_consumers`), and what reads it follows it.
    Bounded as XLA's scheduler bounds an async start: by its operands (never above a producer), and by
    one collective in flight per kind and device groups (a stream per kind and axes in the task graph
    runs them in order: XLA's default overlap limit of 1 for each kind); no memory-pressure bound (the
    scheduler's memory limit is not modelled). Ties keep program order, so collectives that read the
    same producers stay in the order they were issued.
    """
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
            continue
        base[i], moved[i], late[i] = top, True, from_collective and op.kind is OpKind.MEMORY
    order = sorted(range(n), key=lambda i: (base[i], i if moved[i] else -1))
    if order == list(range(n)):
        return workload
    index = {old: new for new, old in enumerate(order)}
    hoisted = tuple(replace(ops[old], deps=tuple(sorted(index[d] for d in ops[old].deps))) for old in order)
    return replace(workload, ops=hoisted)
