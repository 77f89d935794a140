"""Simulator speed: one full step (task graph, pricing, events, report) of a 512- and a 4096-device plan.

A 48-layer GPT with 1F1B over 64 microbatches on a hierarchical topology of
H100-like devices (8 per node on NVSwitch, 400 Gb/s InfiniBand NIC per GPU):
data 8 x tensor 8 x stage 8 on 64 nodes, and data 64 x tensor 8 x stage 8 on
512 nodes. Goal: <= 1 s for the 4096-device plan on a 2-core machine, with the
full timeline. ``scale``: issue 20's cases (an all-reduce over 16,384 ranks, data
parallelism on 16,384 devices, a 4-D plan on 65,536), each on the H100 hierarchy
(collectives timed by NCCL's model, testbed.collectives.nccl) and on a TPU v4-like
torus (32x32x16 and 64x32x32 chips, the links of the bundled tpu-v4-4x4x4: the
``multidim`` closed form on whole tori, routed programs on partial ones).
Goal: each simulation under 2 s on a 2-core machine; topology construction is
reported apart (``topology_s``); ``cpu_s`` is the process's CPU time, which a
machine shared with other work does not inflate. ``torus_4x4x4``: the TPU v4 cube's 256 MiB
all-reduce against its lower bound. ``multislice``: TPU v5p slices joined by the data-center network (the
bundled tpu-v5p-multislice, and four 16x16x16 slices). Prints one JSON object.
"""

from __future__ import annotations

import json
import time

from testbed.topology.generators import hierarchical
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec
from testbed.sim.graph.engine import simulate
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


def _timed(fn):
    """(result, wall seconds); the CPU seconds of the last call are kept in ``_timed.cpu``."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    _timed.cpu = round(time.process_time() - c0, 3)
    return out, round(time.perf_counter() - t0, 3)


def _tpu_torus(dims: list[int]):
    """A TPU v4-like torus of ``dims`` chips: device, links and calibration of the bundled tpu-v4-4x4x4."""
    from testbed.topology.generators import torus
    from testbed.topology.io import load_topology

    cube = load_topology("tpu-v4-4x4x4")
    level = cube.levels[0]
    return torus(dims, device=cube.device, bandwidth=level.bandwidth, latency=level.latency, kind=level.kind,
                 name="tpu-v4-" + "x".join(map(str, dims)), calibration=cube.calibration)


def _dp_plan() -> Plan:
    return Plan(name="dp-16384", model=ModelSpec(layers=4, d_model=1024, heads=16, d_ff=4096, seq_len=1024,
                                                 vocab=50304),
                batch=BatchSpec(global_batch=16384, microbatches=1), mesh=MeshSpec(data=16384),
                schedule=ScheduleSpec(name="1f1b"), precision="bf16-mixed")


def _4d_plan() -> Plan:
    return Plan(name="4d-65536", model=ModelSpec(layers=48, d_model=2048, heads=16, d_ff=8192, seq_len=2048,
                                                 vocab=50304),
                batch=BatchSpec(global_batch=128 * 8 * 16, microbatches=16),
                mesh=MeshSpec(data=128, fsdp=8, tensor=8, stage=8), schedule=ScheduleSpec(name="1f1b"),
                precision="bf16-mixed", remat="full")


def scale_cases() -> list[dict]:
    """Issue 20's scale cases on the H100 hierarchy and a TPU v4-like torus: an all-reduce over 16,384 ranks,
    pure data parallelism on 16,384 devices and a 4-D plan (data 128 x fsdp 8 x tensor 8 x stage 8) on
    65,536 (topology construction timed apart)."""
    from testbed.collectives.timing import collective_time

    out = []
    for kind, small, large in (("h100", lambda: _topology(2048), lambda: _topology(8192)),
                               ("torus", lambda: _tpu_torus([32, 32, 16]), lambda: _tpu_torus([64, 32, 32]))):
        topology, built = _timed(small)
        r, seconds = _timed(lambda: collective_time(topology, "all_reduce", tuple(range(topology.num_devices)),
                                                    2.0**30))
        out.append({"case": f"all_reduce-16384-{kind}", "seconds": seconds, "cpu_s": _timed.cpu, "topology_s": built,
                    "algorithm": r.algorithm, "closed_form": r.closed_form, "time_ms": round(r.time_s * 1e3, 3),
                    "bound_ms": round(r.bound_s * 1e3, 3), "busbw_GBps": round(r.busbw / 1e9, 1)})
        sim, seconds = _timed(lambda: simulate(_dp_plan(), topology))
        out.append({"case": f"data-parallel-16384-{kind}", "seconds": seconds, "cpu_s": _timed.cpu, "topology_s": built,
                    "step_time_s": sim.report.step_time_s})
        topology, built = _timed(large)
        sim, seconds = _timed(lambda: simulate(_4d_plan(), topology))
        out.append({"case": f"4d-65536-{kind}", "seconds": seconds, "cpu_s": _timed.cpu, "topology_s": built,
                    "tasks": len(sim.program.tasks), "step_time_s": sim.report.step_time_s})
    return out


def multislice_cases() -> list[dict]:
    """Multi-slice TPU v5p (slices joined by the DCN, the bundled tpu-v5p-multislice's links): a 1 GiB all-reduce
    over its 256 chips against the same inside one 4x4x4 slice, and at scale four 16x16x16 slices (16,384 chips):
    the all-reduce over all of them and pure data parallelism (the ``multislice`` closed form)."""
    from testbed.collectives.timing import collective_time
    from testbed.topology.generators import torus
    from testbed.topology.io import load_topology, topology_from_dict, topology_to_dict

    multi = load_topology("tpu-v5p-multislice")
    data = topology_to_dict(multi)
    data["torus"].pop("slices")
    data["name"] = "tpu-v5p-4x4x4"
    one = topology_from_dict(data)
    out = []
    for name, topology in (("one-slice-64", one), ("4-slices-256", multi)):
        r, seconds = _timed(lambda: collective_time(topology, "all_reduce", tuple(range(topology.num_devices)),
                                                    2.0**30))
        out.append({"case": f"all_reduce-1GiB-{name}", "seconds": seconds, "algorithm": r.algorithm,
                    "time_ms": round(r.time_s * 1e3, 3), "busbw_GBps": round(r.busbw / 1e9, 1)})
    ici, dcn = multi.levels[0], multi.levels[-1]
    topology, built = _timed(lambda: torus([16, 16, 16], device=multi.device, bandwidth=ici.bandwidth,
                                           latency=ici.latency, kind=ici.kind, name="tpu-v5p-4x16x16x16",
                                           calibration=multi.calibration, slices=dcn))
    r, seconds = _timed(lambda: collective_time(topology, "all_reduce", tuple(range(topology.num_devices)), 2.0**30))
    out.append({"case": "all_reduce-1GiB-4-slices-16384", "seconds": seconds, "cpu_s": _timed.cpu,
                "topology_s": built, "algorithm": r.algorithm, "closed_form": r.closed_form,
                "time_ms": round(r.time_s * 1e3, 3), "busbw_GBps": round(r.busbw / 1e9, 1)})
    sim, seconds = _timed(lambda: simulate(_dp_plan(), topology))
    out.append({"case": "data-parallel-16384-4-slices", "seconds": seconds, "cpu_s": _timed.cpu,
                "topology_s": built, "step_time_s": sim.report.step_time_s})
    return out


def torus_cube() -> dict:
    """The TPU v4 4x4x4 cube's 256 MiB all-reduce: the fastest algorithm, the dim-ordered one, the bound."""
    from testbed.collectives.timing import collective_time
    from testbed.topology.io import load_topology

    cube = load_topology("tpu-v4-4x4x4")
    group = tuple(range(64))
    best = collective_time(cube, "all_reduce", group, 2.0**28)
    ordered = collective_time(cube, "all_reduce", group, 2.0**28, "torus")
    return {"algorithm": best.algorithm, "time_us": round(best.time_s * 1e6, 1),
            "dim_ordered_us": round(ordered.time_s * 1e6, 1), "bound_us": round(best.bound_s * 1e6, 1)}


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
    print(json.dumps({"results": results, "scale": scale_cases(), "torus_4x4x4": torus_cube(),
                      "multislice": multislice_cases()}))


if __name__ == "__main__":
    main()
