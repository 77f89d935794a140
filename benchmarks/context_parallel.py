"""Context parallelism in the simulator: Llama 3 8B and 70B at long context with the ring on and off.

For each case, the same model, global batch and device count with ``mesh.context`` 1 and > 1 (the rest of
the mesh chosen to fit where it can), simulated by the discrete-event engine and by the analytic tier:
step time, exposed communication and the ring's share of it (testbed.sim.graph.ring.exposed_ring_s), memory per
device and whether it fits, and the seconds the simulation took. One row also moves the context ring
across nodes (``mesh.order`` with context outermost) to show what placement does to the ring.
Prints one JSON object. Usage: ``python benchmarks/context_parallel.py``.
"""

from __future__ import annotations

import json
import time

from testbed.explore.analytic import estimate
from testbed.explore.space import resize_topology
from testbed.plan.io import plan_from_dict
from testbed.sim.graph.engine import simulate
from testbed.sim.graph.ring import exposed_ring_s
from testbed.topology.io import load_topology

ACROSS = ["stage", "context", "data", "fsdp", "expert", "tensor"]  # the context ring outermost: across nodes

#: (name, preset, seq_len, topology, devices, global batch, [(mesh, remat, sequence_parallel, order)])
CASES = [
    ("llama3-8b 128K", "llama3-8b", 131072, "dgx-h100-x4", 32, 4, [
        ({"data": 4, "tensor": 8}, "full", True, None),
        ({"context": 8, "tensor": 4}, "full", True, None),
        ({"context": 8, "tensor": 4}, "none", True, None),
    ]),
    ("llama3-8b 32K", "llama3-8b", 32768, "dgx-h100-x4", 32, 32, [
        ({"data": 8, "tensor": 4}, "full", True, None),
        ({"data": 4, "context": 2, "tensor": 4}, "full", True, None),
        ({"data": 4, "context": 2, "tensor": 4}, "full", True, ACROSS),
    ]),
    ("llama3-70b 64K", "llama3-70b", 65536, "dgx-h100-superpod", 128, 16, [
        ({"data": 4, "tensor": 8, "stage": 4}, "full", True, None),
        ({"context": 4, "tensor": 8, "stage": 4}, "full", True, None),
    ]),
]


def row(preset: str, seq: int, topology, batch: int, mesh: dict, remat: str, sp: bool, order) -> dict:
    data = mesh.get("data", 1)
    mesh = {**mesh, **({"order": order} if order else {})}
    plan = plan_from_dict({"name": f"{preset}-{seq}", "model": {"preset": preset, "seq_len": seq, "attention": "flash"},
                           "batch": {"global_batch": batch, "microbatches": batch // data},
                           "mesh": mesh, "precision": "bf16-mixed", "remat": remat, "sequence_parallel": sp,
                           "schedule": "1f1b"})
    start = time.perf_counter()
    sim = simulate(plan, topology)
    seconds = time.perf_counter() - start
    r = sim.report
    return {"mesh": {k: v for k, v in mesh.items() if k != "order"}, "context_ring": "across nodes" if order else
            "default placement", "remat": remat, "step_s": round(r.step_time_s, 4),
            "analytic_step_s": round(estimate(plan, topology).step_time_s, 4),
            "exposed_comm_s": round(r.exposed_comm_s, 4), "exposed_ring_s": round(exposed_ring_s(sim.timeline), 5),
            "memory_gb": round(r.memory["total"] / 1e9, 1), "fits": bool(r.memory["fits"]), "mfu": round(r.mfu, 3),
            "tasks": r.tasks, "simulate_s": round(seconds, 2)}


def main() -> None:
    out = {}
    for name, preset, seq, topo_name, devices, batch, rows in CASES:
        topology = resize_topology(load_topology(topo_name), devices)
        out[name] = {"topology": topology.name, "global_batch": batch,
                     "rows": [row(preset, seq, topology, batch, *r) for r in rows]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
