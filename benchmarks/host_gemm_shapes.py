"""Accuracy benchmark: one matmul by its shape on this host, the GEMM shape model that prices traced programs.

``testbed calibrate`` on emulated host devices times a grid of fp32 GEMM shapes (every ``m, n, k`` of 16, 64,
256 and 1024 from 1 MFLOP to 0.5 GFLOP: testbed.runner.measure.gemm_grid), each on every device at once as one
SPMD program, and fits ``compute.matmul_efficiency``, ``matmul_half_mn``, ``matmul_half_k`` and
``matmul_latency_s`` (testbed.calibration.gemm_shapes: net of the empty program, times the host's share of one
device's speed when all compute) under the topology's fp32 peak and bandwidth. This benchmark does the same with
calibrate's own code on 8 emulated devices, the grid timed in ``--rounds`` rounds (every other one reversed,
each shape's median round kept, as calibrate keeps it), validate's reference step timed after each round
(``host_speeds``: the host's speed against its calibration then), and reports twice, on the raw times (``raw``)
and on each round's times scaled by its speed (``at_calibrated_speed``: the fields for a topology calibrated
when the host was quiet, as the bundled ``host-cpu-8`` was; the reference step is an 8-device program too):

- ``fitted``: the four fields on ``--topology``;
- ``in_sample`` and ``leave_one_out``: the net time's relative error on the grid, fitted on all shapes and with
  each shape left out of its own fit in turn (median, max, and per shape);
- ``heldout``: the matmuls of the eight programs of benchmarks/program_heldout.py (their ``dot_general`` s, with
  their batch), never in the grid, timed in the same rounds and the same way, priced by the fitted model and, for comparison, by
  the FLOPs curve traced programs took without it (``efficiency x f / (f + compute.kernel_half_flops)`` of peak);
- ``samples``: each round's samples (testbed.calibration.fit.samples_to_rows) and speed, to refit without measuring;
- the load average before and after.

Prints ONE JSON object.

    python benchmarks/host_gemm_shapes.py [--rounds R] [--topology T] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _errors(values: list[float]) -> dict:
    return {"median_abs": statistics.median(abs(v) for v in values), "max_abs": max(abs(v) for v in values)}


def heldout_shapes(devices) -> list[tuple[int, int, int, int]]:
    """The distinct (batch, m, n, k) of the held-out programs' matmuls (dot_general, not convolutions)."""
    import program_heldout as ph
    from testbed.cli.program import local_mesh
    from testbed.runner.program import trace

    shapes = set()
    for name, mesh in ph.PROGRAMS.items():
        concrete = local_mesh(mesh, devices)
        step, args = ph._module(name).predict(concrete)
        for op in trace(step, *args, mesh=concrete, name=name).ops:
            if op.name == "dot_general":
                shapes.update((g.batch, g.m, g.n, g.k) for g in op.gemms)
    return sorted(shapes)


def _timer(devices, shape: tuple[int, int, int, int]):
    """A held-out shape timed as calibrate times the grid: on every device at once, one SPMD program."""
    import jax
    import jax.numpy as jnp

    from testbed.runner.host_sharing import time_call

    b, m, n, k = shape
    mesh = jax.make_mesh((len(devices),), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
    rows = jax.NamedSharding(mesh, jax.P("d"))
    x = jax.device_put(jnp.ones((len(devices), b, m, k), jnp.float32), rows)
    y = jax.device_put(jnp.ones((len(devices), b, k, n), jnp.float32), rows)  # each device's own: no transposes
    fn = jax.jit(jnp.matmul, out_shardings=rows)
    return lambda: time_call(lambda: fn(x, y), repeats=15, budget_s=0.5)


def timed(devices, rounds: int, grid: list, heldout: list, reference) -> list[dict]:
    """Per round: the grid's samples (calibrate's code) with the empty program's over the devices, the held-out
    shapes' times, and the host's speed against its calibration then (``reference``: validate's reference step)."""
    from testbed.runner.measure import Benchmark, run_benchmark

    n = len(devices)
    benches = [Benchmark(kind="dispatch", size=n, ranks=1)] + [Benchmark(kind="gemm", shape=s, ranks=n) for s in grid]
    timers = {s: _timer(devices, s) for s in heldout}
    out = []
    for r in range(rounds):
        step = 1 if r % 2 == 0 else -1
        samples = {i: run_benchmark(benches[i], devices) for i in list(range(len(benches)))[::step]}
        times = {s: timers[s]() for s in heldout[::step]}
        out.append({"samples": [samples[i] for i in range(len(benches))], "heldout": times,
                    "speed": reference.time()["speed"]})
    return out


def _at_speed(rounds: list[dict], scaled: bool) -> tuple[list, dict]:
    """Each sample's median round (calibrate's rule), every time first multiplied by its round's host speed when
    ``scaled`` (the time at the calibrated speed, as validate scales a plan's: the grid then prices a traced
    step on the topology that was calibrated when the host was quiet)."""
    from dataclasses import replace

    from testbed.runner.measure import least_disturbed

    def speed(r: dict) -> float:
        return r["speed"] if scaled else 1.0

    samples = [least_disturbed([replace(r["samples"][i], seconds=r["samples"][i].seconds * speed(r)) for r in rounds])
               for i in range(len(rounds[0]["samples"]))]
    samples[0] = min((replace(r["samples"][0], seconds=r["samples"][0].seconds * speed(r)) for r in rounds),
                     key=lambda s: s.seconds)  # the empty program: the fastest round, as calibrate keeps it
    held = {s: statistics.median(r["heldout"][s] * speed(r) for r in rounds) for s in rounds[0]["heldout"]}
    return samples, held


def _report(topology, samples: list, held_times: dict) -> dict:
    """The fit on the grid, its in-sample and leave-one-out errors, and its error on the held-out shapes (each
    converted to one device alone as the grid is: net of the empty program, times the host's share)."""
    from testbed.calibration.gemm_shapes import (fit_gemm_shapes, gemm_rows, launch_seconds, leave_one_out,
                                                 predicted_seconds)

    devices = samples[0].devices
    launch = launch_seconds(samples, devices)
    share = topology.calibration.host.share(devices) if topology.calibration.host else 1.0
    fields, fit = fit_gemm_shapes(samples, topology)
    rows = gemm_rows(samples, topology)
    loo = leave_one_out(rows, topology)
    heldout = []
    for shape, seconds in held_times.items():
        net = (seconds - launch) * share
        heldout.append({"shape": list(shape), "measured_s": seconds, "net_alone_s": net,
                        "model_error": predicted_seconds(topology, fields, (*shape, 0.0)) / net - 1.0,
                        "flops_curve_error": _curve_seconds(topology, shape) / net - 1.0})
    return {"launch_s": launch, "share": share, "fitted": fields,
            "in_sample": {**_errors(list(fit.rel_residuals)), "samples": fit.samples},
            "leave_one_out": _errors(loo),
            "heldout": {"model": _errors([h["model_error"] for h in heldout]),
                        "flops_curve": _errors([h["flops_curve_error"] for h in heldout]), "shapes": len(heldout)},
            "grid": [{"shape": [r[1], r[2], r[3]], "net_alone_s": 2.0 * r[1] * r[2] * r[3] / r[4], "in_sample": e,
                      "loo": o} for r, e, o in zip(rows, fit.rel_residuals, loo)],
            "heldout_rows": heldout}


def _curve_seconds(topology, shape) -> float:
    """The FLOPs curve a traced matmul took without the shape model (one matmul's half, the calibrated cap)."""
    compute = topology.calibration.compute
    f = 2.0 * shape[0] * shape[1] * shape[2] * shape[3]
    return (f + compute.kernel_half_flops) / (compute.efficiency * topology.device.sustained_flops("fp32"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds over the grid, each shape's median kept (default 5)")
    parser.add_argument("--topology", default="host-cpu-8", help="the calibrated host topology (default host-cpu-8)")
    parser.add_argument("--quick", action="store_true", help="calibrate --quick's smaller grid")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    load_before = os.getloadavg()
    import jax

    from testbed.calibration.fit import samples_to_rows
    from testbed.runner.measure import gemm_grid
    from testbed.runner.validate import ReferenceStep
    from testbed.topology.io import load_topology

    topology = load_topology(args.topology)
    devices = jax.devices()[:8]
    held = heldout_shapes(devices)
    rounds = timed(devices, args.rounds, gemm_grid(args.quick), held, ReferenceStep(topology, devices))
    print(json.dumps({
        "benchmark": "host_gemm_shapes", "topology": topology.name, "rounds": args.rounds,
        "host_speeds": [r["speed"] for r in rounds],
        "at_calibrated_speed": _report(topology, *_at_speed(rounds, True)),
        "raw": _report(topology, *_at_speed(rounds, False)),
        "samples": [{"speed": r["speed"], "rows": samples_to_rows(r["samples"]),
                     "heldout": [[*shape, t] for shape, t in r["heldout"].items()]} for r in rounds],
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in os.getloadavg()]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
