"""Simulator speed: one full step (task graph, pricing, events, report) of a 512- and a 4096-device plan.

A 48-layer GPT with 1F1B over 64 microbatches on a hierarchical topology of
H100-like devices (8 per node on NVSwitch, 400 Gb/s InfiniBand NIC per GPU):
data 8 x tensor 8 x stage 8 on 64 nodes, and data 64 x tensor 8 x stage 8 on
512 nodes. Goal: <= 1 s for the 4096-device plan on a 2-core machine, with the
full timeline. ``scale``: issue 20's cases (an all-reduce over 16,384 ranks, data
parallelism on 16,384 devices, a 4-D plan on 65,536). The device is named
H100-like, so collectives are timed by NCCL's model (testbed.collectives.nccl).
Prints one JSON object.
"""

from __future__ import annotations

import json
import time

from testbed.topology.generators import hierarchical
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec
from testbed.sim.engine import simulate
from testbed.topology import Calibration, CollectiveCalibration, ComputeCalibration, DeviceSpec, Level, LinkKind

H100 = DeviceSpec(name="H100-like", peak_flops={"bf16": 989e12, "fp32": 67e12}, memory_bytes=80e9,
                  memory_bandwidth=3.35e12)


def case(nodes: int, data: int) -> tuple[Plan, object]:
    topology = hierarchical([Level(name="node", size=8, bandwidth=450e9, latency=1e-6, kind=LinkKind.NVSWITCH),
                             Level(name="cluster", size=nodes, bandwidth=50e9, latency=3e-6, kind=LinkKind.INFINIBAND)],
                            device=H100, name=f"h100-{nodes}x8",
                            calibration=Calibration(compute=ComputeCalibration(efficiency=0.7, launch_overhead_s=5e-6),
                                                    collectives=CollectiveCalibration(overhead_s=5e-6)))
    plan = Plan(name=f"gpt48-{nodes * 8}", model=ModelSpec(layers=48, d_model=2048, heads=16, d_ff=8192, seq_len=2048,
                                                          vocab=50304),
                batch=BatchSpec(global_batch=data * 64, microbatches=64),
                mesh=MeshSpec(data=data, tensor=8, stage=8), schedule=ScheduleSpec(name="1f1b"),
                precision="bf16-mixed", remat="full")
    return plan, topology


def _topology(nodes: int):
    return case(nodes, 1)[1]


def scale_cases() -> list[dict]:
    """Issue 20's scale cases: an all-reduce over 16,384 ranks, pure data parallelism on 16,384 devices and a
    4-D plan (data 128 x fsdp 8 x tensor 8 x stage 8) on 65,536 (topology construction timed apart)."""
    from testbed.collectives.timing import collective_time

    out = []
    t0 = time.perf_counter()
    topology = _topology(2048)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    r = collective_time(topology, "all_reduce", tuple(range(topology.num_devices)), 2.0**30)
    out.append({"case": "all_reduce-16384", "seconds": round(time.perf_counter() - t0, 3), "topology_s": round(built, 3),
                "algorithm": r.algorithm, "busbw_GBps": round(r.busbw / 1e9, 1)})
    dp = Plan(name="dp-16384", model=ModelSpec(layers=4, d_model=1024, heads=16, d_ff=4096, seq_len=1024, vocab=50304),
              batch=BatchSpec(global_batch=16384, microbatches=1), mesh=MeshSpec(data=16384),
              schedule=ScheduleSpec(name="1f1b"), precision="bf16-mixed")
    t0 = time.perf_counter()
    sim = simulate(dp, topology)
    out.append({"case": "data-parallel-16384", "seconds": round(time.perf_counter() - t0, 3), "topology_s": round(built, 3),
                "step_time_s": sim.report.step_time_s})
    t0 = time.perf_counter()
    topology = _topology(8192)
    built = time.perf_counter() - t0
    plan = Plan(name="4d-65536", model=ModelSpec(layers=48, d_model=2048, heads=16, d_ff=8192, seq_len=2048, vocab=50304),
                batch=BatchSpec(global_batch=128 * 8 * 16, microbatches=16),
                mesh=MeshSpec(data=128, fsdp=8, tensor=8, stage=8), schedule=ScheduleSpec(name="1f1b"),
                precision="bf16-mixed", remat="full")
    t0 = time.perf_counter()
    sim = simulate(plan, topology)
    out.append({"case": "4d-65536", "seconds": round(time.perf_counter() - t0, 3), "topology_s": round(built, 3),
                "tasks": len(sim.program.tasks), "step_time_s": sim.report.step_time_s})
    return out


def main() -> None:
    results = []
    for nodes, data in ((64, 8), (512, 64)):
        plan, topology = case(nodes, data)
        t0 = time.perf_counter()
        sim = simulate(plan, topology)
        seconds = time.perf_counter() - t0
        results.append({"devices": topology.num_devices, "tasks": len(sim.program.tasks), "seconds": round(seconds, 3),
                        "step_time_s": sim.report.step_time_s, "mfu": sim.report.mfu,
                        "timeline_spans": len(sim.timeline.label)})
    print(json.dumps({"results": results, "scale": scale_cases()}))


if __name__ == "__main__":
    main()
