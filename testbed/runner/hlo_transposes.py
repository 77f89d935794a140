"""The physical transposes of a compiled step: XLA:CPU's kernels that write a value in an order its source is not in.

Pure text processing of a compiled module's optimized HLO (``compiled.as_text()``; no JAX). XLA:CPU's layout
assignment writes some values with their minor dimension moved (a weight gradient's operand, a token-mixing
activation, a scan's gradient stored into its stacked buffer): a ``copy`` whose layout differs from its operand's,
or a loop fusion whose result is written in an order an operand of the same elements is not in. Such a kernel reads
that operand with a stride, where a plain elementwise loop streams it. The fusion estimate prices a transpose as free
(XLA folds it into its consumer); testbed.sim.graph.traced_graph prices what this module finds as transposing passes
(docs/program.md, "How it is priced").

A kernel is a top-level instruction (of the entry, a loop body, a conditional's branch): a ``copy``, a
``transpose``, or a ``kind=kLoop`` fusion (not a matmul's: YNNPACK's ``__ynn_fusion``, a dot or convolution). It is
*transposing* when one of its operands of at least as many elements as it writes is read with a stride: walking its
fused computation back from the result (elementwise ops, copies, transposes, bitcasts, reshapes, slices, reverses,
a dynamic-update-slice's update), the operand's offset, between the result's first element and the next along its
written minor dimension, moves by more than one element. Copies inside a fusion that undo each other move nothing
(XLA:CPU's loop emitter computes each written element from its operands' indices: only the operands' and the
result's layouts are in memory). A kernel in a ``while`` body counts its known trip count times (nested loops
multiply). Its bytes are those it writes (a dynamic-update-slice's update, in place), and as many elements of the
strided operand read. One that only moves data is priced whole where the tracer priced none of it (a transpose folded
into its consumer), beyond the plain pass where the tracer priced its bytes (it computes, or holds a ``reverse``, a
memory-bound op of the tracer's fusion estimate).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from testbed.runner import hlo_schedule
from testbed.sim.xla.workload import CompiledTransposes, Workload, element_bytes

__all__ = ["TransposePass", "Transposes", "compiled_transposes", "with_transposes"]

_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?) ([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"^(\w+)\[([\d,]*)\](?:\{([\d,]*)[^}]*\})?$")
#: Ops that move elements without computing them.
_MOVES = frozenset({"parameter", "copy", "transpose", "bitcast", "reshape", "slice", "dynamic-slice",
                    "dynamic-update-slice", "reverse", "broadcast", "constant", "tuple", "concatenate", "pad"})
#: Of those, the ones only the program itself holds, which the tracer's fusion estimate prices as a memory-bound op of
#: their own (testbed.runner.program.compile: not among its pass-through ops): a kernel holding one was priced there at
#: the plain pass, its bytes and its kernel. A ``reverse``: the conv transpose rule's of a weight, which XLA:CPU fuses
#: into the weight's layout copy. Not the slices and concatenations XLA makes of a collective's buffers (XLA:CPU's
#: all-to-all takes one operand per peer, sliced out of the traced buffer in a layout copy), which the tracer never saw.
_PRICED_MOVES = frozenset({"reverse"})
#: Ops whose result element ``i`` is computed from element ``i`` of each operand of the same shape.
_ELEMENTWISE = frozenset({
    "abs", "add", "and", "atan2", "cbrt", "ceil", "clamp", "compare", "convert", "copy", "cosine", "divide", "exp",
    "exponential", "exponential-minus-one", "floor", "is-finite", "log", "log-plus-one", "logistic", "maximum",
    "minimum", "multiply", "negate", "not", "or", "power", "remainder", "round-nearest-afz", "round-nearest-even",
    "rsqrt", "select", "shift-left", "shift-right-arithmetic", "shift-right-logical", "sign", "sine", "sqrt",
    "subtract", "tan", "tanh", "xor", "erf"})


@dataclass(frozen=True, slots=True)
class _Instr:
    name: str
    dtype: str
    dims: tuple[int, ...]
    layout: tuple[int, ...]
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    root: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class TransposePass:
    """One transposing kernel of the compiled step: ``name``, the ``bytes`` it writes and the ``read_bytes`` of its
    strided operand it reads per execution (as many elements, in that operand's type), ``count`` executions per step
    (loop trip counts), ``minor``: the size of its result's minor dimension and the stride (elements) of its strided
    read; ``moves_only``: its fused computation only moves data (copies, transposes, bitcasts: no arithmetic, no
    conversion) and holds no move the fusion estimate prices (:data:`_PRICED_MOVES`), so the fusion estimate prices
    none of its bytes; a kernel that computes, or holds such a move, had its bytes priced there at the plain pass."""

    name: str
    bytes: float
    read_bytes: float
    count: int
    minor: tuple[int, int]
    moves_only: bool = True

    def __post_init__(self) -> None:
        if min(self.bytes, self.read_bytes) < 0 or self.count < 1:
            raise ValueError(f"{self.name}: bytes must be >= 0 and count >= 1, got {self.bytes}, {self.count}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Transposes:
    """The transposing kernels of one device's compiled step (:func:`compiled_transposes`)."""

    passes: tuple[TransposePass, ...] = ()

    @property
    def kernels(self) -> int:
        """Kernel executions per step."""
        return sum(p.count for p in self.passes)

    @property
    def moved_bytes(self) -> float:
        """Bytes read and written per step: each kernel's written and read bytes times its executions."""
        return sum((p.bytes + p.read_bytes) * p.count for p in self.passes)

    def compiled(self) -> CompiledTransposes:
        """The workload's summary of them: bytes and executions of the kernels the fusion estimate prices as free
        (``moves_only``), bytes of those whose bytes it prices at the plain pass (they compute, or hold a move it
        prices)."""
        moves = [p for p in self.passes if p.moves_only]
        return CompiledTransposes(moved_bytes=Transposes(passes=tuple(moves)).moved_bytes,
                                  kernels=sum(p.count for p in moves),
                                  fused_bytes=self.moved_bytes - Transposes(passes=tuple(moves)).moved_bytes)


def with_transposes(workload: Workload, text: str) -> Workload:
    """``workload`` with the transposing kernels of its compiled step (``text``: the optimized HLO of the same step,
    compiled for the same mesh), which testbed.sim.graph.traced_graph prices where the topology measured a
    transposing pass."""
    return replace(workload, transposes=compiled_transposes(text).compiled())


def _parse(text: str) -> tuple[dict[str, list[_Instr]], str]:
    """Computations of the module: name -> instructions in order; and the entry's name."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current, entry = header.group(2), header.group(2) if header.group(1) else entry
            comps[current] = []
            continue
        m = _INSTRUCTION.match(line)
        if m is None or current is None:
            continue
        root, name, shape, opcode, rest = m.groups()
        array = _ARRAY.match(shape)
        dtype, dims, layout = (array.group(1), array.group(2), array.group(3) or "") if array else ("", "", "")
        depth, end = 1, 0
        for end, ch in enumerate(rest):  # the operand list ends at its matching parenthesis
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                break
        comps[current].append(_Instr(name, dtype, tuple(int(d) for d in dims.split(",") if d),
                                     tuple(int(d) for d in layout.split(",") if d), opcode,
                                     tuple(re.findall(r"%([\w.\-]+)", rest[:end])), rest[end:], bool(root)))
    return comps, entry


def _offset(instr: _Instr, index: tuple[int, ...]) -> int:
    """The physical offset of logical ``index`` in ``instr``'s layout (minor-to-major; none: row-major)."""
    order = instr.layout or tuple(range(len(instr.dims) - 1, -1, -1))
    offset, stride = 0, 1
    for d in order:
        offset += index[d] * stride
        stride *= instr.dims[d]
    return offset


def _index(instr: _Instr, offset: int, physical: bool) -> tuple[int, ...]:
    """The logical index at ``offset`` of ``instr``: physical (its layout) or row-major (a reshape's view)."""
    order = (instr.layout or tuple(range(len(instr.dims) - 1, -1, -1))) if physical else \
        tuple(range(len(instr.dims) - 1, -1, -1))
    out = [0] * len(instr.dims)
    for d in order:
        out[d], offset = offset % max(1, instr.dims[d]), offset // max(1, instr.dims[d])
    return tuple(out)


def _ints(attrs: str, key: str) -> tuple[int, ...]:
    m = re.search(key + r"=\{([\d,]*)\}", attrs)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def _operand_index(instr: _Instr, k: int, index: tuple[int, ...], by: dict[str, _Instr]) -> tuple[int, ...] | None:
    """The index of operand ``k`` that result element ``index`` of ``instr`` reads (None: not followed)."""
    op = instr.opcode
    source = by.get(instr.operands[k]) if k < len(instr.operands) else None
    if source is None or not source.dims and op != "parameter":
        return None
    if op in _ELEMENTWISE:
        return index if source.dims == instr.dims else None
    if op == "transpose":
        out = [0] * len(index)
        for i, p in enumerate(_ints(instr.attrs, "dimensions")):
            out[p] = index[i]
        return tuple(out)
    if op in ("bitcast", "reshape"):
        flat = _offset(instr, index) if op == "bitcast" else _offset(
            _Instr("", "", instr.dims, (), "", (), "", False), index)
        return _index(source, flat, physical=op == "bitcast")
    if op == "reverse":
        flip = set(_ints(instr.attrs, "dimensions"))
        return tuple(source.dims[d] - 1 - i if d in flip else i for d, i in enumerate(index))
    if op == "slice":
        starts = [int(s) for s in re.findall(r"\[(\d+):", instr.attrs)]
        steps = [int(s) if s else 1 for s in re.findall(r"\[\d+:\d+(?::(\d+))?\]", instr.attrs)]
        return tuple(st + i * sp for st, i, sp in zip(starts, index, steps)) if len(starts) == len(index) else None
    if op == "dynamic-slice" and k == 0 or op == "dynamic-update-slice" and k == 1:
        return index  # offsets unknown: a constant shift, which moves no stride
    return None


def _strided(fused: list[_Instr], elements: int) -> tuple[int, int, int] | None:
    """Whether a fused computation's result reads an operand of at least ``elements`` elements with a stride: the
    size of the result's minor dimension, the stride (elements) and the element bytes of the first such operand,
    else None (module docstring)."""
    by = {i.name: i for i in fused}
    roots = [i for i in fused if i.root]
    if not roots:
        return None
    results = [by[n] for n in roots[0].operands if n in by] if roots[0].opcode == "tuple" else roots
    for result in results:
        written = _written(result, by)
        minor = next((d for d in (result.layout or range(len(result.dims) - 1, -1, -1)) if result.dims[d] > 1), None)
        if minor is None or math.prod(written.dims) < 2:
            continue
        start = tuple(0 for _ in result.dims)
        step = tuple(int(d == minor) for d in range(len(result.dims)))
        found = _read_strides(result, (start, step), by, 0)
        for param, (a, b) in found:
            if math.prod(param.dims) >= min(elements, math.prod(written.dims)) and abs(_offset(param, b) -
                                                                                      _offset(param, a)) != 1:
                return result.dims[minor], abs(_offset(param, b) - _offset(param, a)), element_bytes(param.dtype)
    return None


def _read_strides(instr: _Instr, pair: tuple, by: dict[str, _Instr], depth: int) -> list:
    """The fusion parameters ``instr``'s elements ``pair`` read, each with the pair of its indices they read."""
    if instr.opcode == "parameter":
        return [(instr, pair)]
    if depth > 64:
        return []
    out = []
    operands = (1,) if instr.opcode == "dynamic-update-slice" else range(len(instr.operands))
    for k in operands:
        a, b = (_operand_index(instr, k, p, by) for p in pair)
        if a is not None and b is not None:
            out += _read_strides(by[instr.operands[k]], (a, b), by, depth + 1)
    return out


def compiled_transposes(text: str) -> Transposes:
    """The transposing kernels of one device's compiled step (module docstring): ``text`` is the optimized HLO of an
    SPMD-partitioned program (every device runs it)."""
    comps, entry = _parse(text)
    schedule_comps = hlo_schedule.computations(text)
    found: list[TransposePass] = []

    def walk(name: str, times: int, seen: tuple[str, ...]) -> None:
        by = {i.name: i for i in comps.get(name, ())}
        for instr in comps.get(name, ()):
            if instr.opcode == "while":
                body = re.search(r"body=%([\w.\-]+)", instr.attrs)
                condition = re.search(r"condition=%([\w.\-]+)", instr.attrs)
                trips = hlo_schedule.trip_count(instr.attrs, schedule_comps, condition and condition.group(1))
                if body and body.group(1) not in seen:
                    walk(body.group(1), times * trips, seen + (name,))
                continue
            if instr.opcode == "conditional":
                for branch in re.findall(r"%([\w.\-]+)", instr.attrs.split("branch_computations=")[-1].split("}")[0]):
                    if branch in comps and branch not in seen:
                        walk(branch, times, seen + (name,))
                continue
            tile = _kernel_tile(instr, by, comps)
            if tile is not None:
                found.append(TransposePass(name=instr.name, bytes=tile[0], read_bytes=tile[1], count=times,
                                           minor=tile[2], moves_only=tile[3]))

    walk(entry, 1, ())
    return Transposes(passes=tuple(found))


def _kernel_tile(instr: _Instr, by: dict[str, _Instr], comps: dict
                 ) -> tuple[float, float, tuple[int, int], bool] | None:
    """A top-level instruction's written and read bytes, its minor size and stride and whether it only moves data,
    where it is a transposing kernel; else None."""
    if instr.opcode in ("copy", "transpose"):
        source = by.get(instr.operands[0]) if instr.operands else None
        if source is None or not instr.dims:
            return None
        param = _Instr("p", source.dtype, source.dims, source.layout, "parameter", (), "", False)
        fused = [param, _Instr(instr.name, instr.dtype, instr.dims, instr.layout, instr.opcode, ("p",), instr.attrs,
                               True)]
    elif instr.opcode == "fusion" and "kind=kLoop" in instr.attrs and "__ynn" not in instr.attrs:
        called = re.search(r"calls=%([\w.\-]+)", instr.attrs)
        fused = comps.get(called.group(1), []) if called else []
        if any(i.opcode in ("dot", "convolution") for i in fused):
            return None
    else:
        return None
    by_name = {i.name: i for i in fused}
    result = next((i for i in fused if i.root), None)
    if result is None:
        return None
    outputs = [_written(by_name[n], by_name) for n in result.operands if n in by_name] \
        if result.opcode == "tuple" else [_written(result, by_name)]
    tile = _strided(fused, min((math.prod(o.dims) for o in outputs), default=1))
    if tile is None:
        return None
    elements = sum(math.prod(o.dims) for o in outputs)
    return (float(sum(math.prod(o.dims) * element_bytes(o.dtype) for o in outputs)), float(elements * tile[2]),
            tile[:2], all(i.opcode in _MOVES and i.opcode not in _PRICED_MOVES for i in fused))


def _written(result: _Instr, by: dict[str, _Instr]) -> _Instr:
    """What a fusion's result writes: a dynamic-update-slice's update (in place; reached through bitcasts), else the
    result itself."""
    value = result
    while value.opcode == "bitcast" and value.operands and value.operands[0] in by:
        value = by[value.operands[0]]
    if value.opcode == "dynamic-update-slice" and len(value.operands) > 1 and value.operands[1] in by:
        return by[value.operands[1]]
    return result
