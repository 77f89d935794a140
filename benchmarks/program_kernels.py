"""Diagnosis benchmark: what XLA:CPU runs for the held-out programs against what the traced tier prices.

For each program of benchmarks/program_heldout.py (``--only`` to choose) on 8 emulated CPU devices:

- ``priced``: the traced tier's per-device seconds (``host-cpu-8``, or ``--topology``) of the task graph's matmul
  tasks, memory-bound tasks and collectives by kind (each task's priced duration, before the host's sharing), the
  predicted step and the kernels priced;
- ``compiled``: a census of the compiled step's HLO per device, while bodies times their trip counts: its dots by
  the kernel XLA:CPU runs them in (``ynn``: a YNNPACK fusion; ``eigen``: a ``dot`` thunk) and by where the left
  operand's contracting dimension is (``minor``: its last, as ``x @ w``; ``major``: a weight gradient's ``x^T dy``),
  with their FLOPs; its physical transposes (a ``copy`` whose operand's layout differs from its own: a loop fusion
  that moves the minor dimension) with the bytes they write; the kernels (thunks) it runs;
- ``measured``: the step's wall time (the least disturbed of ``--rounds`` round medians) and the process's CPU
  seconds per step (user + system, ``getrusage``), with its minor page faults per step. CPU time counts work, not
  waiting for a core, so it is steadier than wall time on a shared host: ``cpu_per_device_s`` against the priced
  seconds of one device's compute says how much of the step's work the pricing leaves out (a device alone runs on
  about one core: ``host.throughput`` of ``host-cpu-8``);
- ``micro`` (unless ``--no-micro``): on one device, CPU seconds per call of one ``dot_general`` of each of
  :data:`MICRO_DOTS`, three ways (``nn``: ``x @ w``; ``tn``: ``x^T dy``, the left operand contracted
  over its major dimension; ``tt``: both operands contracted across their layout), against the traced tier's price
  of it; and of an elementwise pass (``v * 1.5 + 1``) over a matrix with and without a transpose of its result.

Prints ONE JSON object; the load average before and after.

    python benchmarks/program_kernels.py [--only NAME ...] [--steps S] [--rounds R] [--topology T] [--no-micro]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: (m, k, n) of the products the micro-benchmarks time: the held-out programs' per-device shapes (FSDP's 16 and the
#: scan's 32 rows a device, their weight gradients reducing over those rows; the Mixer's and the MoE's).
MICRO_DOTS = ((16, 256, 1024), (16, 1024, 256), (32, 256, 512), (32, 512, 256), (256, 16, 1024), (1024, 16, 256),
              (256, 32, 512), (512, 32, 256), (512, 128, 256), (256, 512, 128), (1024, 64, 64))
#: Matrices the transpose micro-benchmark passes over.
MICRO_TRANSPOSES = ((256, 512), (512, 256), (1024, 64), (64, 1024), (1024, 256), (256, 1024), (2048, 512))
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "s64": 8, "f64": 8}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\](?:\{([\d,]*)[^}]*\})? ([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\) -> .* \{$")
_WHILE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .* while\((.*)$")


def _computations(text: str) -> tuple[dict[str, list[tuple]], str]:
    """The HLO module's computations: name -> its instructions (name, dtype, dims, layout, opcode, rest), and the
    entry's name."""
    comps: dict[str, list[tuple]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            comps[current] = []
            entry = current if header.group(1) else entry
            continue
        loop = _WHILE.match(line)
        if loop and current is not None:  # a tuple-shaped while: only its body and trip count matter here
            comps[current].append((loop.group(1), "", (), (), "while", loop.group(2)))
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            name, dtype, dims, layout, opcode, rest = m.groups()
            comps[current].append((name, dtype, tuple(int(d) for d in dims.split(",") if d),
                                   tuple(int(d) for d in (layout or "").split(",") if d), opcode, rest))
    return comps, entry


def _physical(dims: tuple, layout: tuple, source_layout: tuple) -> bool:
    """Whether a copy from ``source_layout`` to ``layout`` moves data: the order of its non-unit dims differs."""
    return [d for d in layout if dims[d] > 1] != [d for d in source_layout if d < len(dims) and dims[d] > 1]


def census(text: str) -> dict:
    """The compiled step's dots (by kernel and left contraction, with FLOPs), physical transposes (count, bytes
    written) and kernels per device, while bodies counted their trip count times."""
    comps, entry = _computations(text)
    shapes = {i[0]: i for body in comps.values() for i in body}
    dots, transposes, kernels = Counter(), Counter(), Counter()

    def dot(instruction: tuple, kernel: str, times: int) -> None:
        _, _, dims, _, _, rest = instruction
        operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
        contracting = [int(d) for d in re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1).split(",") if d]
        lhs = shapes[operands[0]][2]
        where = "minor" if contracting == [len(lhs) - 1] else "major"
        key = f"{kernel}:{where}"
        dots[key + ":count"] += times
        dots[key + ":flops"] += times * 2.0 * math.prod(dims) * math.prod(lhs[d] for d in contracting)

    def walk(name: str, times: int, top: bool) -> None:
        for instruction in comps.get(name, ()):
            iname, dtype, dims, layout, opcode, rest = instruction
            if opcode == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                walk(re.search(r"body=%([\w.\-]+)", rest).group(1), times * (int(trips.group(1)) if trips else 1), True)
                continue
            if top and opcode not in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
                kernels["thunks"] += times
            called = re.search(r"calls=%([\w.\-]+)", rest)
            if opcode == "dot":
                dot(instruction, "eigen" if top else "ynn", times)
            elif opcode == "copy":
                source = shapes.get(re.search(r"%([\w.\-]+)", rest).group(1))
                if source is not None and _physical(dims, layout, source[3]):
                    transposes["count"] += times
                    transposes["bytes"] += times * _DTYPE_BYTES.get(dtype, 4) * math.prod(dims)
            if called and opcode == "fusion":
                walk(called.group(1), times, False)

    walk(entry, 1, True)
    return {"dots": dict(dots), "physical_transposes": dict(transposes), "kernels": kernels["thunks"]}


def priced(workload, topology) -> dict:
    """The traced tier's per-device seconds by task kind (their priced durations), its step and kernels."""
    from testbed.sim.graph.tasks import TaskKind
    from testbed.sim.graph.traced import price_workload, simulate_workload

    sim = simulate_workload(workload, topology)
    durations = price_workload(sim.program, topology, sim.workload.dtype).durations
    out: Counter = Counter()
    for task, seconds in zip(sim.program.tasks, durations):
        if task.kind is TaskKind.COMPUTE and task.flops > 0:
            out["matmul_tasks_s"] += seconds
            out["kernels"] += task.kernels
        elif task.kind is TaskKind.COMPUTE and task.hbm_bytes > 0:
            out["memory_bound_tasks_s"] += seconds
            out["kernels"] += task.kernels
        elif task.kind in (TaskKind.COLLECTIVE, TaskKind.SEND):
            out[f"{task.op}_s"] += seconds
    return {"step_s": sim.report.step_time_s, **out}


def measured(trainer, steps: int, rounds: int) -> dict:
    """Wall seconds per step (the least disturbed round's median) and CPU seconds and minor faults per step."""
    from testbed.runner.step_timer import StepTimer

    timer = StepTimer(trainer)
    timer.round(2)
    medians, cpu, faults = [], [], []
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_SELF)
        medians.append(timer.round(steps)[0])
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu.append((after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / steps)
        faults.append((after.ru_minflt - before.ru_minflt) / steps)
    return {"wall_s": min(medians), "cpu_s": statistics.median(cpu), "minor_faults": statistics.median(faults)}


def program_row(name: str, devices, topology, steps: int, rounds: int) -> dict:
    """One held-out program: priced, compiled census, measured, and CPU per device against its priced compute."""
    import program_heldout as ph

    from testbed.cli.program import local_mesh
    from testbed.runner.program import trace
    from testbed.runner.program.measure import ProgramTrainer

    mesh = local_mesh(ph.PROGRAMS[name], devices)
    step, args = ph._module(name).predict(mesh)
    price = priced(trace(step, *args, mesh=mesh, name=name), topology)
    trainer = ProgramTrainer(step, args, mesh)
    measure = measured(trainer, steps, rounds)
    compute = price.get("matmul_tasks_s", 0.0) + price.get("memory_bound_tasks_s", 0.0)
    per_device = measure["cpu_s"] / len(devices)
    return {"mesh": ph.PROGRAMS[name], "priced": price, "compiled": census(trainer.hlo_text()), "measured": measure,
            "cpu_per_device_s": per_device, "cpu_per_device_over_priced_compute": per_device / compute}


def _cpu_per_call(fn, args, calls: int) -> float:
    fn(*args).block_until_ready()
    before = time.process_time()
    for _ in range(calls):
        fn(*args).block_until_ready()
    return (time.process_time() - before) / calls


def micro(topology, calls: int) -> dict:
    """CPU seconds per call on one device: weight-gradient dots three ways against the traced price of one, and an
    elementwise pass over a matrix with and without a transpose; an empty program's taken off each."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from testbed.model.gemm import Gemm
    from testbed.sim.graph.traced import traced_topology
    from testbed.sim.price.compute import compute_seconds

    device = jax.devices()[0]
    empty = _cpu_per_call(jax.jit(lambda a: a), (jax.device_put(jnp.ones(4), device),), calls)
    traced = traced_topology(topology)

    def dims(lhs: int, rhs: int):
        return jax.jit(lambda a, b: lax.dot_general(a, b, (((lhs,), (rhs,)), ((), ()))))

    dots = []
    for m, k, n in MICRO_DOTS:
        ones = lambda *shape: jax.device_put(jnp.ones(shape, jnp.float32), device)  # noqa: E731
        row = {"mkn": [m, k, n], "priced_s": compute_seconds(traced, "fp32", 2.0 * m * n * k, 0.0,
                                                             gemms=(Gemm(m=m, n=n, k=k),))
               - traced.calibration.compute.launch_overhead_s + traced.calibration.compute.kernel_s}
        for label, fn, a, b in (("nn", dims(1, 0), ones(m, k), ones(k, n)), ("tn", dims(0, 0), ones(k, m), ones(k, n)),
                                ("tt", dims(0, 1), ones(k, m), ones(n, k))):
            row[f"{label}_s"] = _cpu_per_call(fn, (a, b), calls) - empty
        dots.append(row)
    passes = []
    plain, moved = jax.jit(lambda v: v * 1.5 + 1.0), jax.jit(lambda v: (v * 1.5 + 1.0).T)
    for shape in MICRO_TRANSPOSES:
        x = jax.device_put(jnp.ones(shape, jnp.float32), device)
        passes.append({"shape": list(shape), "bytes": 8.0 * math.prod(shape),
                       "pass_s": _cpu_per_call(plain, (x,), calls) - empty,
                       "transposed_pass_s": _cpu_per_call(moved, (x,), calls) - empty})
    return {"empty_program_s": empty, "dots": dots, "passes": passes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="programs to run (default all eight)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per program (default 3)")
    parser.add_argument("--topology", default="host-cpu-8", help="host topology to price on (default host-cpu-8)")
    parser.add_argument("--micro", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the dot and transpose micro-benchmarks on one device (default on)")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    load_before = os.getloadavg()
    import jax

    import program_heldout as ph
    from testbed.topology.io import load_topology

    topology = load_topology(args.topology)
    devices = jax.devices()[:8]
    rows = {name: program_row(name, devices, topology, args.steps, args.rounds) for name in args.only or ph.PROGRAMS}
    out = {"benchmark": "program_kernels", "topology": topology.name, "devices": "emulated:8", "rows": rows,
           "steps": args.steps, "rounds": args.rounds}
    if args.micro:
        out["micro"] = micro(topology, calls=100)
    out["load_average"] = {"before": [round(x, 2) for x in load_before],
                           "after": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
