"""Predicting a traced program: the runner's GPT step traced on a 4096-device abstract mesh, priced, and checked
against plan-driven simulation of the same plan.

A GPT-1.3B (GPT-3 paper, Table 2.1: 24 layers, d_model 2048, 16 heads) in bf16-mixed with full remat, one
sequence per replica: data 64 x fsdp 8 x tensor 8 (4096 devices) on a 512-node DGX H100 SuperPOD-like
hierarchy (the bundled dgx-h100-superpod's device, links and calibration, 512 nodes instead of 128).
Goal (issue 36): tracing and pricing a 4096-device program in <= 60 s on a 2-core machine. Also reported:
the traced step time against plan-driven simulation's (goal: within 5%) and the collective bytes per
mesh axis of both. Prints one JSON object.
"""

from __future__ import annotations

import json
import time

from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec

GPT_1_3B = ModelSpec(layers=24, d_model=2048, heads=16, d_ff=8192, seq_len=2048, vocab=50304)


def superpod(nodes: int):
    """dgx-h100-superpod with ``nodes`` nodes."""
    from dataclasses import replace

    from testbed.topology.generators import hierarchical
    from testbed.topology.io import load_topology

    base = load_topology("dgx-h100-superpod")
    levels = [base.levels[0], replace(base.levels[1], size=nodes)]
    return hierarchical(levels, device=base.device, name=f"dgx-h100-superpod-{nodes}", calibration=base.calibration)


def main() -> None:
    from testbed.plan.placement import place
    from testbed.plan.spec import MESH_AXES
    from testbed.runner.program.plans import trace_plan
    from testbed.runner import devices
    from testbed.sim.graph.engine import simulate
    from testbed.sim.graph.traced import collective_bytes, simulate_workload

    devices.prepare(devices.DeviceRequest(kind="emulated", count=1))
    plan = Plan(name="gpt-1.3b-4096", model=GPT_1_3B, batch=BatchSpec(global_batch=512, microbatches=1),
                mesh=MeshSpec(data=64, fsdp=8, tensor=8), schedule=ScheduleSpec(name="1f1b"),
                precision="bf16-mixed", remat="full")
    topology = superpod(512)
    wall, cpu = time.perf_counter(), time.process_time()
    workload = trace_plan(plan)
    traced_s = time.perf_counter() - wall
    sim = simulate_workload(workload, topology)
    total_s, total_cpu = time.perf_counter() - wall, time.process_time() - cpu
    ref = simulate(plan, topology)
    names = tuple(a.value for a in MESH_AXES)
    ids = place(plan, topology).device_ids
    print(json.dumps({
        "benchmark": "program_trace", "model": "gpt-1.3b (GPT-3 Table 2.1)", "devices": topology.num_devices,
        "mesh": {k: v for k, v in workload.mesh.items() if v > 1}, "topology": topology.name,
        "trace_s": round(traced_s, 2), "price_s": round(total_s - traced_s, 2), "total_s": round(total_s, 2),
        "total_cpu_s": round(total_cpu, 2), "goal_s": 60, "ops": len(workload.ops), "tasks": sim.report.tasks,
        "step_time_s": {"traced": sim.report.step_time_s, "plan": ref.report.step_time_s,
                        "ratio": sim.report.step_time_s / ref.report.step_time_s},
        "collective_bytes": {"traced": collective_bytes(sim.program, ids, names),
                             "plan": collective_bytes(ref.program, ids, names)},
    }))


if __name__ == "__main__":
    main()
