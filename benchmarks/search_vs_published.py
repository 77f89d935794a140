"""Does `testbed search` find a layout no slower than the published one, for every published run?

For every published run of ``benchmarks/published/`` (runs.yaml's cases and megatron.yaml's Table 1 rows: the
model, cluster, global batch, precision, optimizer and stack's runtime profile as published), the search
(testbed.explore.search, its default space with sequence parallelism on and off) chooses the layout, and its
best plan's DES step time is compared with the published layout's under the same runtime profile:
``ratio`` = search's best / published layout (<= 1.00: the search is at least as good by testbed's own
prediction). ``published_fits``: whether the published layout fits testbed's memory model (every one trained,
so false is the memory model's miss; the search keeps to plans that fit). ``wall_s`` and ``cpu_s``: the
search's own time (the load average beside them says how shared the machine was); ``replayed`` its DES replays,
``replays_stopped`` those of them the DES stopped once certainly slower than the best five.

Prints one JSON object: ``runs`` (one row each, smallest device count first), ``worst_ratio``, ``all_no_slower``,
``max_wall_s``, ``max_cpu_s``, ``failed`` (runs the search found no layout for: their row's ``error``),
``not_run`` (runs left out by ``--cases``/``--max-devices``), ``stopped`` (runs whose search passed ``--cpu-limit`` CPU
seconds: their row's ``stopped_after_cpu_s``, no ratio). With ``--rows FILE`` each row is also appended to
FILE (JSON lines) as its search ends, and the runs already there are kept, not searched again: a long run
resumes where it stopped.

Run: ``.venv/bin/python benchmarks/search_vs_published.py [--cases SUBSTRING,...] [--max-devices N] [--rows FILE]
[--cpu-limit S]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent / "published"))

from end_to_end import CASES as MEGATRON, plan_dict  # noqa: E402
from runs import case_plan, case_topology, load_cases  # noqa: E402

from testbed.errors import InputError  # noqa: E402
from testbed.explore.search import search  # noqa: E402
from testbed.explore.space import SearchSpace, resize_topology  # noqa: E402
from testbed.model.memory import memory_breakdown  # noqa: E402
from testbed.plan.io import plan_from_dict  # noqa: E402
from testbed.plan.spec import Plan  # noqa: E402
from testbed.sim.graph.engine import simulate  # noqa: E402
from testbed.topology.io import load_topology  # noqa: E402
from testbed.topology.spec import Topology  # noqa: E402

#: The space every run is searched in: the default, sequence parallelism tried both ways (a published layout
#: states its own; the search chooses).
SPACE = SearchSpace(sequence_parallel=(False, True))


def published_runs() -> list[tuple[str, Plan, Topology]]:
    """(name, the published plan, its topology at the run's devices) of every published run."""
    cases, inline = load_cases()
    out = [(case["name"], case_plan(case), case_topology(case, inline)) for case in cases]
    data = yaml.safe_load(Path(MEGATRON).read_text())
    base = load_topology(data["setup"]["topology"])
    for row in data["cases"]:
        spec = plan_dict(row, data["setup"])
        out.append((spec["name"], plan_from_dict(spec, default_name=spec["name"]),
                    resize_topology(base, int(row["gpus"]))))
    return out


class _Stopped(Exception):
    """A search stopped at the benchmark's CPU limit."""


def _limit(seconds: float | None):
    """A search progress callback that stops the search once this process has spent ``seconds`` more CPU seconds
    (None: no limit); the search calls it after each group bounded, estimate and replay."""
    if seconds is None:
        return None
    until = time.process_time() + seconds

    def progress(*_args) -> None:
        if time.process_time() > until:
            raise _Stopped
    return progress


def compare(name: str, plan: Plan, topology: Topology, space: SearchSpace = SPACE,
            cpu_limit: float | None = None) -> dict:
    """One run: the published layout's DES step, the search's best, their ratio and the search's time (a search
    past ``cpu_limit`` CPU seconds is stopped: its row says so, with no ratio)."""
    published = simulate(plan, topology).report.step_time_s
    start, cpu = time.perf_counter(), time.process_time()
    try:
        result = search(plan, topology, space, progress=_limit(cpu_limit))
    except _Stopped:
        return {"run": name, "devices": topology.num_devices, "published_s": round(published, 4),
                "published_fits": memory_breakdown(plan, topology).fits, "best_s": None, "ratio": None,
                "stopped_after_cpu_s": round(time.process_time() - cpu, 1),
                "wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(time.process_time() - cpu, 1)}
    except InputError as exc:  # the search found no layout: the run fails the check, its reason kept
        return {"run": name, "devices": topology.num_devices, "published_s": round(published, 4),
                "published_fits": memory_breakdown(plan, topology).fits, "best_s": None, "ratio": None,
                "error": str(exc), "wall_s": round(time.perf_counter() - start, 1),
                "cpu_s": round(time.process_time() - cpu, 1)}
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    best = result.best
    return {"run": name, "devices": topology.num_devices, "published_s": round(published, 4),
            "published_fits": memory_breakdown(plan, topology).fits, "best_s": round(best.step_time_s, 4),
            "ratio": round(best.step_time_s / published, 4), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "enumerated": result.enumerated, "estimated": result.estimated, "replayed": result.replayed,
            "replays_stopped": result.replays_stopped,
            "best": {k: v for k, v in best.summary().items()
                     if k in ("data", "fsdp", "tensor", "stage", "context", "expert", "schedule", "virtual_stages",
                              "microbatches", "zero", "remat", "sequence_parallel")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated substrings of the run names to keep (default: all)")
    parser.add_argument("--max-devices", type=int, help="keep the runs on at most this many devices")
    parser.add_argument("--rows", type=Path, help="JSON lines of finished rows: appended to, and resumed from")
    parser.add_argument("--cpu-limit", type=float, help="stop a search past this many CPU seconds (its row says so)")
    args = parser.parse_args()
    keep = [s for s in (args.cases or "").split(",") if s]
    done = {}
    if args.rows is not None and args.rows.exists():
        done = {row["run"]: row for row in map(json.loads, args.rows.read_text().splitlines()) if row}
    rows, skipped = [], []
    for name, plan, topology in sorted(published_runs(), key=lambda run: run[2].num_devices):
        if (keep and not any(k in name for k in keep)) or (args.max_devices and topology.num_devices > args.max_devices):
            skipped.append(name)
            continue
        row = done.get(name)
        if row is None:
            row = {**compare(name, plan, topology, cpu_limit=args.cpu_limit), "load_average": round(os.getloadavg()[0], 2)}
            if args.rows is not None:
                with args.rows.open("a") as out:
                    out.write(json.dumps(row) + "\n")
        rows.append(row)
        print(f"{name}: ratio {row['ratio']}, {row['cpu_s']} CPU s {row.get('error', '')}", file=sys.stderr,
              flush=True)
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    stopped = [r["run"] for r in rows if "stopped_after_cpu_s" in r]
    print(json.dumps({"runs": rows, "worst_ratio": max(ratios, default=None),
                      "all_no_slower": len(ratios) == len(rows) and all(r <= 1.0 for r in ratios),
                      "failed": [r["run"] for r in rows if r["ratio"] is None and r["run"] not in stopped],
                      "stopped": stopped,
                      "max_wall_s": max((r["wall_s"] for r in rows), default=None),
                      "max_cpu_s": max((r["cpu_s"] for r in rows), default=None), "not_run": skipped,
                      "load_average": os.getloadavg()[0], "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
