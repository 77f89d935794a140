"""A compiled program's collectives as XLA scheduled them: per mesh axis, executions, bytes, async pairs; fusions.

Reads the text of ``jitted.lower(...).compile().as_text()`` (an optimized,
scheduled HLO module: instructions of each computation in execution order).
Each collective instruction is mapped to the mesh axes its replica groups
span (:func:`testbed.runner.hlo.replica_groups`, partition ``i`` is the
mesh's ``i``-th device in row-major order) and counted as often as it runs
per program run: an instruction in a ``while`` body runs the loop's trip
count (``known_trip_count`` of its backend config, else the one integer
constant its condition compares with), one in a called computation as often
as it is called. Asynchronous collectives (XLA:TPU's latency-hiding
scheduler: ``all-gather-start`` ... ``all-gather-done``, or a collective
inside an ``async-start``/``async-done`` wrapper) count once, and the
instructions scheduled between start and done are reported: what the
collective can overlap with.

XLA:TPU's async collective fusion (libtpu's
``xla_tpu_enable_async_collective_fusion`` with ``..._fuse_all_gather`` and
``..._multiple_steps``, the flags MaxText's TPU configs set) splits one
collective into a chain: a fusion whose root is the custom call
``AsyncCollectiveStart``, steps fused into the compute that runs meanwhile
(in a ``while`` body too: the flash-attention loop), and a fusion whose root
is ``AsyncCollectiveDone``; each holds a copy of the collective instruction
with the chain's ``chain_id`` frontend attribute. A chain is one collective,
counted at its start (as often as the start runs, asynchronous, overlapping
the instructions up to its done); the copies in its steps and done move
nothing more.

XLA:TPU also emits some reduce-scatters as an all-reduce-scatter fusion:
its reduce-scatter decomposer (after layout assignment) rewrites the
reduce-scatter as an all-reduce and a dynamic-slice, which the all-reduce
scatter fusion then emits as one reduce-scatter (a ``kCustom`` fusion whose
backend config names the emitter ``SingleInputAllReduceScatterFusion``,
the emitter of XLA:TPU's native reduce-scatters too): the input padded to
whole shards, reduced and scattered, each device's shard then completed by
a collective-permute of the padded rows from its neighbour and a slice. Such a
fusion counts as the reduce-scatter it is (its bytes the fusion's input,
unpadded), and the collective-permutes of slices of its output as its
fix-ups (``fixup_bytes`` of its row), not as collectives of their own.

Bytes follow :mod:`testbed.runner.hlo` (the nccl-tests convention): per
device, the buffer of an all-reduce, all-to-all or collective-permute, the
gathered buffer of an all-gather, the whole input (result times group) of a
reduce-scatter; an async collective's bytes are read from its ``-done``
result (the output). Groups of one device move nothing and are left out.
Pure text processing, no JAX.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

from testbed.runner.hlo import _array_bytes, replica_groups, varying_dims

__all__ = ["HloCollective", "AxisCollectives", "Computation", "computations", "multiplicities", "collectives",
           "per_axis", "fusion_count"]

_KINDS = "all-reduce|reduce-scatter|all-gather|collective-permute|all-to-all"
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_COLLECTIVE = re.compile(r"=\s*(.*?)\s*\b(" + _KINDS + r")(-start)?\(")
_DONE = re.compile(r"=\s*(.*?)\s*\b(?:" + _KINDS + r")-done\(%?([\w.\-]+)")
_ASYNC_START = re.compile(r"\basync-start\(.*?\bcalls=%?([\w.\-]+)")
_ASYNC_DONE = re.compile(r"\basync-done\(%?([\w.\-]+)")
_CALLEES = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CONSTANT = re.compile(r"s(?:32|64)\[\](?:\{[^}]*\})?\s*constant\((\d+)\)")
_CHAIN = re.compile(r'\bchain_id="(\d+)"')
_FUSION_CALL = re.compile(r"\bfusion\(.*?\bcalls=%?([\w.\-]+)")
_CHAIN_START, _CHAIN_DONE = 'custom_call_target="AsyncCollectiveStart"', 'custom_call_target="AsyncCollectiveDone"'
_SCATTER_FUSION = re.compile(r"\bfusion\(.*?\bkind=kCustom\b.*?\bcalls=%?([\w.\-]+).*?\"emitter\":\"\w*AllReduceScatterFusion\"")
_PARAMETER = re.compile(r"=\s*(.*?)\s*\bparameter\(\d+\)")
_OPERAND = re.compile(r"\b(?:" + _KINDS + r")(?:-start)?\(%?([\w.\-]+)")
_SLICE_OF = re.compile(r"\bslice\(%?([\w.\-]+)\)")


@dataclass(frozen=True, slots=True, kw_only=True)
class Computation:
    """One HLO computation: its name, whether it is the entry, and its instruction lines in schedule order."""

    name: str
    entry: bool
    lines: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class HloCollective:
    """One collective instruction of a compiled program.

    ``bytes`` is per device per execution; ``executions`` how often one program run executes it;
    ``overlap`` the instructions scheduled between its start and done (None: synchronous).
    """

    name: str
    kind: str
    axes: str
    group: int
    bytes: int
    executions: int
    computation: str
    position: int
    overlap: int | None = None
    #: A fix-up collective-permute of an all-reduce-scatter fusion (module doc): that reduce-scatter's name.
    fixes: str | None = None

    def __post_init__(self) -> None:
        if self.group < 2 or self.bytes < 0 or self.executions < 0:
            raise ValueError(f"{self.name}: group {self.group}, bytes {self.bytes}, executions {self.executions}")

    @property
    def asynchronous(self) -> bool:
        return self.overlap is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class AxisCollectives:
    """The collectives of one kind over one set of mesh axes: executions, instructions and bytes per device."""

    axes: str
    kind: str
    group: int
    count: int
    instructions: int
    bytes: int
    asynchronous: int
    overlap: int
    #: Bytes per device of the collective-permutes completing all-reduce-scatter fusions' shards (module doc).
    fixup_bytes: int = 0

    def to_dict(self) -> dict:
        out = {"axes": self.axes, "kind": self.kind, "group": self.group, "count": self.count,
               "instructions": self.instructions, "bytes": self.bytes, "async": self.asynchronous,
               "overlapped_instructions": self.overlap}
        return {**out, "fixup_bytes": self.fixup_bytes} if self.fixup_bytes else out


def computations(text: str) -> dict[str, Computation]:
    """The module's computations by name, each with its instruction lines in order."""
    out: dict[str, Computation] = {}
    name, entry, lines = None, False, []
    for line in text.splitlines():
        if name is None:
            header = _HEADER.match(line)
            if header and not line.startswith(("HloModule", " ")):
                name, entry, lines = header.group(2), bool(header.group(1)), []
        elif line.strip() == "}":
            out[name] = Computation(name=name, entry=entry, lines=tuple(lines))
            name = None
        elif line.strip():
            lines.append(line)
    return out


def trip_count(line: str, comps: dict[str, Computation], condition: str | None) -> int:
    """A while loop's trip count: its known_trip_count, else the one integer constant of its condition, else 1."""
    known = _TRIP.search(line)
    if known:
        return int(known.group(1))
    if condition in comps:
        constants = {int(c) for ln in comps[condition].lines for c in _CONSTANT.findall(ln)}
        if len(constants) == 1:
            return constants.pop()
    return 1


def _callees(line: str, comps: dict[str, Computation]) -> Iterator[tuple[str, int]]:
    """(computation called, times per execution of ``line``) for each computation the instruction calls."""
    found = dict((role, callee) for role, callee in _CALLEES.findall(line))
    trips = trip_count(line, comps, found.get("condition")) if "body" in found else 1
    for role, callee in found.items():
        yield callee, trips if role in ("body", "condition") else 1
    branches = _BRANCHES.search(line)
    if branches:
        for callee in re.findall(r"%?([\w.\-]+)", branches.group(1)):
            yield callee, 1


def multiplicities(comps: dict[str, Computation]) -> dict[str, int]:
    """Executions of each computation per program run (the entry once; summed over its callers)."""
    calls: dict[str, list[tuple[str, int]]] = {name: [] for name in comps}
    for comp in comps.values():
        for line in comp.lines:
            for callee, times in _callees(line, comps):
                if callee in calls:
                    calls[callee].append((comp.name, times))
    memo: dict[str, int] = {}

    def runs(name: str, seen: frozenset = frozenset()) -> int:
        if name not in memo:
            if comps[name].entry:
                memo[name] = 1
            else:
                memo[name] = sum(runs(caller, seen | {name}) * times
                                 for caller, times in calls[name] if caller not in seen)
        return memo[name]

    return {name: runs(name) for name in comps}


def _async_wrappers(comps: dict[str, Computation]) -> dict[str, tuple[str, int, int | None]]:
    """Computation run by an ``async-start`` -> (its caller, the start's position, instructions until the done)."""
    out = {}
    for comp in comps.values():
        names = [(_NAME.match(line) or [None, None])[1] for line in comp.lines]
        for i, line in enumerate(comp.lines):
            start = _ASYNC_START.search(line)
            if not start:
                continue
            done = next((j for j in range(i + 1, len(comp.lines))
                         if (m := _ASYNC_DONE.search(comp.lines[j])) and m.group(1) == names[i]), None)
            out[start.group(1)] = (comp.name, i, None if done is None else done - i - 1)
    return out


def _chain_wrappers(comps: dict[str, Computation]) -> tuple[dict[str, tuple[str, int, int | None]], set[str]]:
    """XLA:TPU's async collective fusion chains: the fused computation of each chain's ``AsyncCollectiveStart`` ->
    (its caller, the start's position, instructions until the chain's done in that caller, if there), and the
    fused computations of the chains' steps and dones (their collectives are the start's, not counted again)."""
    calls = {}
    for comp in comps.values():
        for i, line in enumerate(comp.lines):
            fused = _FUSION_CALL.search(line)
            if fused:
                calls[fused.group(1)] = (comp.name, i)
    starts, dones, steps = {}, {}, set()
    for comp in comps.values():
        body = "\n".join(comp.lines)
        chain = _CHAIN.search(body) if "async_collective_fusion_config" in body else None
        if chain is None or comp.name not in calls:
            continue
        if _CHAIN_START in body:
            starts[chain.group(1)] = comp.name
        else:
            steps.add(comp.name)
            if _CHAIN_DONE in body:
                dones[chain.group(1)] = calls[comp.name]
    out = {}
    for chain, name in starts.items():
        caller, i = calls[name]
        done = dones.get(chain)
        out[name] = (caller, i, done[1] - i - 1 if done and done[0] == caller and done[1] > i else None)
    return out, steps


def _scatter_fusions(comps: dict[str, Computation]) -> dict[str, tuple[str, int, str, int]]:
    """XLA:TPU's all-reduce-scatter fusions (module doc): the fused computation -> (its caller, the fusion's
    position there, the fusion instruction's name, its input's bytes per device)."""
    out = {}
    for comp in comps.values():
        for i, line in enumerate(comp.lines):
            fused = _SCATTER_FUSION.search(line)
            if fused and fused.group(1) in comps:
                inputs = [m.group(1) for m in map(_PARAMETER.search, comps[fused.group(1)].lines) if m]
                out[fused.group(1)] = (comp.name, i, _NAME.match(line).group(1), sum(map(_bytes_of, inputs)))
    return out


def _bytes_of(types: str) -> int:
    return sum(_array_bytes(types))


def _fixed(line: str, lines: dict[str, str], fusions: set[str]) -> str | None:
    """The all-reduce-scatter fusion (of ``fusions``' names) a collective-permute ``line`` completes: its operand a
    slice of the fusion's output (``lines``: the computation's instructions by name); else None."""
    operand = _OPERAND.search(line)
    sliced = _SLICE_OF.search(lines.get(operand.group(1), "")) if operand else None
    return sliced.group(1) if sliced and sliced.group(1) in fusions else None


def collectives(text: str, mesh_shape: tuple[int, ...], axis_names: tuple[str, ...]) -> list[HloCollective]:
    """Every collective of a compiled program moving bytes, in schedule order per computation (an async collective
    fusion chain once, at its start; an all-reduce-scatter fusion as its reduce-scatter, module doc)."""
    comps = computations(text)
    runs = multiplicities(comps)
    chains, steps = _chain_wrappers(comps)
    wrappers = {**_async_wrappers(comps), **chains}
    scatters = _scatter_fusions(comps)
    fusions = {name for _, _, name, _ in scatters.values()}
    devices = math.prod(mesh_shape)
    out = []
    for comp in comps.values():
        if comp.name in steps:
            continue
        names = [(_NAME.match(line) or [None, None])[1] for line in comp.lines]
        by_name = dict(zip(names, comp.lines))
        for i, line in enumerate(comp.lines):
            match = _COLLECTIVE.search(line)
            if not match:
                continue
            groups = replica_groups(line, devices)
            group = max(len(g) for g in groups) if groups else devices
            if group < 2:
                continue
            axes = "?" if groups is None else "+".join(axis_names[k] for k in varying_dims(groups, mesh_shape))
            types, overlap, where, position, kind, name = match.group(1), None, comp.name, i, match.group(2), names[i]
            if match.group(3):  # X-start ... X-done: the output type is the done's result
                done = next((j for j in range(i + 1, len(comp.lines))
                             if (m := _DONE.search(comp.lines[j])) and m.group(2) == names[i]), None)
                if done is not None:
                    types, overlap = _DONE.search(comp.lines[done]).group(1), done - i - 1
            elif comp.name in wrappers:
                where, position, overlap = wrappers[comp.name]
            size = _bytes_of(types) * (group if kind == "reduce-scatter" else 1)
            if comp.name in scatters:  # the reduce-scatter an all-reduce-scatter fusion emits
                where, position, name, size = scatters[comp.name]
                kind = "reduce-scatter"
            fixes = _fixed(line, by_name, fusions) if kind == "collective-permute" else None
            out.append(HloCollective(name=name or f"{comp.name}:{i}", kind=kind, axes=axes, group=group, bytes=size,
                                     executions=runs.get(where, 1), computation=where, position=position,
                                     overlap=overlap, fixes=fixes))
    return out


def per_axis(found: list[HloCollective]) -> list[AxisCollectives]:
    """Per (axes, kind): executions per program run, instructions, bytes per device, async ones, overlap; the
    fix-ups of all-reduce-scatter fusions in their reduce-scatter's row (``fixup_bytes``), not rows of their own."""
    rows: dict[tuple[str, str], dict] = {}
    fixed = {c.name: (c.axes, c.kind) for c in found}
    for c in found:
        if c.fixes is not None:
            continue
        row = rows.setdefault((c.axes, c.kind), {"group": c.group, "count": 0, "instructions": 0, "bytes": 0,
                                                 "asynchronous": 0, "overlap": 0, "fixup_bytes": 0})
        row["count"] += c.executions
        row["instructions"] += 1
        row["bytes"] += c.bytes * c.executions
        row["asynchronous"] += c.asynchronous
        row["overlap"] += c.overlap or 0
        row["group"] = max(row["group"], c.group)
    for c in found:
        if c.fixes is not None:
            rows[fixed[c.fixes]]["fixup_bytes"] += c.bytes * c.executions
    return [AxisCollectives(axes=a, kind=k, **row) for (a, k), row in sorted(rows.items())]


def fusion_count(text: str) -> dict[str, int]:
    """Fusion instructions of the program: ``instructions`` in its text, ``executions`` per run (loops counted)."""
    comps = computations(text)
    runs = multiplicities(comps)
    static = executed = 0
    for comp in comps.values():
        n = sum(1 for line in comp.lines if re.search(r"=\s*.*?\bfusion\(", line))
        static += n
        executed += n * runs.get(comp.name, 0)
    return {"instructions": static, "executions": executed}
