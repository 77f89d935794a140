"""How fast `testbed search` disposes of candidate plans, and whether its top-1 is the exhaustive DES optimum.

Prints one JSON object:

- ``plans_per_minute`` (the headline, issue 35's ">= 50,000 plans per minute"):
  candidates the whole search disposes of per minute of wall clock -- enumerated,
  bounded, estimated or skipped for their floors, the best replayed with the DES
  -- on the bundled gpt-1b-cluster model over dgx-h100-x4's 32 devices, one
  process, timed first (before any other pass warms its caches). It is what a
  user waits on: the search is the tool, and every candidate it skips is
  skipped with a proof that it could not reach the replay list
  (testbed.explore.floor), so the rate counts plans decided, not plans guessed;
  ``plans_per_cpu_minute`` the same per CPU minute (what one process with its
  own core does; wall-clock rates on a shared machine measure the sharing);
- ``evaluate_all``: the slower number, kept beside it and named for what it is:
  :func:`testbed.explore.search.evaluate` (exact memory, and the analytic
  estimate of every plan that fits, no floor, no ordering) on every candidate
  of the same space, caches warm as in a long search (``--cold``: a fresh
  pass, collective profiles included), per minute and per CPU minute. It is
  the cost of the analytic tier per plan it does estimate, which the search's
  floors avoid for most plans; it bounds a search without floors;
- ``search``: that search's counts (``analytic_s`` its analytic tier,
  ``replay_s`` its DES replay), and its best plan vs the bundled plan;
- ``load_average``: the machine's 1-minute load when the rates were measured (``os.getloadavg``): the
  wall-clock rates hold for a quiet machine only when it is below the core count;
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
from testbed.sim.graph.engine import simulate
from testbed.topology.io import load_topology

SMALL = SearchSpace(schedules=("gpipe", "1f1b", "interleaved", "zb-h1"), virtual_stages=(2,), microbatches=(1, 2, 4),
                    zero=(0, 1, 3), remat=("none", "full"))
CASES = (("gpt-tiny", "host-cpu-8"), ("gpt-125m", "dgx-h100"), ("gpt-350m", "tpu-v5e-4x4"))


def evaluate_all(cold: bool) -> dict:
    """evaluate() on every candidate of gpt-1b-cluster on dgx-h100-x4 (warm caches unless ``cold``)."""
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
    parser.add_argument("--cold", action="store_true", help="time a cold evaluate-all pass (no warm-up)")
    args = parser.parse_args()
    plan, topology = load_plan("gpt-1b-cluster"), load_topology("dgx-h100-x4")
    start, cpu = time.perf_counter(), time.process_time()
    result = search(plan, topology)  # timed first: only its own work warms its caches
    search_s, search_cpu = time.perf_counter() - start, time.process_time() - cpu
    rate = evaluate_all(args.cold)
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
        "plans_per_minute": 60 * result.enumerated / search_s,
        "plans_per_cpu_minute": 60 * result.enumerated / search_cpu,
        "headline": "the whole search (enumerate, bound, estimate, replay), plans per minute",
        "load_average": os.getloadavg()[0], "cpus": os.cpu_count(), "cold": args.cold,
        "evaluate_all": rate,
        "search": {"model": "gpt-1b-cluster", "topology": "dgx-h100-x4", "enumerated": result.enumerated,
                   "pruned_memory": result.pruned_memory, "pruned_bound": result.pruned_bound,
                   "estimated": result.estimated, "replayed": result.replayed, "seconds": search_s,
                   "cpu_seconds": search_cpu, "analytic_s": result.analytic_s, "replay_s": result.replay_s,
                   "bundled_step_s": baseline, "best_step_s": best.step_time_s,
                   "speedup": baseline / best.step_time_s, "best": best.summary()},
        "agreement": agreement, "agreement_ok": all(a["equal"] for a in agreement),
    }))


if __name__ == "__main__":
    main()
