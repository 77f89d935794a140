"""Merge a traced program's independent collectives as XLA's combiners do, within the topology's ``combine_bytes``.

Shardy's partitioning (what the tracer reads) reduces or gathers every parameter leaf on its own; XLA's
all-reduce, all-gather and reduce-scatter combiners merge independent collectives of one kind over the
same device groups into one, up to a size threshold (XLA:CPU merges none). The topology says which:
``calibration.collectives.combine_bytes`` (0: none merged, as on XLA:CPU; None: no limit; the same field
plan-driven simulation counts fsdp gathers with, testbed.plan.sharding.parameter_collectives).

Walking the ops in program order, a collective joins the open merge of its kind and axes unless it
depends (through any chain of ops) on a member, or the merged bytes would exceed the limit. A merge
closes when an op reads one of its members' results, when a collective could not join it, or at the
end; it is issued where its last member was: so the merged collective starts once all its members'
operands are ready and finishes before anything needs any of them, as a combined collective does (a
merge does not reach past the first reader of a member: per-layer parameter gathers stay per layer, as
a latency-hiding schedule keeps them). Bytes are conserved (the merged op's are its members' sum; tested).
"""

from __future__ import annotations

from dataclasses import replace

from testbed.sim.workload import OpKind, TracedOp, Workload

__all__ = ["combine_collectives"]


def combine_collectives(workload: Workload, combine_bytes: float | None) -> Workload:
    """``workload`` with its independent same-kind, same-axes collectives merged (module docstring)."""
    if combine_bytes is not None and combine_bytes <= 0:
        return workload
    limit = float("inf") if combine_bytes is None else float(combine_bytes)
    ops = workload.ops
    out: list[TracedOp] = []
    where: list[int] = []                          # per op of ``out``: the old position it takes
    new: list[int] = [-1] * len(ops)              # old op -> its index in ``out``
    reach: list[dict] = [{} for _ in ops]          # old op -> {merge key: newest merge id it depends on}
    opened: dict[tuple, tuple[int, list[int]]] = {}  # merge key -> (merge id, members)
    owner: dict[int, tuple] = {}                   # old collective in an open merge -> its key
    serial = 0

    def flush(key: tuple) -> None:
        _, members = opened.pop(key)
        first = ops[members[0]]
        deps = sorted({new[d] for m in members for d in ops[m].deps})
        name = first.name if len(members) == 1 else f"{first.name} x{len(members)}"
        out.append(replace(first, name=name, deps=tuple(deps), nbytes=sum(ops[m].nbytes for m in members)))
        where.append(members[-1])  # issued where its last member was, not where it is flushed
        for m in members:
            new[m] = len(out) - 1
            owner.pop(m)

    for i, op in enumerate(ops):
        for d in op.deps:
            if d in owner:
                flush(owner[d])
            for key, value in reach[d].items():
                reach[i][key] = max(reach[i].get(key, -1), value)
        if op.kind is not OpKind.COLLECTIVE or op.count != 1:
            out.append(replace(op, deps=tuple(sorted({new[d] for d in op.deps}))))
            where.append(i)
            new[i] = len(out) - 1
            continue
        key = (op.collective, op.axes)
        if key in opened:
            merge_id, members = opened[key]
            size = sum(ops[m].nbytes for m in members)
            if reach[i].get(key, -1) >= merge_id or size + op.nbytes > limit:
                flush(key)
        if key not in opened:
            serial += 1
            opened[key] = (serial, [])
        merge_id, members = opened[key]
        members.append(i)
        owner[i] = key
        reach[i][key] = merge_id
    for key in list(opened):
        flush(key)
    # Every op's deps sit at earlier old positions (a reader of a member flushed the merge first).
    order = sorted(range(len(out)), key=lambda j: (where[j], j))
    index = {old: k for k, old in enumerate(order)}
    return replace(workload, ops=tuple(replace(out[j], deps=tuple(sorted(index[d] for d in out[j].deps)))
                                       for j in order))
