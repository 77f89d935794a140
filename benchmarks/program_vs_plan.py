"""Every point of tests/test_program_vs_plan.py's drawn spaces: the traced runner step against the plan.

Issue 36's first goal is a hypothesis test over drawn plans (traced step time within 5% of plan-driven
simulation, collective bytes per mesh axis exact). A drawn test samples its space; this script walks all of
it, so every corner that misses is known without waiting for a draw to find it: GPT of 2 layers, d_model 1024 or
2048, sequence 1024 or 2048, one sequence per replica, tensor 1/2/4/8 (sequence parallel or not where tensor >
1), bf16-mixed or fp32, the replicas as data (``data``) or fsdp (``fsdp``), over the whole of
``dgx-h100-superpod`` (1,024 GPUs) and ``tpu-v5e-16x16`` (256 chips). 224 points, about five minutes of CPU.

Prints one JSON object: ``points`` (each with its ``ratio``, traced over planned step time, and whether the
collective bytes per axis agree), ``outside_5pct`` (the points whose ratio is off by more than 5%),
``bytes_differ``, and per family and topology the count, the number outside and the largest miss.

``--microbatches M`` gives each replica M sequences (gradient accumulation over the runner's microbatch loop;
default 1, the drawn space); repeated, it walks each count and keys ``groups`` by family, topology and ``mbM``.

Run: ``.venv/bin/python benchmarks/program_vs_plan.py [--family data|fsdp] [--topology NAME] [--microbatches M ...]``.
"""

from __future__ import annotations

import argparse
import itertools
import json

from testbed.plan.placement import place
from testbed.plan.spec import MESH_AXES, BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec
from testbed.runner.program.plans import trace_plan
from testbed.sim.graph.engine import simulate
from testbed.sim.graph.traced import collective_bytes, simulate_workload
from testbed.topology.io import load_topology

#: Topologies and the device counts their meshes fill (as in tests/test_program_vs_plan.py).
TOPOLOGIES = {"dgx-h100-superpod": 1024, "tpu-v5e-16x16": 256}
FAMILIES = ("data", "fsdp")


def plans(family: str, topology: str, microbatches: int = 1) -> list[Plan]:
    """Every plan of one family's drawn space on one topology, each replica's batch in ``microbatches`` sequences.

    The drawn space has one sequence per replica (``microbatches`` 1); more sequences per replica make the
    runner's step accumulate the gradients over a loop of microbatches (gradient accumulation).
    """
    out = []
    for d, seq, tensor, precision in itertools.product((1024, 2048), (1024, 2048), (1, 2, 4, 8),
                                                        ("bf16-mixed", "fp32")):
        for sp in ((False, True) if tensor > 1 else (False,)):
            model = ModelSpec(layers=2, d_model=d, heads=16, d_ff=4 * d, seq_len=seq, vocab=32768)
            replicas = TOPOLOGIES[topology] // tensor
            mesh = (MeshSpec(fsdp=replicas, tensor=tensor) if family == "fsdp"
                    else MeshSpec(data=replicas, tensor=tensor))
            name = f"{family}-d{d}-s{seq}-t{tensor}{'-sp' if sp else ''}-{precision}"
            out.append(Plan(name=name + (f"-mb{microbatches}" if microbatches > 1 else ""), model=model,
                            batch=BatchSpec(global_batch=replicas * microbatches, microbatches=microbatches),
                            mesh=mesh, schedule=ScheduleSpec(name="1f1b"),
                            precision=precision, remat="none", sequence_parallel=sp))
    return out


def point(plan: Plan, topology_name: str) -> dict:
    """One plan traced and planned on one topology: the step times' ratio and whether the bytes agree."""
    topology = load_topology(topology_name)
    traced = simulate_workload(trace_plan(plan), topology)
    planned = simulate(plan, topology)
    ids, names = place(plan, topology).device_ids, tuple(a.value for a in MESH_AXES)
    same = collective_bytes(traced.program, ids, names) == collective_bytes(planned.program, ids, names)
    return {"topology": topology_name, "plan": plan.name, "traced_s": traced.report.step_time_s,
            "planned_s": planned.report.step_time_s,
            "ratio": round(traced.report.step_time_s / planned.report.step_time_s, 4), "bytes_equal": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, action="append")
    parser.add_argument("--topology", choices=sorted(TOPOLOGIES), action="append")
    parser.add_argument("--microbatches", type=int, action="append",
                        help="sequences per replica, accumulated over a loop of microbatches (default 1; repeat "
                             "for several)")
    args = parser.parse_args()
    counts = args.microbatches or [1]
    if min(counts) < 1:
        parser.error(f"--microbatches must be a positive integer, got {min(counts)}")
    points = [dict(point(plan, topology), microbatches=m) for m in counts for family in (args.family or FAMILIES)
              for topology in (args.topology or sorted(TOPOLOGIES)) for plan in plans(family, topology, m)]
    groups = {}
    for p in points:
        key = f"{p['plan'].split('-')[0]} {p['topology']}" + (f" mb{p['microbatches']}" if len(counts) > 1 else "")
        g = groups.setdefault(key, {"count": 0, "outside_5pct": 0, "largest_miss": 0.0})
        g["count"] += 1
        g["outside_5pct"] += abs(p["ratio"] - 1) > 0.05
        g["largest_miss"] = max(g["largest_miss"], round(abs(p["ratio"] - 1), 4))
    print(json.dumps({"points": points, "groups": groups,
                      "outside_5pct": [f"{p['topology']} {p['plan']} {p['ratio']}" for p in points
                                       if abs(p["ratio"] - 1) > 0.05],
                      "bytes_differ": [f"{p['topology']} {p['plan']}" for p in points if not p["bytes_equal"]]},
                     indent=1))


if __name__ == "__main__":
    main()
