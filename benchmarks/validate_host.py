"""Accuracy benchmark: calibrate this host's devices, then validate a suite of plans on them.

Runs ``testbed calibrate --devices D`` and ``testbed validate`` (each in a
fresh process, as a user would): by default on 8 emulated CPU devices with
every plan of ``plans/validation/``; with ``--devices local`` on this
machine's accelerator with the single-device plans of
``plans/validation-1dev/`` (one GPU or TPU chip; pass plans whose mesh is the
local device count for more). It prints ONE JSON object:
``median_abs_error`` and ``max_abs_error`` of the predicted vs measured
(median) step time (goal: <= 0.10 and <= 0.25), the same against each plan's
fastest step (``*_fastest_step``: less disturbed by other processes on a
shared host), the same for memory, per-plan rows (with ``errors``: every
Report field's error, and the plan's host-drift ``diagnostics``), the fitted
fields, the wall time of each phase and the host's load average (other
processes on the host's cores distort both the calibration and the measured
steps); under ``diagnostics``, validate's reference step (the host's speed
during validation against its calibration) and the errors at the calibrated
host speed.

    python benchmarks/validate_host.py [--devices emulated:8|local] [--quick] [--topology FILE] [--steps S]
                                       [--rounds R] [--keep DIR] [PLAN ...]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _testbed(*args: str) -> dict:
    """Run ``testbed ARGS --json`` in a fresh process; its JSON object."""
    cmd = [sys.executable, "-m", "testbed.cli", *args, "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"`testbed {' '.join(args)}` failed with status {done.returncode}")
    return json.loads(done.stdout)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="emulated:8", help="emulated:8 (default) or local (a GPU/TPU machine)")
    parser.add_argument("--quick", action="store_true", help="calibrate --quick")
    parser.add_argument("--topology", default=None, help="validate against this calibrated topology (skip calibrate)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per plan (default 5)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of validate's plans and of calibrate's training steps; each keeps its "
                             "least disturbed median (default 5)")
    parser.add_argument("--keep", default=None, help="folder to keep the calibrated topology and measurements in")
    parser.add_argument("plans", nargs="*", help="plans (default plans/validation/*.yaml; with --devices local "
                                                 "plans/validation-1dev/*.yaml)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    suite = "validation-1dev" if args.devices == "local" else "validation"
    plans = args.plans or sorted(glob.glob(str(ROOT / "plans" / suite / "*.yaml")))
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="validate-host-") as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)  # --keep DIR may name a folder not made yet
        started = time.perf_counter()
        calibration = None
        topology = args.topology
        if topology is None:
            topology = str(folder / "calibrated.yaml")
            calibration = _testbed("calibrate", "--devices", args.devices, "--out", topology, "--rounds",
                                   str(args.rounds), *(["--quick"] if args.quick else []))
        calibrate_s = time.perf_counter() - started
        started = time.perf_counter()
        result = _testbed("validate", "--topology", topology, "--devices", args.devices, "--steps", str(args.steps),
                          "--rounds", str(args.rounds), *plans)
        validate_s = time.perf_counter() - started
    diagnostics = result.get("diagnostics") or {}
    out = {
        "median_abs_error": result["median_abs_error"],
        "max_abs_error": result["max_abs_error"],
        "median_abs_error_fastest_step": result.get("median_abs_error_fastest"),
        "max_abs_error_fastest_step": result.get("max_abs_error_fastest"),
        "median_abs_memory_error": result.get("median_abs_memory_error"),
        "max_abs_memory_error": result.get("max_abs_memory_error"),
        "goal": {"median_abs_error": 0.10, "max_abs_error": 0.25},
        "plans": [{**{k: p.get(k) for k in ("plan", "predicted_s", "measured_s", "error", "predicted_memory",
                                            "measured_memory", "memory_error", "predicted_controller_s",
                                            "measured_controller_s", "round_medians_s", "errors")},
                   "fastest_step_s": min(p["step_times_s"]), "diagnostics": p.get("diagnostics")}
                  for p in result["plans"]],
        # Host drift, not the model's accuracy: calibrate's own DP step timed during validate (speed > 1: the host
        # ran faster than when calibrated), and the errors with each plan's rounds scaled by the host's speed beside
        # them (what is left of the error without the drift since calibration).
        "diagnostics": {"reference_step": diagnostics.get("reference_step"),
                        "median_abs_error_at_calibrated_speed": diagnostics.get("median_abs_error_at_calibrated_speed"),
                        "max_abs_error_at_calibrated_speed": diagnostics.get("max_abs_error_at_calibrated_speed")},
        "fitted": calibration["fitted"] if calibration else None,
        "fit_quality": {k: {"r2": v["r2"], "median_abs_rel_residual": v["median_abs_rel_residual"]}
                        for k, v in calibration["fits"].items()} if calibration else None,
        "calibrate_s": calibrate_s,
        "validate_s": validate_s,
        "steps": args.steps,
        "rounds": args.rounds,
        "devices": args.devices,
        "device": result.get("devices"),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpu_count": os.cpu_count(),
    }
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
