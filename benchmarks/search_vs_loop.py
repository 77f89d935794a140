"""The search against the issue's hand loop on the bundled gpt-1b-cluster plan (dgx-h100-x4, 32 devices).

The loop: every mesh factorisation of 32 into data x fsdp x tensor x stage, times every schedule
(GPipe, 1F1B, interleaved with 2 virtual stages, ZB-H1, ZB-H2), the plan's other fields kept; the
plans that are valid and fit in memory are simulated with the discrete-event engine. The search
(`testbed.explore.search.search`, default space) must find a step time no slower than the loop's
best, and at least twice as fast as the bundled plan.

This was a test (tests/test_search.py) until it cost a minute of CPU per CI run; the property it
guards at scale is the one tests/test_search.py checks exactly on small grids
(`test_top1_equals_exhaustive_des_optimum`: the search's top-1 is the exhaustive DES optimum).

Prints one JSON object: the loop's size and best step, the search's best, the bundled plan's step,
``beats_loop`` and ``twice_as_fast`` (both true when the search does what it claims), seconds.
Exits 1 when either is false. Takes about a minute on one core.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

from testbed.errors import InputError
from testbed.explore.analytic import plan_memory
from testbed.explore.search import search
from testbed.explore.space import factorisations
from testbed.plan.io import load_plan
from testbed.plan.spec import MeshSpec, ScheduleSpec
from testbed.sim.graph.engine import simulate
from testbed.topology.io import load_topology

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1))


def hand_loop(plan, topology) -> dict:
    """Every mesh x schedule of ``plan`` that is valid and fits, simulated: count and best step."""
    start, tried, best, best_plan = time.perf_counter(), 0, float("inf"), None
    for d, f, t, s in factorisations(topology.num_devices):
        for name, virtual in SCHEDULES:
            try:
                p = replace(plan, mesh=MeshSpec(data=d, fsdp=f, tensor=t, stage=s),
                            schedule=ScheduleSpec(name=name, virtual_stages=virtual))
            except InputError:
                continue
            if not plan_memory(p, topology).fits:
                continue
            tried += 1
            step = simulate(p, topology).report.step_time_s
            if step < best:
                best, best_plan = step, {"mesh": [d, f, t, s], "schedule": name}
    return {"simulated": tried, "best_step_s": best, "best": best_plan, "seconds": time.perf_counter() - start}


def main() -> int:
    plan, topology = load_plan("gpt-1b-cluster"), load_topology("dgx-h100-x4")
    loop = hand_loop(plan, topology)
    start = time.perf_counter()
    result = search(plan, topology)
    search_s = time.perf_counter() - start
    bundled = simulate(plan, topology).report.step_time_s
    best = result.best.step_time_s
    out = {"plan": "gpt-1b-cluster", "topology": "dgx-h100-x4", "loop": loop,
           "search": {"best_step_s": best, "enumerated": result.enumerated, "replayed": result.replayed,
                      "seconds": search_s, "best": result.best.summary()},
           "bundled_step_s": bundled, "beats_loop": best <= loop["best_step_s"], "twice_as_fast": best < bundled / 2}
    print(json.dumps(out, default=str))
    return 0 if out["beats_loop"] and out["twice_as_fast"] else 1


if __name__ == "__main__":
    sys.exit(main())
