"""A live-range estimate of one device's peak memory over a partitioned program (no devices, no compile).

The step's arguments are live throughout. The program is read as XLA compiles it: a shard_map body is inlined
(XLA's partitioner leaves no region), a passthrough (reshape, transpose, broadcast) reads its source's buffer, and
so does a collective over one device (:func:`_alone`).
Walking each block in program order, a materialized value (testbed.runner.program.compile's fusion
approximation: what a matmul, collective, reduction, loop or call writes, or what such an op reads; and an
elementwise result read after a matmul or collective when XLA would not recompute it there, :func:`_readers`)
is allocated when it is produced and freed after its last reader in the block (a loop's carried values when
the loop ends, a block's results when the block ends). All-reduces that XLA's combiner merges into one
(:func:`_combined`) run as that one: every member's operand is kept until the last member's place, where all
their results are allocated at once. A loop or call body adds its own peak above what is
live around it, once (iterations reuse their buffers). The step's outputs are allocations of their own, apart
from the heap of temporaries, as XLA's buffer assignment makes them (:class:`_OutputSlots`). XLA's buffer reuse across unrelated values, in-place
updates and its scheduler's reordering are not modeled: an estimate of what the program keeps alive, not XLA's
buffer assignment (docs/program.md).

``fusing`` (a device whose compiler fuses elementwise producers and consumers into its matmuls,
``DeviceSpec.fuses_into_matmuls``: XLA:TPU, testbed.sim.xla.matmul_fusion): calls are inlined (XLA's
``CallInliner``), a matmul's result is kept only where a barrier or a later span reads it, a matmul computes the
elementwise results it reads in its own kernel, every elementwise result read across a barrier is recomputed
there, and a comparison read there is kept as its predicate (a ReLU's mask: :data:`KEPT_MASKS`, :func:`_readers`).
``rounded`` (a device that also runs fp32 matmuls on bf16-rounded operands, ``DeviceSpec.fp32_matmuls: bf16``): an
f32 value only such matmuls read is kept as its bf16 copy (testbed.runner.program.rounding). The chip's compiles of
the eight held-out programs (benchmarks/tpu_chip/programs.json) then hold 1.04-1.9x less than this estimate: XLA:TPU
also places values in VMEM (their memory-usage reports), which this estimate does not model.
"""

from __future__ import annotations

import dataclasses

from testbed.runner.program.compile import Block, Compiled
from testbed.runner.program.rounding import BF16Copies, matmul_only

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


def _flatten(block: Block, functions: dict | None = None) -> tuple[list, dict]:
    """The block's nodes with each shard_map body (``sdy.manual_computation``) inlined, as XLA's partitioner leaves
    it (the compiled step has no such region: its fusion and buffer assignment see one graph), and the aliases
    that makes: a body's argument -> the operand it is, a region's result -> the body's yield, a passthrough's
    result (reshape, transpose, broadcast) -> the value whose buffer it reads. With ``functions`` (a fusing
    compiler, :func:`peak_bytes`) each call of a function without nested blocks is inlined too, its values renamed
    per call (XLA's ``CallInliner`` runs before fusion: a ``jax.nn.relu`` is an elementwise op of its caller's)."""
    nodes: list = []
    alias: dict = {}
    for node in block.nodes:
        if node.kind == "region" and len(node.blocks) == 1:
            inner, more = _flatten(node.blocks[0], functions)
            alias.update(more)
            alias.update(zip(node.blocks[0].args, node.operands))
            alias.update(zip(node.results, node.blocks[0].yields))
            nodes += inner
            continue
        body = functions.get(node.callee) if functions is not None and node.kind == "call" else None
        if body is not None and not any(n.blocks or n.kind == "call" for n in body.nodes):
            name = dict(zip(body.args, node.operands))
            rename = lambda v, tag=len(nodes): name.get(v, ("inlined", tag, v))  # noqa: E731
            for n in body.nodes:
                inlined = dataclasses.replace(n, operands=[rename(v) for v in n.operands],
                                              results=[rename(v) for v in n.results])
                if n.kind == "passthrough" and n.operands:
                    sources = (inlined.operands if len(n.operands) == len(n.results)
                               else inlined.operands[:1] * len(n.results))
                    alias.update(zip(inlined.results, sources))
                nodes.append(inlined)
            alias.update(zip(node.results, [rename(v) for v in body.yields]))
            continue
        if _alone(node):  # a collective over one device is its operand
            node = dataclasses.replace(node, kind="passthrough")
        if node.kind == "passthrough" and node.operands:
            sources = node.operands if len(node.operands) == len(node.results) else node.operands[:1] * len(node.results)
            alias.update(zip(node.results, sources))
        nodes.append(node)
    return nodes, alias


def _alone(node) -> bool:
    """Whether ``node`` is a collective whose group is one device (its results shaped as its operands): XLA
    removes it (``AllReduceSimplifier``, xla/service/all_reduce_simplifier.cc: each result is its operand; XLA:TPU's
    compiles of the held-out programs on one-device meshes keep none of the pipeline's 16 all-reduces and 6
    collective-permutes, the transformer's 27 collectives or the MoE's 4: benchmarks/tpu_chip/programs.json compiled
    deviceless with libtpu 0.0.42.1)."""
    return node.kind == "collective" and node.collective[2] == 1 and len(node.operands) == len(node.results)


def _root(alias: dict, v):
    """The value ``v`` reads the buffer of, through :func:`_flatten`'s aliases."""
    seen = 0
    while v in alias and seen < 10_000:
        v, seen = alias[v], seen + 1
    return v


#: Elementwise ops XLA's fusion does not duplicate into a second consumer (``HloInstruction::IsExpensive``,
#: xla/hlo/ir/hlo_instruction.cc): a result of one read across a barrier stays in HBM until then.
EXPENSIVE = frozenset(f"stablehlo.{op}" for op in (
    "divide", "exponential", "exponential_minus_one", "log", "log_plus_one", "power", "rsqrt", "sqrt", "cbrt",
    "tanh", "logistic", "atan2", "cosine", "sine", "tan", "remainder", "erf")) | {"chlo.erf", "chlo.tan"}


#: Elementwise ops whose results a fusing compiler keeps in HBM where a later span reads them, rather than recompute
#: them there from their operands: a comparison's predicate (a ReLU's mask, ``x > 0``, read by its backward's
#: ``select``), one byte an element. XLA:TPU's compiles of the held-out programs keep each such mask as its own
#: ``pred`` buffer (the CNN's ``pred[256,16,16,128]``, 8 MiB, beside no f32 of its operand: its memory-usage report,
#: benchmarks/tpu_chip/programs.json's programs compiled deviceless with libtpu 0.0.42.1).
KEPT_MASKS = frozenset({"stablehlo.compare"})


def _readers(block: Block, functions: dict, fusing: bool = False, rounded: bool = False) -> tuple[dict, set, set, set]:
    """(value -> index of its last reader, values an HBM reader reads, values read across a barrier, values whose
    bf16 copy a matmul reads), each value taken through passthroughs to the one it reads.

    A barrier is a matmul, collective, loop, call or custom call: no fusion reaches across one (testbed.runner.
    program.evaluate's multi-output rule). An elementwise result read after one is read from HBM where it is there
    anyway (a matmul's operand), else recomputed in its reader's kernel when cheap (XLA's fusion duplicates a cheap
    producer into each consumer, its operands read there) and kept in HBM until then when expensive (a forward's
    GELU ``tanh`` read by its backward).

    ``fusing`` (XLA:TPU, :func:`peak_bytes`): a matmul's result is made like an expensive elementwise result (its
    elementwise consumers and reductions run in the matmul's kernel; kept when a barrier or a later span reads it),
    a matmul reading a cheap elementwise result computes it in its own kernel (a producer fusion: that result's
    operands are read there, each kept in HBM, not the result) and a comparison is kept (:data:`KEPT_MASKS`);
    ``rounded``: a matmul reads an elementwise result's bf16 copy where testbed.runner.program.rounding says."""
    nodes, alias = _flatten(block, functions if fusing else None)
    last, made, far = {}, {}, set()  # made: elementwise result -> (barriers before it, its node)
    sunk = {_root(alias, v) for v in block.yields}
    copies = BF16Copies(nodes, _reads(alias, functions), block.args, sunk, last) if rounded else None
    barriers = 0

    def read(v, i: int) -> None:  # the same value read twice for one node and phase: the same effects
        if v in seen:
            return
        seen.add(v)
        last[v] = i  # in HBM anyway (an operand of a matmul, say): read from there
        when, node = made.get(v, (barriers, None))
        if sinking and node is not None and node.kind == "memory" and not any(node.roots):
            if copies is not None and copies.serves(v, i, nodes[i]):  # its bf16 copy, written where it is made
                return
            for o in node.operands:  # a producer fused into the matmul: its operands are what it reads from HBM
                read(_root(alias, o), i)
            return
        if sinking:
            sunk.add(v)
        if when == barriers or v in far:
            return
        if any(node.roots) or (node.name in EXPENSIVE and not fusing) or (fusing and node.name in KEPT_MASKS):
            far.add(v)
            return
        for o in node.operands:  # else recomputed here when it is cheap: its operands are read here
            read(_root(alias, o), i)

    sinking, seen = False, set()
    for i, node in enumerate(nodes):
        sink = node.kind in _SINKS or node.name == "stablehlo.custom_call"
        reads = [_root(alias, v) for v in node.operands]
        inner = [_root(alias, v) for b in node.blocks for v in _uses(b, functions)]
        sinking, seen = fusing and node.kind == "gemm", set()
        for v in reads:
            read(v, i)
        sinking, seen = False, set()
        for v in inner:
            read(v, i)
        if sink:
            sunk.update(inner + ([] if fusing and node.kind == "gemm" else reads))
        barriers += sink
        if node.kind == "memory" or (fusing and node.kind == "gemm"):
            made.update((r, (barriers, node)) for r in node.results)
    return last, sunk, far, copies.values if copies is not None else set()


def _combined(nodes: list, alias: dict, functions: dict) -> dict[int, int]:
    """Each all-reduce of ``nodes`` that XLA's all-reduce combiner merges with others -> the index of the member
    where the merged one runs: the first whose place is past every member's operands (its scheduler issues the
    merged op once they are ready, and the readers of its results after it).

    XLA's ``CombineInstructionsByKey`` (xla/service/collective_combiner_utils.h, which the all-reduce combiner
    calls): walking in order, a group of one key (here the mesh axes, the element type and the reduction) takes
    each next all-reduce of that key unless it is reachable in the data flow from a member already taken; the
    first that is opens the next group (testbed.sim.xla.combine follows the same rule on the workload). XLA:CPU's
    compiled programs run the merged one: a pipeline's per-tick weight-gradient all-reduces are one tuple
    all-reduce whose operands and results are all live at once; a pmap step's gradient pmeans and its loss's
    pmean (after the update in program order) are one, before the update."""
    produced: dict = {}     # value -> bit set of the all-reduces it depends on
    made: dict = {}         # value -> index of the node writing it
    open_groups: dict = {}  # key -> (members, their bits)
    groups: list = []
    for i, node in enumerate(nodes):
        reads = [_root(alias, v) for v in node.operands]
        reads += [_root(alias, v) for inner in node.blocks for v in _uses(inner, functions)]
        below = 0
        for v in reads:
            below |= produced.get(v, 0)
        if node.kind == "collective" and node.collective and node.collective[0] == "all_reduce":
            key = (node.collective[1], node.collective[4], node.reducer)
            members, bits = open_groups.get(key, ([], 0))
            if below & bits or not members:
                members, bits = [], 0
                groups.append(members)
            members.append(i)
            open_groups[key] = (members, bits | (1 << i))
            below |= 1 << i
        for r in node.results:
            produced[r], made[r] = below, i
    out: dict[int, int] = {}
    for members in (g for g in groups if len(g) > 1):
        ready = max((made.get(_root(alias, o), -1) for m in members for o in nodes[m].operands), default=-1)
        runs = min(m for m in members if m >= ready)
        out.update((m, runs) for m in members)
    return out


def _reads(alias: dict, functions: dict):
    """node -> (what its operands read, what its nested blocks read), through passthroughs (testbed.runner.program.
    rounding's ``reads``)."""
    return lambda node: ([_root(alias, v) for v in node.operands],
                         [_root(alias, v) for b in node.blocks for v in _uses(b, functions)])


def _with_copies(node, bf16: set, written: list, kept: list) -> tuple[list, list]:
    """``node``'s results written and kept, with the bf16 copy of each in ``bf16`` (half its bytes) beside them."""
    copies = [(("bf16", r), w / 2) for r, w in zip(node.results, node.writes) if r in bf16]
    return written + copies, kept + [r for r, _ in copies]


def _block_peak(block: Block, functions: dict, memo: dict, upcast: dict | None = None, apart: bool = False,
                fusing: bool = False, rounded: bool = False) -> float:
    """Peak bytes the block allocates above what is live when it starts (its arguments not counted); ``upcast``:
    the entry's argument sizes where each bf16 matmul operand also has an f32 copy (:func:`_f32_copies`);
    ``apart``: the block's results are the step's outputs, each an allocation of its own (:class:`_OutputSlots`);
    ``fusing``: a matmul's result is kept only where :func:`_readers` (fusing) needs it in HBM; ``rounded``: an f32
    value only default-precision matmuls read kept as its bf16 copy (testbed.runner.program.rounding)."""
    key, rules = id(block), {"fusing": fusing, "rounded": rounded}
    if key in memo:
        return memo[key]
    memo[key] = 0.0  # guards recursion
    last, sunk, far, bf16 = _readers(block, functions, fusing, rounded)
    nodes, alias = _flatten(block, functions if fusing else None)
    yields = {_root(alias, v) for v in block.yields}
    merged = _combined(nodes, alias, functions)
    halves = matmul_only(nodes, _reads(alias, functions), yields, elementwise=False) if rounded else set()
    for m, end in merged.items():  # a member's operands and results live until its group runs, at least
        for v in [_root(alias, o) for o in nodes[m].operands] + list(nodes[m].results):
            last[v] = max(last.get(v, end), end)
    dying: dict = {}
    for v, j in last.items():
        dying.setdefault(j, []).append(v)
    size: dict = {}
    copies = _F32Copies(nodes, alias, upcast, size, dying)
    live = peak = 0.0
    slots = _OutputSlots(nodes, yields) if apart else None
    for i, node in enumerate(nodes):
        inner = max((_block_peak(b, functions, memo, upcast, **rules) for b in node.blocks), default=0.0)
        if node.kind == "call" and node.callee in functions:
            inner = _block_peak(functions[node.callee], functions, memo, upcast, **rules)
        always = ("collective", *_NESTED) if fusing else ("gemm", "collective", *_NESTED)
        kept = [r for r, root in zip(node.results, node.roots or [True] * len(node.results))
                if node.kind in always or (root and node.kind != "gemm") or r in sunk or r in far]
        written = [(r, w / 2 if r in halves else w) for r, w in zip(node.results, node.writes)]
        written, kept = _with_copies(node, bf16, written, kept)
        if merged.get(i, i) != i:  # its results are written where its group runs
            kept = []
        elif i in merged:
            more = [(r, w) for m, end in merged.items() if end == i and m != i
                    for r, w in zip(nodes[m].results, nodes[m].writes)]
            written += more
            kept += [r for r, _ in more]
        live += copies.made(node)
        if slots is not None:  # a loop's carried outputs live in their own allocations all through it
            inner -= sum(w for r, w in written if r in slots.outputs) if node.blocks else 0.0
            kept = slots.produce(written, kept)
        new = sum(w for r, w in written if r in kept)
        peak = _while_written(node, live, size, slots, inner, [w for r, w in written if r in kept], peak)
        live += new
        for r, w in written:
            if r in kept:
                size[r] = w
        for v in dying.get(i, []) + [r for r in kept if r not in last]:
            if v in size and v not in yields:  # freed after its last reader (at once if nothing reads it)
                live -= size.pop(v)
        peak = max(peak, live) if slots is None else slots.heap(size, [], floor=peak)
    if slots is not None:
        peak += slots.total
    memo[key] = peak
    return peak


class _F32Copies:
    """XLA:CPU's f32 copies of bf16 matmul operands (``device.bf16_matmuls: fp32``): FloatNormalization converts
    each operand of a bf16 dot to f32; after CSE one convert per value, its result kept until the value's last
    matmul. A copy is allocated in ``size`` (keyed ``("f32", value)``) at the first matmul reading the value and
    queued in ``dying`` at its last; ``upcast`` None: none (the estimate as the value's own compiler keeps it)."""

    def __init__(self, nodes: list, alias: dict, upcast: dict | None, size: dict, dying: dict) -> None:
        self.alias, self.upcast, self.size, self.dying = alias, upcast, size, dying
        self.last: dict = {}
        for i, node in enumerate(nodes):
            if node.kind == "gemm":
                for o in node.operands:
                    self.last[_root(alias, o)] = i
        self.done: set = set()

    def made(self, node) -> float:
        """Bytes of the copies ``node`` makes (0 unless it is a bf16 matmul reading a value without one yet)."""
        if self.upcast is None or node.kind != "gemm" or not _half(node):
            return 0.0
        made = 0.0
        for v in (_root(self.alias, o) for o in node.operands):
            nbytes = self.size.get(v, self.upcast.get(v))
            if v in self.done or nbytes is None:
                continue
            self.done.add(v)
            self.size[("f32", v)] = 2 * nbytes
            self.dying.setdefault(self.last[v], []).append(("f32", v))
            made += 2 * nbytes
        return made


def _half(node) -> bool:
    g = node.gemm
    return g is not None and node.writes and node.writes[0] == 2 * g.batch * g.m * g.n


def peak_bytes(compiled: Compiled, upcast: bool = False, fusing: bool = False, rounded: bool = False) -> float:
    """The step's arguments plus the peak of what its program keeps alive above them (module docstring); ``fusing``:
    as a compiler that fuses elementwise producers and consumers into its matmuls keeps it (XLA:TPU,
    ``DeviceSpec.fuses_into_matmuls``: :func:`_readers`); ``rounded``: each f32 value that only default-precision
    matmuls read kept as its bf16 copy (``DeviceSpec.fp32_matmuls: bf16``: testbed.runner.program.rounding)."""
    args = dict(zip(compiled.entry.args, compiled.arg_bytes)) if upcast else None
    return float(sum(compiled.arg_bytes)) + _block_peak(compiled.entry, compiled.functions, {}, args, apart=True,
                                                        fusing=fusing, rounded=rounded)


def _while_written(node, live: float, size: dict, slots, inner: float, new: list, peak: float) -> float:
    """The larger of ``peak`` and what is live while ``node`` writes ``new`` (its bytes per result) above ``live``
    (``size``'s values); a loop's, call's or shard_map body's results are its block's yields, live at its end: in
    its own peak ``inner``. With ``slots``, the heap of temporaries alone (:class:`_OutputSlots`)."""
    nested = bool(node.blocks) or node.kind == "call"
    if slots is None:
        return max(peak, live + (max(inner, sum(new)) if nested else sum(new)))
    return slots.heap(size, [], max(inner, sum(new)), peak) if nested else slots.heap(size, new, floor=peak)


class _OutputSlots:
    """XLA:CPU's buffer assignment of the step's outputs: each output its own allocation (``maybe-live-out``),
    apart from the one heap of temporaries (``preallocated-temp``); a temporary that fits in an output's
    allocation and dies before that output is written lives there instead of the heap (the buffer-assignment
    dump of the FSDP step: 18 output allocations holding its small temporaries, its 1 MiB gradients in the heap).
    A loop's or call's body is many buffers: its peak fills the free output allocations as a fluid (a scan's
    carried gradients are written in place into the update's outputs)."""

    def __init__(self, nodes: list, yields: set) -> None:
        self.pending = {r: w for node in nodes for r, w in zip(node.results, node.writes) if r in yields}
        self.outputs = set(self.pending)
        self.total = float(sum(self.pending.values()))
        self._free: tuple[list, float] | None = None  # the free allocations, largest first, and their sum

    def produce(self, written: list, kept: list) -> list:
        """The kept results that are temporaries (each output written is taken off the free allocations)."""
        for r, _ in written:
            if self.pending.pop(r, None) is not None:
                self._free = None
        return [r for r in kept if r not in self.outputs]

    def heap(self, size: dict, extra: list, lump: float = 0.0, floor: float = 0.0) -> float:
        """The larger of ``floor`` and the heap's bytes when ``size``'s values and ``extra`` are live: each, largest
        first, in the largest free output allocation it fits, else in the heap. The heap is at most all of them
        (then not placed: the step's peak so far as ``floor`` skips most of its nodes)."""
        if self._free is None:
            free = sorted(self.pending.values(), reverse=True)
            self._free = free, sum(free)
        free, spare = self._free
        live = [*size.values(), *extra]
        whole = sum(live) + max(0.0, lump - spare)
        if whole <= floor:
            return floor
        placed, j = 0.0, 0
        for nbytes in sorted([v for v in live if free and v <= free[0]], reverse=True):
            if j == len(free):
                break
            if nbytes <= free[j]:
                placed, j = placed + nbytes, j + 1
        return max(floor, whole - placed)
