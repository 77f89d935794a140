"""Merge a traced program's independent collectives as XLA's combiners do.

Shardy's partitioning (what the tracer reads) reduces or gathers every parameter leaf on its own; XLA's
all-reduce, all-gather and reduce-scatter combiners merge collectives of one kind over the same device
groups that do not depend on each other into one:

- all-reduces merge whenever they are independent, on every backend (XLA:CPU too: the vision
  example's three gradient all-reduces and its loss's compile to one on 8 emulated devices, and the
  shard_map example's over ``data`` to one; tests/test_program_trace.py);
- all-gathers and reduce-scatters merge within a bound (testbed.sim.traced passes
  testbed.model.leaves.combine_limit: the topology's ``calibration.collectives.combine_bytes``, 0 on XLA:CPU,
  else XLA's default 30 MiB; the bound plan-driven simulation counts fsdp gathers with,
  testbed.model.leaves.parameter_collectives; None here: no bound), and only until an op reads one of them: a layer's
  parameter gathers are not merged with the next layer's, which a latency-hiding schedule prefetches
  while the layer computes.

Walking the ops in program order, a collective joins the open merge of its kind and axes unless it
depends, through any chain of ops (a merge counting as one op), on that merge, or a bound above says
no; then a new merge opens. A merged collective needs all its members' operands and is needed by all
their readers, so the ops are then put in a topological order, each as close to its old position as
that allows (a merge at its last member's). Bytes are conserved: a merge's are its members' sum.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import replace

from testbed.sim.workload import OpKind, TracedOp, Workload

__all__ = ["combine_collectives"]


def _merges(ops: tuple[TracedOp, ...], limit: float) -> list[int]:
    """Per op, the merge it belongs to (named by its first member; an op alone is its own)."""
    merge = list(range(len(ops)))
    reach: list[dict] = [{} for _ in ops]   # op -> {merge key: newest merge it depends on}
    together: dict[int, dict] = {}           # merge -> what its members together depend on, and itself
    opened: dict[tuple, tuple[int, float]] = {}  # merge key -> (open merge, its bytes)
    for i, op in enumerate(ops):
        seen = reach[i]
        for d in op.deps:
            for key, value in together.get(merge[d], reach[d]).items():
                if seen.get(key, -1) < value:
                    seen[key] = value
            key = (ops[d].collective, ops[d].axes) if ops[d].kind is OpKind.COLLECTIVE else None
            if key in opened and opened[key][0] == merge[d] and key[0] != "all_reduce":
                del opened[key]  # an all-gather or reduce-scatter merge ends at its first reader
        if op.kind is not OpKind.COLLECTIVE or op.count != 1:
            continue
        key = (op.collective, op.axes)
        bound = math.inf if op.collective == "all_reduce" else limit
        if key in opened:
            first, size = opened[key]
            if seen.get(key, -1) >= first or size + op.nbytes > bound:
                del opened[key]
        if key not in opened:
            opened[key] = (i, 0.0)
            together[i] = {}
        first, size = opened[key]
        opened[key] = (first, size + op.nbytes)
        merge[i] = first
        seen[key] = first
        total = together[first]
        for k, value in seen.items():
            if total.get(k, -1) < value:
                total[k] = value
    return merge


def combine_collectives(workload: Workload, combine_bytes: float | None) -> Workload:
    """``workload`` with its independent same-kind, same-axes collectives merged (module docstring)."""
    ops = workload.ops
    merge = _merges(ops, math.inf if combine_bytes is None else float(combine_bytes))
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
