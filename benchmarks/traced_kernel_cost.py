"""Fit a host's cost per traced kernel (``calibration.compute.kernel_s``) over the calibration's own training steps.

A traced program prices each matmul by its shape and each memory-bound op of the fusion estimate by its bytes; on
XLA:CPU every such kernel is also a thunk of its own, dispatched and split over the host's thread pool on every
device, a cost no byte or FLOP count holds. The calibration's training steps (testbed.calibration.steps: GPT of 2
or 8 layers, d_model 64-256, data parallel or two-way tensor parallel, fp32) are what the plan-driven price of the
topology was fitted to (their measured steps): traced by ``trace_plan`` and priced by the traced tier without the
per-kernel cost they are faster than that price by a near-constant time per kernel, whatever their size. This
script fits the one cost per kernel (seconds on a device alone; the engine shares the host among the devices as
for every compute task) that makes the traced steps match the plan-driven steps, least squares in relative error,
and reports each step's leave-one-out error (the fit without it, the step priced anew).

Left out of the fit, with their residual reported: the bf16 steps (XLA:CPU's bf16 converts, a cost in bytes) and
the eight-way tensor-parallel steps (their replicated activations, which the plan-driven price charges at its
calibrated passes per byte): both gaps grow with the step's size, not with its kernels.

``--runs FILE ...`` checks the mechanism against measured steps too: each kept calibration's samples
(``benchmarks/host_runs/DATE/run-N/measurements.json``) refitted as ``testbed calibrate --from-measurements`` does,
the same traced steps priced on it and the cost fitted to that day's measured steps (``measured_runs``: per run the
fitted cost, the traced steps' median and max error with it and without, and the plan-driven price's own median
error on the same steps).

    python benchmarks/traced_kernel_cost.py [--topology host-cpu-8] [--devices 8] [--runs FILE ...]

Prints ONE JSON object: the fitted ``kernel_s``, per step the plan-driven and traced step (with and without it),
the kernels, the in-sample and leave-one-out errors, their medians and maxima.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

#: The calibration's fp32 steps of at most two-way tensor parallelism (the fit) and the others (reported).
FIT_STEPS = ("cpu-xxs", "cpu-xs", "cpu-s", "cpu-m", "cpu-l", "cpu-xl", "cpu-deep", "cpu-xs-t2", "cpu-s-t2",
             "cpu-m-t2")
OTHER_STEPS = ("cpu-m-bf16", "cpu-l-bf16", "cpu-m-t2-bf16", "cpu-m-t8", "cpu-l-t8")


def with_kernel_s(topology, kernel_s: float):
    """``topology`` with ``calibration.compute.kernel_s`` set."""
    cal = topology.calibration
    return replace(topology, calibration=replace(cal, compute=replace(cal.compute, kernel_s=kernel_s)))


def _traced_s(workload, topology, kernel_s: float) -> float:
    from testbed.sim.graph.traced import simulate_workload
    return simulate_workload(workload, with_kernel_s(topology, kernel_s)).report.step_time_s


def fit(rows: dict[str, dict]) -> float:
    """Least squares in relative error, each step linear in the cost: ``(t0 + slope c) / plan - 1``."""
    a = [r["traced0_s"] / r["plan_s"] - 1 for r in rows.values()]
    b = [r["slope"] / r["plan_s"] for r in rows.values()]
    return max(0.0, -sum(x * y for x, y in zip(a, b)) / sum(y * y for y in b))


def measured_run(path: str, workloads: dict, devices: int) -> dict:
    """One kept calibration: the cost fitted to its measured steps on its refitted topology (module docstring)."""
    from testbed.calibration.calibrated import fit_saved, saved_base
    from testbed.calibration.measurements import read_measurements
    from testbed.calibration.steps import step_plan
    from testbed.sim.graph.engine import simulate

    raw = read_measurements(path)
    topology = with_kernel_s(fit_saved(raw, saved_base(raw))[0], 0.0)
    measured = {s["op"]: float(s["seconds"]) for s in raw["samples"] if s.get("kind") == "step"}
    rows = {}
    for name in (n for n in FIT_STEPS if n in measured):
        t0 = _traced_s(workloads[name], topology, 0.0)
        rows[name] = {"plan_s": measured[name], "traced0_s": t0,
                      "slope": (_traced_s(workloads[name], topology, 10e-6) - t0) / 10e-6}
    kernel_s = fit(rows)
    with_cost = [abs(_traced_s(workloads[n], topology, kernel_s) / measured[n] - 1) for n in rows]
    without = [abs(r["traced0_s"] / r["plan_s"] - 1) for r in rows.values()]
    planned = [abs(simulate(step_plan(n, devices), topology).report.step_time_s / measured[n] - 1) for n in rows]
    return {"run": str(Path(path).parent.name), "steps": len(rows), "kernel_s": kernel_s,
            "traced": {"median_abs": statistics.median(with_cost), "max_abs": max(with_cost)},
            "traced_without_kernel_s": {"median_abs": statistics.median(without), "max_abs": max(without)},
            "plan_median_abs": statistics.median(planned)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="host-cpu-8")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--runs", nargs="*", default=[], help="kept calibrations' measurements.json to check against")
    args = parser.parse_args(argv)
    from testbed.calibration.steps import step_plan
    from testbed.runner.program.plans import trace_plan
    from testbed.sim.graph.engine import simulate
    from testbed.topology.io import load_topology

    topology = with_kernel_s(load_topology(args.topology), 0.0)
    probe = 10e-6
    rows, workloads = {}, {}
    for name in FIT_STEPS + OTHER_STEPS:
        plan = step_plan(name, args.devices)
        workloads[name] = trace_plan(plan)
        t0 = _traced_s(workloads[name], topology, 0.0)
        rows[name] = {"plan_s": simulate(plan, topology).report.step_time_s, "traced0_s": t0,
                      "slope": (_traced_s(workloads[name], topology, probe) - t0) / probe}
    fitted = {n: rows[n] for n in FIT_STEPS}
    kernel_s = fit(fitted)
    for name, row in rows.items():
        row["traced_s"] = _traced_s(workloads[name], topology, kernel_s)
        row["error"] = row["traced_s"] / row["plan_s"] - 1
        row["error_without_kernel_s"] = row["traced0_s"] / row["plan_s"] - 1
        if name in fitted:
            held = fit({n: r for n, r in fitted.items() if n != name})
            row["kernel_s_without"] = held
            row["leave_one_out_error"] = _traced_s(workloads[name], topology, held) / row["plan_s"] - 1
    loo = [abs(rows[n]["leave_one_out_error"]) for n in FIT_STEPS]
    print(json.dumps({
        "benchmark": "traced_kernel_cost", "topology": args.topology, "devices": args.devices,
        "kernel_s": kernel_s, "fit_steps": list(FIT_STEPS), "other_steps": list(OTHER_STEPS),
        "leave_one_out": {"median_abs": statistics.median(loo), "max_abs": max(loo),
                          "kernel_s_range": [min(rows[n]["kernel_s_without"] for n in FIT_STEPS),
                                             max(rows[n]["kernel_s_without"] for n in FIT_STEPS)]},
        "without_kernel_s": {"median_abs": statistics.median(abs(rows[n]["error_without_kernel_s"]) for n in FIT_STEPS),
                             "max_abs": max(abs(rows[n]["error_without_kernel_s"]) for n in FIT_STEPS)},
        "steps": {n: {k: v for k, v in r.items() if k != "slope"} for n, r in rows.items()},
        "measured_runs": [measured_run(path, workloads, args.devices) for path in args.runs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
