"""XLA:TPU's heap beside its live peak and its reported temporaries, for the recorded compiles (ground truth).

``memory_analysis()`` reports a program's temporaries (``temp``); its buffer assignment places them in one
preallocated heap (the ``preallocated-temp`` allocation of the default memory space) whose size is the highest
offset any temporary reaches, and XLA's peak (``peak_memory``) is the arguments plus the most temporary bytes
live at once. ``--collect`` compiles each recorded plan of ``benchmarks/xla_tpu/`` again with
``--xla_dump_to`` (the runner's step, ``memory_vs_xla_tpu.py --one``, one subprocess per plan), reads the
training step's after-optimizations buffer assignment and live ranges as soon as XLA writes them (the compile is
stopped there: code generation does not change them), and records per plan the heap size and the most bytes
live at once (the union of the live temporaries' ``[offset, offset + size)`` at each scheduled instruction) in
``benchmarks/xla_tpu_heap.json`` with the date, the command and the libtpu version. Needs libtpu on
``PYTHONPATH``.

Without ``--collect`` it reads that file and the records (no JAX) and prints ONE JSON object: per plan the heap,
the live peak, the recorded temp, ``temp - heap`` and ``heap - live`` (the heap's fragmentation), and over the
plans how far the two differ.

Where the heap's gaps come from: ``--collect`` also replays two placements over the dumped buffers (the values
one offset holds over overlapping live ranges are one buffer) and records their heaps: ``replay_heap``, each
buffer placed in schedule order at the best-fitting free gap (testbed.model.heap.place), also with the buffers
under 16 MiB left out (``replay_heap_16mib`` and its live peak ``replay_live_16mib``); and
``decreasing_size_heap``, XLA's open-source default (``GlobalDecreasingSizeBestFitHeap`` of
``xla/service/heap_simulator.cc``: buffers by decreasing size, or by decreasing live range, regardless of time, each
at the best-fitting gap over its live range; the smaller of the two orders, as ``ChooseBestHeapAlgorithm`` takes).
``while_loops`` counts the step's ``while`` instructions, whose bodies' buffers the top level's live ranges
leave out. The comparison reports how close each replay comes to XLA:TPU's heap on the loop-free steps, and
testbed's memory (testbed.model.memory) against XLA's total as it is and with twice the recorded fragmentation
added (``with_recorded_fragmentation``: what the live peak alone would leave).

    PYTHONPATH=LIBTPU_SITE ALLOW_MULTIPLE_LIBTPU_LOAD=1 nice python benchmarks/xla_tpu_heap.py --collect [--only NAME ...]
    python benchmarks/xla_tpu_heap.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "xla_tpu"
DATA = ROOT / "benchmarks" / "xla_tpu_heap.json"
_ALLOCATION = re.compile(r"allocation (\d+): size (\d+), (.*)")
_VALUE = re.compile(r" value: <\d+ (\S+?)(\{[^}]*\})? @\d+> \(size=(\d+),offset=(\d+)\)")
_RANGE = re.compile(r"\s*(\S+):(\d+)-(\d+)$")


def _temporaries(assignment: str) -> tuple[int, list[tuple[str, int, int]]]:
    """The default memory space's preallocated heap: its size and its values as (name, size, offset)."""
    heap, values, inside = 0, [], False
    for line in assignment.splitlines():
        match = _ALLOCATION.match(line)
        if match:
            inside = "preallocated-temp" in match.group(3) and "color" not in match.group(3)
            heap = int(match.group(2)) if inside else heap
            continue
        value = _VALUE.match(line) if inside else None
        if value:
            values.append((value.group(1) + (value.group(2) or "{}"), int(value.group(3)), int(value.group(4))))
    return heap, values


def _live_ranges(text: str) -> dict[str, tuple[int, int]]:
    """``value -> (first, last)`` scheduled instruction of the live-range dump's BufferLiveRange section."""
    section = text.split("BufferLiveRange:", 1)[1].split("Live ranges at", 1)[0]
    return {m.group(1): (int(m.group(2)), int(m.group(3))) for m in map(_RANGE.match, section.splitlines()) if m}


def _union(spans: list[tuple[int, int]]) -> int:
    total, end = 0, -1
    for start, stop in sorted(spans):
        total += max(0, stop - max(start, end))
        end = max(end, stop)
    return total


def live_peak(values: list[tuple[str, int, int]], ranges: dict[str, tuple[int, int]]) -> int:
    """The most heap bytes occupied at one scheduled instruction (values sharing a slot counted once)."""
    events: dict[int, list[tuple[int, int]]] = {}
    for name, size, offset in values:
        first, last = ranges.get(name, (0, -1))
        for step in range(first, last + 1):
            events.setdefault(step, []).append((offset, offset + size))
    return max((_union(spans) for spans in events.values()), default=0)


def buffers(values: list[tuple[str, int, int]], ranges: dict[str, tuple[int, int]]) -> list:
    """The heap's buffers: the values one offset holds over overlapping live ranges are one buffer (an in-place
    update, an async collective's start and done); values of no bytes or no live range are left out."""
    from testbed.model.heap import Buffer

    spans: dict[int, list[list[int]]] = {}
    for name, size, offset in values:
        first, last = ranges.get(name, (0, -1))
        if size and last >= first:
            spans.setdefault(offset, []).append([first, last, size])
    out = []
    for held in spans.values():
        held.sort()
        current = held[0]
        for first, last, size in held[1:]:
            if first <= current[1]:
                current = [current[0], max(current[1], last), max(current[2], size)]
            else:
                out.append(Buffer(*current))
                current = [first, last, size]
        out.append(Buffer(*current))
    return out


def decreasing_size_heap(held: list) -> int:
    """XLA's open-source ``GlobalDecreasingSizeBestFitHeap``: buffers by decreasing size (``kSpatial``) or by
    decreasing live range (``kTemporal``), regardless of time, each at the smallest gap free over its whole live
    range that holds it, else above the highest buffer then placed over it; the smaller heap of the two orders."""
    orders = (lambda b: (-b.size, b.start - b.end, b.start), lambda b: (b.start - b.end, -b.size, b.start))
    sizes = []
    for order in orders:
        placed: list[tuple[int, int, int, int]] = []  # (start, end, offset, end offset)
        for b in sorted(held, key=order):
            busy = sorted((o, e) for s, t, o, e in placed if s <= b.end and t >= b.start)
            best, top = None, 0
            for offset, end in busy:
                if offset - top >= b.size and (best is None or offset - top < best[0]):
                    best = (offset - top, top)
                top = max(top, end)
            at = top if best is None else best[1]
            placed.append((b.start, b.end, at, at + b.size))
        sizes.append(max((e for *_, e in placed), default=0))
    return min(sizes)


def _replays(held: list) -> dict[str, int]:
    """The schedule-order replay's heap (all buffers, and those of 16 MiB or more) and the open-source one's."""
    from testbed.model.heap import heap

    large = [b for b in held if b.size >= 16 << 20]
    return {"replay_heap": heap(held).size, "replay_heap_16mib": heap(large).size,
            "replay_live_16mib": heap(large).live, "decreasing_size_heap": decreasing_size_heap(held)}


def read_dump(folder: Path) -> dict[str, int]:
    """Heap size, live peak, the replays' heaps and the ``while`` count of the training step dumped in ``folder``."""
    base = next(folder.glob("*jit_train_step*.after_optimizations-buffer-assignment.txt"))
    heap, values = _temporaries(base.read_text())
    ranges = _live_ranges(Path(str(base).replace("-buffer-assignment.txt", "-live-range.txt")).read_text())
    hlo = Path(str(base).replace("-buffer-assignment.txt", ".txt")).read_text()
    return {"heap": heap, "live": live_peak(values, ranges), **_replays(buffers(values, ranges)),
            "while_loops": len(re.findall(r" while\(", hlo))}


def _dumped(folder: Path) -> bool:
    return any(folder.glob("*jit_train_step*.after_optimizations-live-range.txt"))


def compiled_dump(name: str, wall: float, read, prefix: str = "xla_tpu_heap_"):
    """Compile ``name``'s recorded plan with the dump flags (``memory_vs_xla_tpu.py --one`` in a subprocess) until
    its buffer assignment is written, at most ``wall`` seconds; ``read(folder)`` of the dump (then deleted)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={folder} --xla_dump_hlo_as_text"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "memory_vs_xla_tpu.py"), "--one", name],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        start = time.time()
        while not _dumped(folder) and proc.poll() is None and time.time() - start < wall:
            time.sleep(1)
        time.sleep(3)  # the files are written one after the other
        return read(folder)
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def collect_one(name: str, wall: float) -> dict[str, int]:
    """Compile ``name``'s recorded plan with the dump flags until its buffer assignment is written; read it."""
    return compiled_dump(name, wall, read_dump)


def _plans(names: list[str] | None) -> list[str]:
    """The recorded single-program plans (a pipeline's total walks several programs), or ``names``."""
    out = []
    for path in sorted(RECORDS.glob("*.json")):
        record = json.loads(path.read_text())
        if record.get("status") == "ok" and len(record["report"]["programs"]) == 1:
            out.append(record["name"])
    return [n for n in out if not names or n in names]


def collect(names: list[str] | None, wall: float) -> dict:
    """Read every recorded plan's (or ``names``') heap, live peak and replays; write :data:`DATA` atomically after
    each plan."""
    from testbed.runner.tpu_compile import versions

    data = json.loads(DATA.read_text()) if DATA.exists() else {"plans": {}}
    data["provenance"] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          "command": "python benchmarks/xla_tpu_heap.py --collect", "versions": versions()}
    done = []
    for name in _plans(names):
        data["plans"][name] = collect_one(name, wall)
        done.append(name)
        print(json.dumps({"plan": name, **data["plans"][name]}), file=sys.stderr, flush=True)
        tmp = DATA.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, DATA)
    return {"collected": done}


def compare() -> dict:
    """Per plan heap, live peak and recorded temp; how far ``temp - heap`` is from ``heap - live``."""
    data = json.loads(DATA.read_text())
    rows = []
    for name, heap in sorted(data["plans"].items()):
        memory = json.loads((RECORDS / f"{name}.json").read_text())["report"]["programs"][0]["memory"]
        over, frag = memory["temp"] - heap["heap"], heap["heap"] - heap["live"]
        live = memory["peak"] - memory["argument"]  # XLA's peak: the arguments and the most temporaries live
        rows.append({"plan": name, "heap": heap["heap"], "live": heap["live"], "temp": memory["temp"],
                     "temp_minus_heap": over, "fragmentation": frag,
                     "difference_of_temp": (over - frag) / memory["temp"],
                     "peak_minus_argument": live, "live_difference_of_peak": (heap["live"] - live) / memory["peak"]})
        rows[-1].update(_replayed(heap))
    apart = [abs(r["difference_of_temp"]) for r in rows]
    peaks = [abs(r["live_difference_of_peak"]) for r in rows]
    return {"plans": rows, "count": len(rows), "median_abs_difference_of_temp": statistics.median(apart),
            "max_abs_difference_of_temp": max(apart), "within_1_percent": sum(a <= 0.01 for a in apart),
            "max_abs_live_difference_of_peak": max(peaks), "replays": _replay_summary(rows),
            "with_recorded_fragmentation": _with_fragmentation(rows), "provenance": data.get("provenance")}


def _with_fragmentation(rows: list[dict]) -> dict:
    """testbed's live peak (testbed.model.memory on the record's target, its total without its own predicted
    fragmentation) against XLA's total as it is, and with twice the recorded fragmentation added (what XLA's total holds beyond its peak, testbed.model.heap): over the
    multi-chip and the single-chip plans, median and max of the absolute errors."""
    from testbed.compiled.records import load_record
    from testbed.model.memory import memory_breakdown
    from testbed.topology.compile_target import target_topology

    errors: dict[str, list[tuple[float, float]]] = {"multi_chip": [], "single_chip": []}
    for row in rows:
        record = load_record(RECORDS / f"{row['plan']}.json")
        predicted = memory_breakdown(record.plan, target_topology(record.target)).live_peak
        added = predicted + 2 * row["fragmentation"]
        key = "multi_chip" if record.target.chips > 1 else "single_chip"
        errors[key].append((abs(predicted / record.memory_total - 1), abs(added / record.memory_total - 1)))
    return {key: {"count": len(pairs), "median_abs_error": statistics.median(p for p, _ in pairs),
                  "max_abs_error": max(p for p, _ in pairs),
                  "median_abs_error_with_fragmentation": statistics.median(a for _, a in pairs),
                  "max_abs_error_with_fragmentation": max(a for _, a in pairs)}
            for key, pairs in errors.items() if pairs}


def _replayed(heap: dict[str, int]) -> dict:
    """One plan's replays beside XLA:TPU's heap: each heap's difference from it, in parts of it."""
    if "replay_heap" not in heap:
        return {}
    size = heap["heap"]
    return {"while_loops": heap["while_loops"], "replay_heap": heap["replay_heap"],
            "replay_difference": heap["replay_heap"] / size - 1,
            "replay_fragmentation": heap["replay_heap"] - heap["live"],
            "replay_16mib_fragmentation": heap["replay_heap_16mib"] - heap["replay_live_16mib"],
            "decreasing_size_heap": heap["decreasing_size_heap"],
            "decreasing_size_difference": heap["decreasing_size_heap"] / size - 1}


def _replay_summary(rows: list[dict]) -> dict | None:
    """Over the loop-free steps (no ``while``: the live ranges hold every buffer), how near each replay comes."""
    free = [r for r in rows if r.get("while_loops") == 0]
    if not free:
        return None
    ours = [abs(r["replay_difference"]) for r in free]
    theirs = [abs(r["decreasing_size_difference"]) for r in free]
    return {"loop_free": len(free), "median_abs_replay_difference": statistics.median(ours),
            "max_abs_replay_difference": max(ours), "replay_within_2_percent": sum(a <= 0.02 for a in ours),
            "median_abs_decreasing_size_difference": statistics.median(theirs),
            "max_abs_decreasing_size_difference": max(theirs),
            "decreasing_size_below_heap": sum(r["decreasing_size_difference"] < -0.02 for r in free)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collect", action="store_true", help="compile with XLA:TPU (needs libtpu) and record")
    parser.add_argument("--only", nargs="*", help="plan names to collect")
    parser.add_argument("--wall-limit", type=float, default=900.0, help="wall seconds one plan may take")
    args = parser.parse_args(argv)
    print(json.dumps(collect(args.only, args.wall_limit) if args.collect else compare()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
