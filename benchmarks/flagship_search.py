"""The flagship search as typed: Llama 3 405B on 16,384 H100s, the command's own path and its whole default space.

    .venv/bin/python benchmarks/flagship_search.py

Runs `testbed search --model llama3-405b --topology llama3-h100-16k --global-batch 2048 --json` in this process
and prices Meta's published layout (`plans/llama3-405b.yaml`: TP 8 / PP 16 / DP 128, interleaved over 8 virtual stages) under the runner's runtime
and under its own `runtime: meta`. Prints one JSON object: the search's counts, its best plan's step and memory,
Meta's two steps, ``no_slower_than_metas`` (the property: the best plan's DES step at most Meta's under either
runtime), ``fits``, ``wall_s`` and ``cpu_s``. Exits 1 when the property fails, the best plan does not fit, or the
command did not keep the runner's runtime. About a minute of CPU on one core (goal: the
search <= 60 s). In CI, tests/test_flagship_search.py checks the pruning that makes it exact on smaller inputs
(lower bounds at flagship scale, the best-first tier against estimating all) and tests/test_search.py the top-1
against the exhaustive DES optimum on small grids.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from dataclasses import replace

from testbed.cli.main import main as testbed_main
from testbed.plan.io import load_plan
from testbed.plan.runtime import RuntimeSpec
from testbed.sim.graph.engine import simulate
from testbed.topology.io import load_topology

ARGV = ["search", "--model", "llama3-405b", "--topology", "llama3-h100-16k", "--global-batch", "2048", "--json"]


def run() -> dict:
    """The search as typed and Meta's layout under both runtimes."""
    wall, cpu, out = time.perf_counter(), time.process_time(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        status = testbed_main(ARGV)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    data = json.loads(out.getvalue())
    best = data["ranked"][0]
    topology, paper = load_topology("llama3-h100-16k"), load_plan("llama3-405b")
    same_runtime = simulate(replace(paper, runtime=RuntimeSpec()), topology).report.step_time_s
    metas = simulate(paper, topology).report.step_time_s
    return {"status": status, "devices": data["devices"], "enumerated": data["enumerated"],
            "pruned_memory": data["pruned_memory"], "pruned_bound": data["pruned_bound"],
            "best_step_s": best["step_time_s"], "best_memory_bytes": best["memory_bytes"],
            "metas_step_s_runner_runtime": same_runtime, "metas_step_s_meta_runtime": metas,
            "no_slower_than_metas": best["step_time_s"] <= min(same_runtime, metas),
            "fits": best["memory_bytes"] <= best["capacity_bytes"],
            "runtime_profile": (data["best_plan"].get("runtime") or {"profile": "testbed"})["profile"],
            "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}


if __name__ == "__main__":
    result = run()
    json.dump(result, sys.stdout)
    print()
    pruned = result["pruned_memory"] + result["pruned_bound"]
    ok = (result["status"] == 0 and result["devices"] == 16_384 and result["no_slower_than_metas"] and result["fits"]
          and result["runtime_profile"] == "testbed" and result["enumerated"] > pruned)
    sys.exit(0 if ok else 1)
