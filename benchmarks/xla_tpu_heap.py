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


def read_dump(folder: Path) -> dict[str, int]:
    """Heap size and live peak of the training step's buffer assignment dumped in ``folder``."""
    base = next(folder.glob("*jit_train_step*.after_optimizations-buffer-assignment.txt"))
    heap, values = _temporaries(base.read_text())
    ranges = _live_ranges(Path(str(base).replace("-buffer-assignment.txt", "-live-range.txt")).read_text())
    return {"heap": heap, "live": live_peak(values, ranges)}


def _dumped(folder: Path) -> bool:
    return any(folder.glob("*jit_train_step*.after_optimizations-live-range.txt"))


def collect_one(name: str, wall: float) -> dict[str, int]:
    """Compile ``name``'s recorded plan with the dump flags until its buffer assignment is written; read it."""
    folder = Path(tempfile.mkdtemp(prefix="xla_tpu_heap_"))
    env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={folder} --xla_dump_hlo_as_text"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "memory_vs_xla_tpu.py"), "--one", name],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        start = time.time()
        while not _dumped(folder) and proc.poll() is None and time.time() - start < wall:
            time.sleep(1)
        time.sleep(3)  # the files are written one after the other
        return read_dump(folder)
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _plans(names: list[str] | None) -> list[str]:
    """The recorded single-program plans (a pipeline's total walks several programs), or ``names``."""
    out = []
    for path in sorted(RECORDS.glob("*.json")):
        record = json.loads(path.read_text())
        if record.get("status") == "ok" and len(record["report"]["programs"]) == 1:
            out.append(record["name"])
    return [n for n in out if not names or n in names]


def collect(names: list[str] | None, wall: float) -> dict:
    """Read every recorded plan's (or ``names``') heap and live peak; write :data:`DATA` atomically."""
    from testbed.runner.tpu_compile import versions

    data = json.loads(DATA.read_text()) if DATA.exists() else {"plans": {}}
    done = []
    for name in _plans(names):
        data["plans"][name] = collect_one(name, wall)
        done.append(name)
        print(json.dumps({"plan": name, **data["plans"][name]}), file=sys.stderr, flush=True)
    data["provenance"] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          "command": "python benchmarks/xla_tpu_heap.py --collect", "versions": versions()}
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
    apart = [abs(r["difference_of_temp"]) for r in rows]
    peaks = [abs(r["live_difference_of_peak"]) for r in rows]
    return {"plans": rows, "count": len(rows), "median_abs_difference_of_temp": statistics.median(apart),
            "max_abs_difference_of_temp": max(apart), "within_1_percent": sum(a <= 0.01 for a in apart),
            "max_abs_live_difference_of_peak": max(peaks), "provenance": data.get("provenance")}


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
