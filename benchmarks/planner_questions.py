"""Wall time of the questions a planner brings, each one command, at 256 GPUs (issue 59's "Done when").

Prints one JSON object: per question the command (as typed after ``testbed``), its exit status, its wall
clock and CPU seconds, and the files it wrote; ``load_average`` the machine's 1-minute load before and
after (wall clock on a shared machine measures the sharing). The questions:

- ``resize_search``: the best layout of Llama 3 70B on 256 H100s of the SuperPOD (``--devices 256``), written
  to a plan (``--skip-search`` leaves it out: minutes on a loaded 2-core machine);
- ``written_plan_runs``: that plan simulated as written;
- ``zero_side_by_side``: ZeRO 1 against ZeRO 3 with remat none against full, one table and one picture;
- ``gantt``: one simulated step of that plan (without the search: gpt-1b-cluster's data degree filled to 256)
  drawn as a Gantt chart;
- ``memory``: the memory breakdown, its workspace named.

Run: ``.venv/bin/python benchmarks/planner_questions.py [--skip-search] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile
import time
from pathlib import Path

from testbed.cli.main import main

TOPOLOGY = "dgx-h100-superpod@256"


def _timed(argv: list[str]) -> dict:
    """Run ``testbed ARGV`` in this process; its status, wall and CPU seconds (output discarded)."""
    wall, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        status = main(argv)
    return {"command": " ".join(argv), "status": status, "wall_s": round(time.perf_counter() - wall, 2),
            "cpu_s": round(time.process_time() - cpu, 2)}


def _scaled(out: Path) -> Path:
    """gpt-1b-cluster with its data degree filled to the topology, written as a plan naming it."""
    from dataclasses import replace

    from testbed.plan.io import dump_plan, load_plan
    from testbed.plan.scale import scale_data

    path = out / "gpt-1b-256.yaml"
    path.write_text(dump_plan(replace(scale_data(load_plan("gpt-1b-cluster"), 256), topology=TOPOLOGY)))
    return path


def run(out: Path, skip_search: bool) -> dict:
    results: dict[str, dict] = {}
    best = out / "llama3-70b-256.yaml"
    if not skip_search:
        results["resize_search"] = _timed(["search", "--model", "llama3-70b", "--topology", "dgx-h100-superpod",
                                           "--devices", "256", "--out", str(best)])
    if best.exists():
        results["written_plan_runs"] = _timed(["simulate", "--plan", str(best)])
    plan = best if best.exists() else _scaled(out)
    results["zero_side_by_side"] = _timed(["compare", "--plans", "gpt-1b-cluster", "--vary", "zero=1,3", "--vary",
                                           "remat=none,full", "--topology", TOPOLOGY, "--scale", "data", "--png",
                                           str(out / "zero.png")])
    results["gantt"] = _timed(["simulate", "--plan", str(plan), "--gantt", str(out / "gantt.png")])
    results["memory"] = _timed(["memory", "--plan", "gpt-1b-cluster", "--topology", TOPOLOGY])
    return results


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-search", action="store_true", help="leave out the 256-GPU search")
    parser.add_argument("--out", help="folder for the plan and pictures (default: a temporary one)")
    args = parser.parse_args()
    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        questions = run(out, args.skip_search)
    print(json.dumps({"topology": TOPOLOGY, "questions": questions, "load_average": [before, os.getloadavg()[0]],
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}))


if __name__ == "__main__":
    main_()
