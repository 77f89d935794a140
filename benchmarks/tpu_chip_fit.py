"""The TPU v5e compute calibration: the chip's measured rates, and what they leave fitted over the chip's suite.

Sources, all measured on one v5e chip (``benchmarks/tpu_chip/``, recorded by benchmarks/tpu_chip.py):

- the matmul cap, ``compute.efficiency``: ``testbed calibrate --devices local``'s bf16 matmul rate
  (``calibration.json``, fit ``matmul bf16``: dispatch subtracted, 256-8192 square products) over the
  197 TFLOP/s datasheet peak;
- the fp32 peak: the same fit's fp32 rate (products at ``HIGHEST``, XLA:TPU's six bf16 passes) over the cap;
- ``memory.efficiency``: the fit ``memory`` (a read and a write of 2-512 MiB) over the 819 GB/s datasheet
  bandwidth.

- the controller, ``controller.overhead_s`` and ``buffer_s``: what a step takes beyond its XLA program on the
  chip's own trace (the measured step less the profile's ``XLA Modules`` time per step: dispatch, the buffers'
  hand-over, the wait for the result), fitted as one program's overhead plus a time per device buffer it passes
  (in and out) over every profiled step: the suite's plans (``profiles.json``, buffers as
  testbed.model.buffers.spmd_step_buffers counts them) and users' programs (``programs.json``, their traced
  argument buffers); least squares of the relative error, leave-one-out printed.

What the microbenchmarks cannot see is fitted over the category of the single-chip suite (every plan
``runs.json`` records as run: GPT and Llama-style, bf16 and fp32, remat none / selective / full, gradient
accumulation, the splash kernel, seq 1024-4096), three non-negative values shared by all:
``elementwise.replicated_passes`` and ``split_passes`` (memory passes over the activations a layer writes,
testbed.model.activations.layer_traffic_bytes: the residual stream's, and the rest) and ``compute.flash_efficiency``
(the splash kernels' fraction of the peak). ``compute.gemm_latency_s`` (a fixed time per matmul) is the chip's GEMM
sweep's (``gemm_shapes.json``), not fitted to steps: fitted there it took up what no per-matmul cost explains.

One device, no communication: a step's simulated time is linear in the passes, the latency and
``1 / flash_efficiency``, so each plan is simulated five times (a base and one unit of each) and the fit is linear
least squares of the relative error, bounded below by 0 (scipy's ``lsq_linear``); each leave-one-out refit
likewise. The errors printed are the simulator's own at the fitted values (not the decomposition's).

    python benchmarks/tpu_chip_fit.py [--check]

prints ONE JSON object: the sources, the fitted values, in-sample and leave-one-out errors per plan and
summarised, and the values the bundled ``topologies/tpu-v5e-1.yaml`` ships; ``--check`` exits 1 when those are
not the fit's (rounded as shipped).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "tpu_chip"
#: Cloud TPU v5e datasheet: bf16 peak and HBM bandwidth per chip.
PEAK_BF16, BANDWIDTH = 197e12, 819e9
#: The fitted values, in the order of the decomposition's columns.
FITTED = ("replicated_passes", "split_passes", "gemm_latency_s", "inverse_flash_efficiency")
#: The latency's column: measured by the GEMM sweep (:func:`sweep_latency`), not fitted.
LATENCY = FITTED.index("gemm_latency_s")
#: The least per-matmul latency: a positive one prices matmuls by shape (testbed.sim.price.compute), the only pricing that
#: keeps the splash kernel's products apart (ComputeCalibration.shapes).
MIN_LATENCY_S = 1e-9
#: Rounding of what the topologies ship.
DIGITS = {"efficiency": 3, "memory_efficiency": 3, "fp32_tflops": 1, "replicated_passes": 2, "split_passes": 2,
          "gemm_latency_s": 9, "flash_efficiency": 3, "controller_overhead_s": 6, "controller_buffer_s": 8}


@dataclass(frozen=True, slots=True)
class Row:
    """One recorded plan: its measured median step and its simulated step's decomposition."""

    plan: str
    measured_s: float
    base_s: float
    units: tuple[float, ...]  #: seconds each FITTED value adds per unit

    def predicted(self, values: np.ndarray) -> float:
        return self.base_s + float(np.dot(self.units, values))


def sources(controller: dict) -> dict:
    """The chip's microbenchmark rates (calibration.json's fits) and ``controller`` (:func:`controller_report`) as
    the topology's fields."""
    fits = json.loads((DATA / "calibration.json").read_text())["fits"]
    bf16, fp32 = fits["matmul bf16"]["values"]["flops_per_s"], fits["matmul fp32"]["values"]["flops_per_s"]
    efficiency = bf16 / PEAK_BF16
    return {"controller_overhead_s": controller["controller_overhead_s"],
            "controller_buffer_s": controller["controller_buffer_s"],
            "efficiency": round(efficiency, DIGITS["efficiency"]),
            "fp32_tflops": round(fp32 / efficiency / 1e12, DIGITS["fp32_tflops"]),
            "memory_efficiency": round(fits["memory"]["values"]["bytes_per_s"] / BANDWIDTH, DIGITS["memory_efficiency"]),
            "gemm_latency_s": sweep_latency(efficiency)}


def sweep_latency(efficiency: float) -> float:
    """The per-matmul latency the chip's GEMM sweep shows (gemm_shapes.json: 62 shapes timed one matmul at a time,
    fitted by testbed.sim.price.compute.fit_shape_model at the measured cap), at least :data:`MIN_LATENCY_S`."""
    from testbed.sim.price.compute import fit_shape_model

    sweep = json.loads((DATA / "gemm_shapes.json").read_text())
    rows = [(1, r["m"], r["n"], r["k"], r["flops_per_s"]) for r in sweep["rows"]]
    fitted = fit_shape_model(rows, PEAK_BF16, BANDWIDTH, efficiency, dtype_bytes=4.0 if sweep["dtype"] == "fp32" else 2.0)
    return round(max(MIN_LATENCY_S, fitted["gemm_latency_s"]), DIGITS["gemm_latency_s"])


@dataclass(frozen=True, slots=True)
class Gap:
    """One profiled step: its device buffers and what it took beyond its XLA program."""

    step: str
    buffers: int
    gap_s: float


def step_gaps() -> list[Gap]:
    """The profiled plans' and programs' steps beyond their programs (module docstring)."""
    import os

    from testbed.model.buffers import spmd_step_buffers
    from testbed.plan.io import load_plan

    def modules_s(planes: dict) -> float:
        return next(iter(planes.values()))["lines_ns_per_step"]["XLA Modules"] * 1e-9

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tpu_chip import measured_then

    measured = {r["plan"]: r for r in runs()["plans"] if r["ok"]}
    profiles = json.loads((DATA / "profiles.json").read_text())
    profiled = profiles["calls"][-1]["date"]  # the runner profiled: the one measured by then
    gaps = [Gap(p["plan"], spmd_step_buffers(load_plan(str(DATA / "plans" / f"{p['plan']}.yaml"))),
                measured_then(measured[p["plan"]], profiled)["median_s"] - modules_s(p["planes"]))
            for p in profiles["plans"] if p["ok"] and p["planes"]]
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    from program_chip import traced

    for name, row in json.loads((DATA / "programs.json").read_text())["rows"].items():
        workload = traced(name, jax.devices("cpu")[0], row["sizes"])[0]
        gaps.append(Gap(name, workload.buffers, row["measured_s"] - modules_s(row["profile"])))
    return gaps


def controller_fit(gaps: list[Gap]) -> tuple[float, float]:
    """(overhead_s, buffer_s): least squares of the relative error of ``overhead + buffers x buffer_s``."""
    a = np.array([[1.0 / g.gap_s, g.buffers / g.gap_s] for g in gaps])
    overhead, per_buffer = np.linalg.lstsq(a, np.ones(len(gaps)), rcond=None)[0]
    return float(overhead), float(per_buffer)


def controller_report(gaps: list[Gap]) -> dict:
    """The controller's fit, its in-sample and leave-one-out errors per step."""
    overhead, per_buffer = controller_fit(gaps)
    rows = {}
    for i, g in enumerate(gaps):
        o, b = controller_fit(gaps[:i] + gaps[i + 1:])
        rows[g.step] = {"buffers": g.buffers, "gap_s": round(g.gap_s, 6),
                        "in_sample": round((overhead + per_buffer * g.buffers) / g.gap_s - 1, 4),
                        "leave_one_out": round((o + b * g.buffers) / g.gap_s - 1, 4)}
    return {"controller_overhead_s": round(overhead, DIGITS["controller_overhead_s"]),
            "controller_buffer_s": round(per_buffer, DIGITS["controller_buffer_s"]), "steps": rows,
            "in_sample": _summary([r["in_sample"] for r in rows.values()]),
            "leave_one_out": _summary([r["leave_one_out"] for r in rows.values()])}


def topology(values: dict):
    """The bundled one-chip v5e topology with ``values`` (sources and fitted fields) in place."""
    from testbed.calibration.calibrated import base_topology

    base = base_topology(None, "tpu", 1, "TPU v5 lite")
    device = replace(base.device, peak_flops={"bf16": PEAK_BF16, "fp32": values["fp32_tflops"] * 1e12})
    flash = values["flash_efficiency"]
    calibration = base.calibration.updated(
        compute={"efficiency": values["efficiency"], "flash_efficiency": flash,
                 "gemm_latency_s": values["gemm_latency_s"]},
        memory={"efficiency": values["memory_efficiency"]},
        elementwise={"replicated_passes": values["replicated_passes"], "split_passes": values["split_passes"]},
        controller={"overhead_s": values["controller_overhead_s"], "buffer_s": values["controller_buffer_s"]})
    return replace(base, device=device, calibration=calibration)


def runs() -> dict:
    """``runs.json``: what the chip recorded."""
    return json.loads((DATA / "runs.json").read_text())


def recorded() -> list[tuple[object, dict]]:
    """(plan, runs.json row) of every plan the chip ran."""
    from testbed.plan.io import load_plan

    return [(load_plan(str(DATA / "plans" / f"{r['plan']}.yaml")), r) for r in runs()["plans"] if r["ok"]]


def step_s(plan, values: dict) -> float:
    from testbed.sim.graph.engine import simulate

    return simulate(plan, topology(values)).report.step_time_s


def decompose(plans: list[tuple[object, dict]], src: dict) -> list[Row]:
    """Each plan simulated at a base (no passes, the least latency, flash at the peak) and one unit of each
    fitted value: its step time as ``base + units . values``."""
    zero = src | {"replicated_passes": 0.0, "split_passes": 0.0, "gemm_latency_s": MIN_LATENCY_S,
                  "flash_efficiency": 1.0}
    bumps = ({"replicated_passes": 1.0}, {"split_passes": 1.0}, {"gemm_latency_s": 1e-6}, {"flash_efficiency": 0.5})
    scale = (1.0, 1.0, 1e6, 1.0)  # per unit: a pass, a second of latency, one more of 1 / flash_efficiency
    rows = []
    for plan, row in plans:
        base = step_s(plan, zero)
        units = tuple((step_s(plan, zero | bump) - base) * k for bump, k in zip(bumps, scale))
        rows.append(Row(row["plan"], row["median_s"], base - units[3] - units[2] * MIN_LATENCY_S, units))
    return rows


def fit(rows: list[Row], latency_s: float) -> np.ndarray:
    """Non-negative least squares of the relative error over ``rows``: the FITTED values, the per-matmul latency
    held at ``latency_s`` (the GEMM sweep's, :func:`sweep_latency`)."""
    from scipy.optimize import lsq_linear

    a = np.array([[u / r.measured_s for u in r.units] for r in rows])
    b = np.array([1.0 - r.base_s / r.measured_s for r in rows]) - a[:, LATENCY] * latency_s
    x = lsq_linear(np.delete(a, LATENCY, axis=1), b, bounds=([0.0, 0.0, 1.0], np.inf)).x
    return np.insert(x, LATENCY, latency_s)


def as_fields(x: np.ndarray) -> dict:
    values = dict(zip(FITTED, (float(v) for v in x)))
    inverse = max(values.pop("inverse_flash_efficiency"), 1.0)
    values["flash_efficiency"] = 1.0 / inverse
    return {k: round(v, DIGITS[k]) for k, v in values.items()}


def _summary(errors: list[float]) -> dict:
    return {"median_abs": round(statistics.median(abs(e) for e in errors), 4),
            "max_abs": round(max(abs(e) for e in errors), 4)}


def shipped() -> dict:
    """The values the bundled one-chip v5e topology ships."""
    from testbed.calibration.calibrated import base_topology

    t = base_topology(None, "tpu", 1, "TPU v5 lite")
    c, e, h = t.calibration.compute, t.calibration.elementwise, t.calibration.controller
    return {"controller_overhead_s": h.overhead_s if h else 0.0, "controller_buffer_s": h.buffer_s if h else 0.0,
            "efficiency": c.efficiency, "fp32_tflops": round(t.device.peak_flops["fp32"] / 1e12, 1),
            "memory_efficiency": t.calibration.memory.efficiency,
            "replicated_passes": e.replicated_passes if e else 0.0, "split_passes": e.split_passes if e else 0.0,
            "gemm_latency_s": c.gemm_latency_s, "flash_efficiency": c.flash_efficiency}


def report() -> dict:
    plans = recorded()
    controller = controller_report(step_gaps())
    src = sources(controller)
    rows = decompose(plans, src)
    values = src | as_fields(fit(rows, src["gemm_latency_s"]))
    in_sample = {r.plan: step_s(p, values) / r.measured_s - 1 for (p, _), r in zip(plans, rows)}
    left_out = {}
    for i, ((plan, _), row) in enumerate(zip(plans, rows)):
        refit = as_fields(fit(rows[:i] + rows[i + 1:], src["gemm_latency_s"]))
        left_out[row.plan] = step_s(plan, src | refit) / row.measured_s - 1
    return {"sources": src, "fitted": {k: values[k] for k in values if k not in src}, "plans": len(rows),
            "controller": controller,
            "recorded": {k: runs()[k] for k in ("date", "versions", "device_kind", "steps", "rounds")}
            | {"last_date": runs()["calls"][-1]["date"]},
            "chip": chip_rows(values),
            "in_sample": _summary(list(in_sample.values())), "leave_one_out": _summary(list(left_out.values())),
            "per_plan": {p: {"in_sample": round(in_sample[p], 4), "leave_one_out": round(left_out[p], 4)}
                         for p in in_sample},
            "shipped": shipped(), "values": values}


def chip_rows(values: dict) -> list[dict]:
    """Per recorded plan: measured step and MFU, the step predicted at ``values`` (the fit), memory measured by
    XLA:TPU (``memory_analysis``: arguments + outputs + temporaries - aliases) and predicted; a plan the chip did
    not run, its error (out of HBM) and the predicted total."""
    from testbed.model.memory import memory_breakdown
    from testbed.plan.io import load_plan

    topo, rows = topology(values), []
    for row in runs()["plans"]:
        plan = load_plan(str(DATA / "plans" / f"{row['plan']}.yaml"))
        out = {"plan": row["plan"], "ok": row["ok"], "predicted_memory": memory_breakdown(plan, topo).total}
        if row["ok"]:
            out |= {"measured_s": row["median_s"], "mfu": row["mfu"], "predicted_s": step_s(plan, values),
                    "measured_memory": row["memory"]["total"], "attention_kernel": row["attention_kernel"]}
        else:
            out["error"] = row.get("error", row.get("skipped", ""))[:120]
        rows.append(out)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when topologies/tpu-v5e-1.yaml ships other values")
    parser.add_argument("--out", help="also write the JSON here, atomically (benchmarks/results/tpu_chip_fit.json, "
                                      "which docs/validation.md's chip table is generated from)")
    args = parser.parse_args(argv)
    out = report()
    print(json.dumps(out))
    if args.out:
        from tpu_chip import write_atomic

        write_atomic(Path(args.out), json.dumps(out, indent=1) + "\n")
    if args.check and any(abs(out["shipped"][k] - v) > 10 ** -DIGITS[k] for k, v in out["values"].items()):
        print("tpu_chip_fit.py: topologies/tpu-v5e-1.yaml does not ship the fit's values", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
