"""A live-range estimate of one device's peak memory over a partitioned program (no devices, no compile).

The step's arguments are live throughout. Walking each block in program order, a materialized value
(testbed.runner.program.compile's fusion approximation: what a matmul, collective, reduction, loop or call
writes, or an elementwise result a matmul or collective reads) is allocated when it is produced and
freed after its last reader in the block (a loop's carried values when the loop ends, a block's results
when the block ends). A loop, call or shard_map body adds its own peak above what is live around it,
once (iterations reuse their buffers). XLA's buffer reuse across unrelated values, in-place updates,
rematerialization and its scheduler's reordering are not modeled: an estimate of the order of what the
program keeps alive, not XLA's buffer assignment.
"""

from __future__ import annotations

from testbed.runner.program.compile import Block, Compiled

__all__ = ["peak_bytes"]

_NESTED = ("while", "case", "region", "call")
_SINKS = frozenset({"gemm", "collective", "while", "call", "case", "region"})


def _uses(block: Block, functions: dict) -> set:
    """Every value a block's nodes (and their nested blocks) read."""
    out = set(block.yields)
    for node in block.nodes:
        out.update(node.operands)
        for inner in node.blocks:
            out |= _uses(inner, functions)
    return out


def _block_peak(block: Block, functions: dict, memo: dict) -> float:
    """Peak bytes the block allocates above what is live when it starts (its arguments not counted)."""
    key = id(block)
    if key in memo:
        return memo[key]
    memo[key] = 0.0  # guards recursion
    last: dict = {}
    sunk = set(block.yields)
    for i, node in enumerate(block.nodes):
        for v in node.operands:
            last[v] = i
        for inner in node.blocks:
            for v in _uses(inner, functions):
                last[v] = i
        if node.kind in _SINKS or node.name == "stablehlo.custom_call":
            sunk.update(node.operands)
    size: dict = {}
    live = peak = 0.0
    for i, node in enumerate(block.nodes):
        inner = max((_block_peak(b, functions, memo) for b in node.blocks), default=0.0)
        if node.kind == "call" and node.callee in functions:
            inner = _block_peak(functions[node.callee], functions, memo)
        kept = [r for r, root in zip(node.results, node.roots or [True] * len(node.results))
                if node.kind in ("gemm", "collective", *_NESTED) or root or r in sunk]
        new = sum(w for r, w in zip(node.results, node.writes) if r in kept)
        peak = max(peak, live + inner + new)
        live += new
        for r, w in zip(node.results, node.writes):
            if r in kept:
                size[r] = w
        for v in node.operands:
            if last.get(v) == i and v in size and v not in block.yields:
                live -= size.pop(v)
        for r in kept:  # results nothing reads are freed at once
            if r not in last and r not in block.yields and r in size:
                live -= size.pop(r)
    memo[key] = peak
    return peak


def peak_bytes(compiled: Compiled) -> float:
    """The step's arguments plus the peak of what its program keeps alive above them (module docstring)."""
    return float(sum(compiled.arg_bytes)) + _block_peak(compiled.entry, compiled.functions, {})
