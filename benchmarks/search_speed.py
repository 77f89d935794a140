"""How fast the search's analytic tier is, and whether its top-1 is the exhaustive DES optimum.

Prints one JSON object:

- ``plans_per_minute``: candidates the analytic tier handles per minute
  (exact memory for every one, the step-time estimate for those that fit)
  on the bundled gpt-1b-cluster model over dgx-h100-x4's 32 devices, one
  process, caches warm as in a long search (``--cold`` times a fresh
  process's first search instead, collective profiles included);
- ``search``: that search's counts and its best plan vs the bundled plan, with
  ``search_plans_per_minute`` (its analytic tier, step-floor pruning
  included) and ``search_plans_per_cpu_minute`` (the whole search, replay
  included, per CPU minute: the rate on a quiet machine where the process
  has its core; wall-clock rates on a shared machine measure the sharing);
- ``load_average``: the machine's 1-minute load when the rates were measured (``os.getloadavg``): the
  wall-clock rates hold for a quiet machine only when it is below the core count; the per-CPU-minute
  rates are what one process with its own core does;
- ``agreement``: on three small grids (every candidate simulated with the
  DES), the search's top-1 step time and the exhaustive optimum.

Run: ``.venv/bin/python benchmarks/search_speed.py [--cold]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from testbed.explore.search import evaluate, exhaustive_optimum, search
from testbed.explore.space import SearchSpace, candidates, preset_plan
from testbed.plan.io import load_plan
from testbed.sim.engine import simulate
from testbed.topology.io import load_topology

SMALL = SearchSpace(schedules=("gpipe", "1f1b", "interleaved", "zb-h1"), virtual_stages=(2,), microbatches=(1, 2, 4),
                    zero=(0, 1, 3), remat=("none", "full"))
CASES = (("gpt-tiny", "host-cpu-8"), ("gpt-125m", "dgx-h100"), ("gpt-350m", "tpu-v5e-4x4"))


def analytic_rate(cold: bool) -> dict:
    plan, topology = load_plan("gpt-1b-cluster"), load_topology("dgx-h100-x4")
    plans = list(candidates(plan, topology.num_devices))
    if not cold:
        for p in plans[::10]:  # warm the collective profiles, as any search's first seconds do
            evaluate(p, topology)
    start, cpu = time.perf_counter(), time.process_time()
    fitting = sum(evaluate(p, topology) is not None for p in plans)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"plans": len(plans), "fitting": fitting, "seconds": seconds, "plans_per_minute": 60 * len(plans) / seconds,
            "cpu_seconds": cpu, "plans_per_cpu_minute": 60 * len(plans) / cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", action="store_true", help="time a cold first pass (no warm-up)")
    args = parser.parse_args()
    rate = analytic_rate(args.cold)
    plan, topology = load_plan("gpt-1b-cluster"), load_topology("dgx-h100-x4")
    cpu = time.process_time()
    result = search(plan, topology)
    search_cpu = time.process_time() - cpu
    baseline = simulate(plan, topology).report.step_time_s
    best = result.best
    agreement = []
    for model, topo_name in CASES:
        topo, base = load_topology(topo_name), preset_plan(model)
        start = time.perf_counter()
        _, optimum, simulated = exhaustive_optimum(base, topo, SMALL)
        exhaustive_s = time.perf_counter() - start
        start = time.perf_counter()
        found = search(base, topo, SMALL, replay=8)
        agreement.append({"model": model, "topology": topo_name, "candidates": found.enumerated,
                          "simulated_exhaustive": simulated, "replayed": found.replayed,
                          "search_top1_s": found.best.step_time_s, "exhaustive_optimum_s": optimum,
                          "equal": abs(found.best.step_time_s - optimum) <= 1e-9 * optimum,
                          "search_s": time.perf_counter() - start, "exhaustive_s": exhaustive_s})
    print(json.dumps({
        "plans_per_minute": rate["plans_per_minute"], "plans_per_cpu_minute": rate["plans_per_cpu_minute"],
        "load_average": os.getloadavg()[0], "cpus": os.cpu_count(), "analytic": rate, "cold": args.cold,
        "search": {"model": "gpt-1b-cluster", "topology": "dgx-h100-x4", "enumerated": result.enumerated,
                   "pruned_memory": result.pruned_memory, "replayed": result.replayed,
                   "search_plans_per_minute": result.plans_per_minute,
                   "pruned_bound": result.pruned_bound, "estimated": result.estimated, "search_cpu_s": search_cpu,
                   "search_plans_per_cpu_minute": 60 * result.enumerated / search_cpu, "bundled_step_s": baseline,
                   "best_step_s": best.step_time_s, "speedup": baseline / best.step_time_s, "best": best.summary()},
        "agreement": agreement, "agreement_ok": all(a["equal"] for a in agreement),
    }))


if __name__ == "__main__":
    main()
