"""What XLA:TPU holds at a training step's live peak, by kind, beside testbed's own buffers (ground truth, recorded).

``--collect`` compiles recorded plans of ``benchmarks/xla_tpu/`` again with ``--xla_dump_to`` (the runner's step,
``memory_vs_xla_tpu.py --one``, one subprocess per plan, stopped once the buffer assignment is written:
benchmarks/xla_tpu_heap.py's ``collect_one`` pattern) and reads the training step's after-optimizations buffer
assignment, live ranges and HLO. Per plan it records, in ``benchmarks/xla_tpu_probes/peak_buffers.json`` with the
date, the command and the libtpu version:

- ``heap``, ``live`` and the instruction of the live peak (the default memory space's preallocated temporaries,
  the union of the live values' ``[offset, offset + size)``: benchmarks/xla_tpu_heap.py's reading);
- ``at_peak``: the heap's bytes live at the peak by kind (:func:`kind`), and its six largest values (bytes, offset,
  live range, kind, the HLO op and the JAX op name's tail);
- ``top``: the value of 1 MiB or more that reaches highest in the heap, where the placement sets its size (within
  5% of it: smaller values, a few bytes each of them, lie above);
- ``vmem``: the on-chip memory space's preallocated temporaries (``color 1``, XLA:TPU's alternate memory: a
  TPU's VMEM), and every all-gather's output of 1 MiB or more by memory space (its count, smallest and largest,
  ``hbm`` and ``vmem``).

Without ``--collect`` it reads that file (no JAX) and prints ONE JSON object: per plan those, and testbed's own
buffers of the step (testbed.model.step_heap.step_buffers on the record's target, as the memory model lays them
out) at their live peak by kind (gathered weights, kept sets, workspace, gradients), with testbed's placed heap.

    PYTHONPATH=LIBTPU_SITE ALLOW_MULTIPLE_LIBTPU_LOAD=1 nice python benchmarks/xla_tpu_peak_buffers.py --collect --only NAME ...
    python benchmarks/xla_tpu_peak_buffers.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from xla_tpu_heap import RECORDS, _live_ranges, _temporaries, _union, compiled_dump  # noqa: E402

DATA = ROOT / "benchmarks" / "xla_tpu_probes" / "peak_buffers.json"
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%(\S+) = (\S+(?: \S+)*?) ([a-z][a-z0-9\-_]*)\((.*)$")
_SPACE_VALUE = re.compile(r" value: <\d+ (\S+?)(\{[^}]*\})? @(\d+)> \(size=(\d+),offset=(\d+)\)")
_ALLOCATION = re.compile(r"allocation (\d+): size (\d+), (.*)")
#: The kinds a heap value is read as (:func:`kind`), in the order they are tried.
KINDS = ("gathered", "reduction", "weight_gradient", "kept", "backward", "forward")


def hlo_ops(text: str) -> dict[str, tuple[str, str, str]]:
    """Each HLO instruction's (opcode, result shape, JAX op name from its metadata) by name."""
    out = {}
    for line in text.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            meta = re.search(r'op_name="([^"]*)"', match.group(4))
            out[match.group(1)] = (match.group(3), match.group(2), meta.group(1) if meta else "")
    return out


def kind(name: str, ops: dict[str, tuple[str, str, str]], span: tuple[int, int], backward_from: int) -> str:
    """What a heap value holds: ``gathered`` (an all-gather's output, or an async collective's, or a value the JAX op
    names as the all-gather: its relayout), ``reduction`` (an all-reduce's or reduce-scatter's output), and of the
    rest ``weight_gradient`` (written in the backward, rank 2: a weight matrix's shape, where activations carry a
    batch dim), ``kept`` (written before the backward's first instruction and read after it), ``backward`` and
    ``forward`` (the backward's and the forward's transients, the update's counted as backward's)."""
    base = name.split("{")[0]
    op, shape, op_name = ops.get(base, ("", "", ""))
    if op.startswith("all-gather") or base.startswith(("async-collective", "all_gather")) \
            or op in ("copy", "reshape") and op_name.endswith("/all_gather"):
        return "gathered"
    if op.startswith(("all-reduce", "reduce-scatter")) or base.startswith(("all-reduce", "reduce-scatter")):
        return "reduction"
    first, last = span
    if first >= backward_from and re.fullmatch(r"[a-z0-9]+\[\d+,\d+\]\{[^}]*\}", shape):
        return "weight_gradient"
    if first < backward_from <= last:
        return "kept"
    return "backward" if first >= backward_from else "forward"


def _sequence(live_range: str) -> list[str]:
    body = live_range.split("InstructionSequence:", 1)[1].split("BufferLiveRange", 1)[0]
    return [line.split(":", 1)[1] for line in body.splitlines() if ":" in line]


def _backward_from(sequence: list[str], ops: dict[str, tuple[str, str, str]]) -> int:
    """The backward's first instruction: the first scheduled matmul JAX names as a transpose's (an earlier
    instruction may carry a transpose's name: the token table's scatter-add, scheduled in the forward)."""
    return next((k for k, n in enumerate(sequence) if "transpose(" in ops.get(n, ("", "", ""))[2]
                 and ops[n][2].endswith("dot_general")), len(sequence))


def _gathers_by_space(assignment: str, ops: dict[str, tuple[str, str, str]]) -> dict[str, dict[str, int]]:
    """Every all-gather's (or async collective's) output of 1 MiB or more, by memory space (``hbm``: the default,
    ``vmem``: space 1): count, smallest and largest."""
    sizes: dict[str, dict[str, int]] = {"hbm": {}, "vmem": {}}
    for match in map(_SPACE_VALUE.match, assignment.splitlines()):
        if not match or int(match.group(4)) < 1 << 20 or match.group(3) not in ("0", "1"):
            continue
        name = match.group(1)
        if ops.get(name, ("",))[0].startswith("all-gather") or name.startswith("async-collective-done"):
            sizes[("hbm", "vmem")[int(match.group(3))]][name] = int(match.group(4))
    return {space: {"count": len(held), "smallest": min(held.values(), default=0),
                    "largest": max(held.values(), default=0)} for space, held in sizes.items()}


def _vmem_heap(assignment: str) -> int:
    sizes = [int(m.group(2)) for m in map(_ALLOCATION.match, assignment.splitlines())
             if m and "preallocated-temp" in m.group(3) and "color 1," in m.group(3)]
    return max(sizes, default=0)


def read_dump(folder: Path) -> dict:
    """The peak's view of the training step dumped in ``folder`` (the module docstring's fields)."""
    base = next(folder.glob("*jit_train_step*.after_optimizations-buffer-assignment.txt"))
    assignment = base.read_text()
    live_text = Path(str(base).replace("-buffer-assignment.txt", "-live-range.txt")).read_text()
    ops = hlo_ops(Path(str(base).replace("-buffer-assignment.txt", ".txt")).read_text())
    heap, values = _temporaries(assignment)
    ranges, sequence = _live_ranges(live_text), _sequence(live_text)
    backward_from = _backward_from(sequence, ops)
    at: dict[int, list[tuple[int, int, str]]] = {}
    for name, size, offset in values:
        first, last = ranges.get(name, (0, -1))
        for step in range(first, last + 1):
            at.setdefault(step, []).append((offset, size, name))
    peak = max(at, key=lambda s: _union([(o, o + z) for o, z, _ in at[s]]))
    held = {(o, z): n for o, z, n in sorted(at[peak]) if z}  # one slot held by several values counted once
    rows = sorted(((z, o, n, kind(n, ops, ranges[n], backward_from)) for (o, z), n in held.items()), reverse=True)
    by_kind = {k: sum(z for z, _, _, c in rows if c == k) for k in KINDS}
    top = max((v for v in values if v[1] >= 1 << 20), key=lambda v: (v[2] + v[1], v[1]))
    return {"heap": heap, "live": _union([(o, o + z) for o, z, _ in at[peak]]), "peak_instruction": sequence[peak],
            "peak_step": peak, "backward_from": backward_from, "steps": len(sequence), "at_peak": by_kind,
            "largest_at_peak": [_row(z, o, n, c, ranges, ops) for z, o, n, c in rows[:6]],
            "top": _row(top[1], top[2], top[0], kind(top[0], ops, ranges.get(top[0], (0, 0)), backward_from),
                        ranges, ops),
            "vmem": {"heap": _vmem_heap(assignment), "gathers": _gathers_by_space(assignment, ops)}}


def _row(size: int, offset: int, name: str, what: str, ranges: dict, ops: dict) -> dict:
    op, _, op_name = ops.get(name.split("{")[0], ("", "", ""))
    return {"bytes": size, "offset": offset, "live": list(ranges.get(name, (0, -1))), "kind": what, "value": name,
            "op": op, "op_name": "/".join(op_name.split("/")[-3:])}


def collect_one(name: str, wall: float) -> dict:
    """Compile ``name``'s recorded plan with the dump flags until its buffer assignment is written; read it."""
    return compiled_dump(name, wall, read_dump, "xla_tpu_peak_")


def collect(names: list[str], wall: float) -> dict:
    """Read each named plan's peak view; write :data:`DATA` atomically after each plan."""
    from testbed.runner.tpu_compile import versions

    data = json.loads(DATA.read_text()) if DATA.exists() else {"plans": {}}
    data["provenance"] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          "command": "python benchmarks/xla_tpu_peak_buffers.py --collect --only " + " ".join(names),
                          "versions": versions()}
    for name in names:
        data["plans"][name] = collect_one(name, wall)
        print(json.dumps({"plan": name, "at_peak": data["plans"][name]["at_peak"]}), file=sys.stderr, flush=True)
        tmp = DATA.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, DATA)
    return {"collected": names}


def testbed_view(name: str) -> dict:
    """testbed's own buffers of ``name``'s step (testbed.model.step_heap) at their live peak by kind, and the heap
    testbed.model.heap places them in; None where the memory model lays out no step (several microbatches, stages,
    or no XLA:TPU rules)."""
    from testbed.compiled.records import load_record
    from testbed.model import heap, step_heap
    from testbed.model.memory import memory_breakdown
    from testbed.topology.compile_target import target_topology

    record = load_record(RECORDS / f"{name}.json")
    seen: list = []
    original = step_heap.fragmentation
    step_heap.fragmentation = lambda plan, terms: seen.append((plan, terms)) or original(plan, terms)
    try:
        memory_breakdown(record.plan, target_topology(record.target))
    finally:
        step_heap.fragmentation = original
    if not seen:
        return {}
    plan, terms = seen[-1]
    kinds = step_heap.buffer_kinds(plan, terms)
    held = [b for b, _ in kinds]
    peak = max(range(max(b.end for b in held) + 1), key=lambda s: sum(b.size for b in held if b.start <= s <= b.end))
    by_kind: dict[str, int] = {}
    for b, what in kinds:
        if b.start <= peak <= b.end:
            by_kind[what] = by_kind.get(what, 0) + b.size
    placed = heap.heap(held)
    return {"heap": placed.size, "live": placed.live, "peak_instant": peak, "at_peak": by_kind}


def compare() -> dict:
    data = json.loads(DATA.read_text())
    return {"plans": {name: {"xla": view, "testbed": testbed_view(name)} for name, view in sorted(data["plans"].items())},
            "provenance": data.get("provenance")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collect", action="store_true", help="compile with XLA:TPU (needs libtpu) and record")
    parser.add_argument("--only", nargs="*", default=[], help="plan names to collect")
    parser.add_argument("--wall-limit", type=float, default=900.0, help="wall seconds one plan may take")
    args = parser.parse_args(argv)
    print(json.dumps(collect(args.only, args.wall_limit) if args.collect else compare()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
