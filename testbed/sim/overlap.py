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

from dataclasses import replace

from testbed.sim.workload import OpKind, Workload

__all__ = ["defer_consumers"]


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
    consumers: list[list[int]] = [[] for _ in range(n)]
    for i, op in enumerate(ops):
        for d in op.deps:
            consumers[d].append(i)
    # Sort key: (position of the anchoring op that is not deferred, -steps before it); deferred ops sit just
    # before their earliest consumer, chains of them in their order.
    key: list[tuple[int, int]] = [(i, 0) for i in range(n)]
    for i in range(n - 1, -1, -1):
        if waits[i]:
            anchor = min((key[c] for c in consumers[i]), default=(n, 0))
            key[i] = (anchor[0], anchor[1] - 1)
    order = sorted(range(n), key=lambda i: (key[i], i))
    index = {old: new for new, old in enumerate(order)}
    moved = tuple(replace(ops[old], deps=tuple(sorted(index[d] for d in ops[old].deps))) for old in order)
    return replace(workload, ops=moved)
