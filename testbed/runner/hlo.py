"""Check the compiled program: does the optimized HLO hold the collectives the plan implies?

A plan's mesh implies communication: gradient reduction over ``data`` (an
all-reduce, or a reduce-scatter under ZeRO-2/3), parameter gathers over
``fsdp`` and for ZeRO (all-gather), Megatron's all-reduces over ``tensor``,
activation transfers between ``stage`` s (a collective-permute inside a
program, or cross-mesh transfers between per-stage programs), and ring
attention's K/V sends over ``context`` (collective-permutes). The counts come
from the text of ``jitted.lower(...).compile().as_text()``; async pairs
(``all-reduce-start``/``-done``) count once. Also the device groups of each
compiled collective mapped to mesh axes (:func:`compiled_axes`) and its bytes per
device (:func:`compiled_bytes`), to compare with check-sharding's. Pure text
processing, no JAX.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np

from testbed.plan.spec import Plan
from testbed.plan.sharding import state_sharding
from testbed.sim.xla.workload import element_bytes

__all__ = ["COLLECTIVES", "count_collectives", "expected_collectives", "check_collectives", "replica_groups",
           "varying_dims", "compiled_axes", "compiled_bytes", "compiled_calls"]

#: HLO collective op names counted in compiled programs.
COLLECTIVES: tuple[str, ...] = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")

#: Pseudo-op for transfers between per-stage programs (not visible inside any one program).
TRANSFER = "cross-mesh-transfer"

_OP = re.compile(r"=\s*[^=]*?\b(" + "|".join(COLLECTIVES) + r")(-start)?\(")


def count_collectives(hlo_texts: Iterable[str]) -> dict[str, int]:
    """Instructions of each collective kind over several optimized HLO module texts."""
    counts = {name: 0 for name in COLLECTIVES}
    for text in hlo_texts:
        for line in text.splitlines():
            match = _OP.search(line)
            if match:
                counts[match.group(1)] += 1
    return counts


def expected_collectives(plan: Plan) -> list[str]:
    """What the plan's mesh implies, one ``axis: op|op`` entry per communicating axis.

    Any op of an entry satisfies it (XLA may pick either form of a reduction).
    """
    mesh = plan.mesh
    out = []
    if mesh.data > 1:
        out.append("data: all-reduce|reduce-scatter")
    if state_sharding(plan).split_axes(plan, "optimizer"):  # sharded state is gathered for use
        out.append(f"{'fsdp' if mesh.fsdp > 1 else 'zero'}: all-gather")
    if mesh.tensor > 1:  # sequence parallelism: a reduce-scatter after each row-parallel matmul instead
        out.append("tensor: reduce-scatter" if plan.sequence_parallel else "tensor: all-reduce")
    if mesh.stage > 1:
        out.append(f"stage: collective-permute|{TRANSFER}")
    if mesh.context > 1:  # ring attention: K/V (and dK/dV) passed around the context ring (testbed.runner.ring_attention)
        out.append("context: collective-permute")
    if mesh.expert > 1 and any(plan.model.is_moe_layer(i) for i in range(plan.model.layers)):
        # MoE dispatch and combine of the routed experts' tokens (testbed.runner.moe)
        out.append("expert: all-to-all")
    return out


def check_collectives(plan: Plan, hlo_texts: Iterable[str], transfers: int = 0) -> dict[str, Any]:
    """``{expected: [...], found: {op: count}, missing: [...], ok}`` for the plan's compiled programs."""
    found = count_collectives(hlo_texts)
    found[TRANSFER] = int(transfers)
    expected = expected_collectives(plan)
    missing = [entry for entry in expected
               if not any(found.get(op, 0) > 0 for op in entry.split(": ", 1)[1].split("|"))]
    return {"expected": expected, "found": found, "missing": missing, "ok": not missing}


# -- replica groups and bytes of a compiled SPMD program --------------------------------------------

def varying_dims(groups: list[list[int]], shape: tuple[int, ...]) -> list[int]:
    """Indices of the mesh dims along which some group's members differ (device ``i``: row-major coordinate)."""
    if len({len(g) for g in groups}) == 1:  # equal groups (every SPMD collective): vectorised, 4096 groups at once
        coords = np.array(np.unravel_index(np.asarray(groups), shape))  # (mesh dims, groups, members)
        return [int(i) for i in np.flatnonzero((coords.max(axis=2) != coords.min(axis=2)).any(axis=1))]
    varying: set[int] = set()
    for group in groups:
        coords = np.array(np.unravel_index(group, shape)).T
        varying |= {i for i in range(len(shape)) if len(set(coords[:, i].tolist())) > 1}
    return sorted(varying)


_HLO_OP = re.compile(r"=\s*[^=]*?\b(all-reduce|reduce-scatter|all-gather|collective-permute|all-to-all)(-start)?\(")
_HLO_RESULT = re.compile(r"=\s*(.*?)\s*\b(?:all-reduce|reduce-scatter|all-gather|collective-permute|all-to-all)"
                         r"(?:-start)?\(")
_HLO_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def _iota(dims: str, perm: str | None) -> np.ndarray:
    ids = np.arange(math.prod(int(d) for d in dims.split(","))).reshape([int(d) for d in dims.split(",")])
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def replica_groups(line: str, devices: int) -> list[list[int]] | None:
    """The device groups of one compiled HLO collective instruction (partition ids), or None if it has none.

    Reads the explicit ``{{0,1},{2,3}}`` list, the iota form
    ``[G,S]<=[dims]T(perm)``, the mesh form ``mesh['a'=2,...] {'a'}`` (with
    optional ``device_ids``), ``{}`` (all devices) and a collective-permute's
    ``source_target_pairs``.
    """
    explicit = re.search(r"(?:replica_groups|source_target_pairs)=\{(\{[\d,{} ]*\})\}", line)
    if explicit:
        return [[int(x) for x in g.split(",")] for g in re.findall(r"\{([\d, ]+)\}", explicit.group(1))]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        return _iota(iota.group(3), iota.group(4)).reshape(int(iota.group(1)), int(iota.group(2))).tolist()
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? "
                     r"\{([^}]*)\}", line)
    if mesh:
        axes = re.findall(r"'(\w+)'=(\d+)", mesh.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        ids = (_iota(mesh.group(2), mesh.group(3)) if mesh.group(2) else np.arange(math.prod(sizes))).reshape(sizes)
        grouped = [names.index(a) for a in re.findall(r"'(\w+)'", mesh.group(4))]
        rest = [i for i in range(len(names)) if i not in grouped]
        return ids.transpose(rest + grouped).reshape(-1, math.prod(sizes[i] for i in grouped)).tolist()
    if "replica_groups={}" in line:
        return [list(range(devices))]
    return None


def compiled_axes(hlo_text: str, mesh_shape: tuple[int, ...], axis_names: tuple[str, ...]) -> Counter:
    """``(axes, kind) -> instructions`` of a compiled SPMD program's HLO (``compiled.as_text()``).

    Partition ``i`` is the mesh's ``i``-th device in row-major order; a
    group spans the axes along which its members' coordinates differ (an
    instruction without readable groups counts under ``"?"``). Async pairs
    count once; counts are instructions, not executions.
    """
    found: Counter = Counter()
    for _, _, kind, _, axes in _compiled_collectives(hlo_text, mesh_shape, axis_names):
        found[(axes, kind)] += 1
    return found


def _compiled_collectives(hlo_text: str, mesh_shape: tuple[int, ...], axis_names: tuple[str, ...]):
    """Each collective instruction of a compiled program: (line, match, kind, groups or None, axes: the mesh
    axes its groups vary along joined by ``+``, ``"?"`` where the groups are unreadable)."""
    devices = math.prod(mesh_shape)
    for line in hlo_text.splitlines():
        match = _HLO_OP.search(line)
        if not match:
            continue
        groups = replica_groups(line, devices)
        axes = "?" if groups is None else "+".join(axis_names[i] for i in varying_dims(groups, mesh_shape))
        yield line, match, match.group(1), groups, axes


def _array_bytes(types: str) -> list[int]:
    """Bytes of each array of an HLO result type: one array ``f32[4,8]{1,0}`` or a tuple of them."""
    return [math.prod(int(d) for d in dims.split(",") if d) * element_bytes(element)
            for element, dims in _HLO_ARRAY.findall(types)]


def _hlo_bytes(types: str) -> int:
    """Bytes of an HLO result type: one array or a tuple of them (a combined collective)."""
    return sum(_array_bytes(types))


def compiled_bytes(hlo_text: str, mesh_shape: tuple[int, ...], axis_names: tuple[str, ...]) -> Counter:
    """``(axes, kind) -> bytes per device`` of a compiled SPMD program's collectives, each executed once.

    The nccl-tests convention of the module doc, read from each instruction's
    per-device result type (summed over a combined op's tuple): the buffer
    for all-reduce, all-to-all and collective-permute, the gathered buffer
    for all-gather, the result times the group for reduce-scatter (its
    whole input). For programs without loops (an instruction in a while
    body would run its trip count); asynchronous ``-start`` forms are not
    read (XLA:CPU emits none).
    """
    found: Counter = Counter()
    for line, match, kind, groups, axes in _compiled_collectives(hlo_text, mesh_shape, axis_names):
        if match.group(2):
            raise ValueError(f"asynchronous collective not supported here: {line.strip()[:120]}")
        if groups is not None and max(len(g) for g in groups) == 1:
            continue  # groups of one device move nothing
        size = _hlo_bytes(_HLO_RESULT.search(line).group(1))
        if kind == "reduce-scatter":
            size *= max(len(g) for g in groups) if groups else 1
        found[(axes, kind)] += size
    return found


def compiled_calls(hlo_text: str, mesh_shape: tuple[int, ...], axis_names: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each collective instruction of a compiled SPMD program, in the text's order: its kind, the mesh axes its
    groups span, its groups (partition ids; all devices where the text names none), their size and the bytes per
    device of each buffer (:func:`compiled_bytes`' convention).

    A combined instruction (a tuple of arrays, e.g. the data-parallel gradients' all-reduce) is one instruction
    but not one call: XLA:CPU's collective thunks call the communicator once per buffer
    (``xla/backends/cpu/runtime/all_reduce_thunk.cc``), so on gloo every buffer is a collective of its own, with
    its own fixed cost. Groups of one device (no traffic) are left out.
    """
    calls = []
    for line, match, kind, groups, axes in _compiled_collectives(hlo_text, mesh_shape, axis_names):
        if match.group(2):
            raise ValueError(f"asynchronous collective not supported here: {line.strip()[:120]}")
        group = max(len(g) for g in groups) if groups else math.prod(mesh_shape)
        if group == 1:
            continue
        buffers = _array_bytes(_HLO_RESULT.search(line).group(1))
        if kind == "reduce-scatter":
            buffers = [b * group for b in buffers]
        calls.append({"kind": kind, "axes": axes, "group": group, "buffers": buffers,
                      "groups": groups if groups is not None else [list(range(math.prod(mesh_shape)))]})
    return calls
