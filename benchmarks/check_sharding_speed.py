"""check-sharding speed: the runner's step lowered and partitioned on abstract meshes of 64 to 32,768 devices.

A GPT-1.3B (GPT-3 paper, Table 2.1: 24 layers, d_model 2048, 16 heads) in
bf16-mixed with full remat, one microbatch of one sequence per replica:
SPMD data x fsdp 8 x tensor 8 with data 1, 8, 64 (4096 devices) and 512
(32,768), and the 4096-device pipeline data 16 x fsdp 4 x tensor 8 x stage 8
(1F1B, 8 microbatches). Goal (issue 22): the 4096-device check in under a
minute on a 2-core machine. The program is the same for every data degree
(only the global batch dim grows), so the time should not grow with the
device count. Prints one JSON object: per case, devices, wall and CPU
seconds (trace + lower, Shardy partitioning, total) and collectives found.
"""

from __future__ import annotations

import json
import time

from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec

GPT_1_3B = ModelSpec(layers=24, d_model=2048, heads=16, d_ff=8192, seq_len=2048, vocab=50304)


def plan(data: int, fsdp: int, tensor: int, stage: int = 1, microbatches: int = 1) -> Plan:
    return Plan(name=f"gpt-1.3b-{data * fsdp * tensor * stage}{'-pp' if stage > 1 else ''}", model=GPT_1_3B,
                batch=BatchSpec(global_batch=data * fsdp * microbatches, microbatches=microbatches),
                mesh=MeshSpec(data=data, fsdp=fsdp, tensor=tensor, stage=stage), schedule=ScheduleSpec(name="1f1b"),
                precision="bf16-mixed", remat="full")


def case(p: Plan) -> dict:
    from testbed.runner.check_sharding import check_sharding

    wall, cpu = time.perf_counter(), time.process_time()
    result = check_sharding(p)
    return {"case": p.name, "mesh": {k: v for k, v in result.mesh.items() if v > 1}, "devices": result.devices,
            "ok": result.ok, "error": result.error, "wall_s": round(time.perf_counter() - wall, 2),
            "cpu_s": round(time.process_time() - cpu, 2), "seconds": result.seconds,
            "programs": len(result.programs), "collectives": sum(r["count"] for r in result.per_axis())}


def main() -> None:
    from testbed.runner import devices

    devices.prepare(devices.DeviceRequest(kind="emulated", count=1))
    # JAX's one-time start-up (imports, the CPU backend, MLIR contexts), not counted in any case.
    case(Plan(name="warm-up", model=ModelSpec(layers=1, d_model=32, heads=4, d_ff=64, seq_len=8, vocab=64),
              batch=BatchSpec(global_batch=2), mesh=MeshSpec(data=2)))
    cases = [plan(1, 8, 8), plan(8, 8, 8), plan(64, 8, 8), plan(512, 8, 8), plan(16, 4, 8, stage=8, microbatches=8)]
    print(json.dumps({"benchmark": "check_sharding_speed", "model": "gpt-1.3b (GPT-3 Table 2.1)",
                      "cases": [case(p) for p in cases]}))


if __name__ == "__main__":
    main()
