"""Accuracy benchmark without JAX: refit saved host validation runs with the current code and re-predict their plans.

``benchmarks/validate_host.py --keep DIR`` measures a calibration and a
validation on this host (about ten minutes, and the host's mood of the day).
The runs kept under ``benchmarks/host_runs/`` (``run-N/measurements.json``:
calibrate's samples; ``run-N/validate_host.json``: what validate measured)
let a change of the fits or of the simulator be judged on the same
measurements in seconds: each run's calibration is refitted from its samples
(:func:`testbed.calibration.calibrated.fit_saved`, as ``testbed calibrate
--from-measurements`` does), every plan of its validation is simulated on
it, and the prediction is compared with

- the measured median step (``raw``), and
- the step at the calibrated speed (``at_calibrated_speed``): validate scaled
  each round by the host's speed then (its reference step's predicted over
  measured time); the refit predicts that reference step anew, so the scale
  is carried over by the ratio of the new prediction to the old one.

It prints ONE JSON object: per run the median / max absolute errors of both,
each plan's signed errors and the reference step's in-sample error (the
calibrated topology against its own measured ``cpu-m`` step); over the runs
the median of the medians and how many met the goal (median <= 0.10, max <=
0.25 at the calibrated speed); per plan (``plans``) whether its error is a
bias or noise: its mean and spread over the runs, and the spread of the
predicted and of the measured ratio to the reference step (the error at the
calibrated speed compares the two: a calibration that moves from run to run
moves the first, the host during validation the second).

    python benchmarks/refit_host_runs.py [RUN_DIR ...]

Default: every ``benchmarks/host_runs/*/run-*`` whose measurements hold the
current calibrate's samples (``launches``, i.e. measured since programs one at
a time were modelled).
"""

from __future__ import annotations

import glob
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL = {"median": 0.10, "max": 0.25}


def _summary(errors: dict[str, float]) -> dict[str, float]:
    """Median and max absolute error, rounded for reading."""
    values = [abs(e) for e in errors.values()]
    return {"median_abs_error": round(statistics.median(values), 4), "max_abs_error": round(max(values), 4)}


def refit_run(folder: Path) -> dict:
    """One run: refit, re-predict, compare (see the module's docstring)."""
    from testbed.calibration.measurements import read_measurements
    from testbed.calibration.steps import step_plan
    from testbed.calibration.calibrated import fit_saved, saved_base
    from testbed.plan.io import load_plan
    from testbed.sim.graph.engine import simulate

    raw = read_measurements(str(folder / "measurements.json"))
    topo, _, _ = fit_saved(raw, saved_base(raw))  # as `testbed calibrate --from-measurements` refits
    validation = json.loads((folder / "validate_host.json").read_text())
    reference = validation["diagnostics"]["reference_step"]
    predicted_ref = simulate(step_plan(reference.get("plan", "cpu-m"), int(raw.get("devices", 8))),
                             topo).report.step_time_s
    measured_ref = next(float(r["seconds"]) for r in raw["samples"]
                        if r.get("kind") == "step" and r.get("op") == reference.get("plan", "cpu-m"))
    scale = predicted_ref / reference["predicted_s"]
    raw_errors, cal_errors, predicted_ratio, measured_ratio = {}, {}, {}, {}
    for row in validation["plans"]:
        plan = load_plan(str(ROOT / "plans" / "validation" / f"{row['plan']}.yaml"))
        predicted = simulate(plan, topo).report.step_time_s
        raw_errors[row["plan"]] = predicted / row["measured_s"] - 1
        at_cal = row["diagnostics"]["measured_at_calibrated_speed_s"] * scale
        cal_errors[row["plan"]] = predicted / at_cal - 1
        # The error at the calibrated speed is that of a ratio: the plan's step over the reference step's,
        # predicted (this refit's calibration) against measured (validate's rounds, each beside the reference).
        predicted_ratio[row["plan"]] = predicted / predicted_ref
        measured_ratio[row["plan"]] = at_cal / predicted_ref
    return {"run": str(folder.relative_to(ROOT)) if folder.is_relative_to(ROOT) else folder.name,
            "reference_in_sample_error": round(predicted_ref / measured_ref - 1, 4),
            "reference_scale": scale,
            "raw": _summary(raw_errors), "at_calibrated_speed": _summary(cal_errors),
            "errors_at_calibrated_speed": dict(sorted(cal_errors.items(), key=lambda kv: kv[1])),
            "errors_raw": raw_errors,  # unrounded: tests check their identities
            "predicted_ratio": predicted_ratio, "measured_ratio": measured_ratio}


def plan_summary(runs: list[dict]) -> dict[str, dict]:
    """Per plan over the runs: bias or noise? The mean and spread of the error at the calibrated speed, the
    runs beyond the goal's max, and the spread (coefficient of variation) of the two ratios the error compares:
    the predicted one moves with each run's calibration, the measured one with the host during validation."""
    def cv(values: list[float]) -> float:
        return statistics.pstdev(values) / statistics.mean(values)

    out = {}
    for plan in sorted({p for r in runs for p in r["errors_at_calibrated_speed"]}):
        have = [r for r in runs if plan in r["errors_at_calibrated_speed"]]
        errors = [r["errors_at_calibrated_speed"][plan] for r in have]
        out[plan] = {"runs": len(have), "mean_error": round(statistics.mean(errors), 4),
                     "sd_error": round(statistics.pstdev(errors), 4),
                     "runs_beyond_max": sum(abs(e) > GOAL["max"] for e in errors),
                     "predicted_ratio_cv": round(cv([r["predicted_ratio"][plan] for r in have]), 4),
                     "measured_ratio_cv": round(cv([r["measured_ratio"][plan] for r in have]), 4)}
    return out


def _current(folder: Path) -> bool:
    rows = json.loads((folder / "measurements.json").read_text()).get("samples", [])
    return any(r.get("kind") == "launches" for r in rows)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args:
        folders = [Path(a).resolve() for a in args]
        missing = [str(f) for f in folders if not (f / "measurements.json").is_file()
                   or not (f / "validate_host.json").is_file()]
        if missing:
            sys.stderr.write(f"refit_host_runs: {', '.join(missing)}: expected a run folder holding "
                             "measurements.json and validate_host.json (benchmarks/host_runs/DATE/run-N)\n")
            return 2
    else:
        folders = [Path(f) for f in sorted(glob.glob(str(ROOT / "benchmarks" / "host_runs" / "*" / "run-*")),
                                           key=lambda f: (Path(f).parent.name, int(f.rsplit("-", 1)[1])))
                   if _current(Path(f))]
    from testbed.errors import InputError

    runs = []
    for folder in folders:
        try:
            runs.append(refit_run(folder))
        except (InputError, ValueError, KeyError, TypeError, StopIteration, OSError) as exc:
            sys.stderr.write(f"refit_host_runs: {folder}: not a usable run ({type(exc).__name__}: {exc}); expected "
                             "calibrate's measurements.json and validate_host.py's JSON output (validate_host.json, "
                             "with plans[].measured_s and diagnostics.reference_step)\n")
            return 2
    medians = [r["at_calibrated_speed"]["median_abs_error"] for r in runs]
    met = [r["run"] for r in runs if r["at_calibrated_speed"]["median_abs_error"] <= GOAL["median"]
           and r["at_calibrated_speed"]["max_abs_error"] <= GOAL["max"]]
    print(json.dumps({"goal_at_calibrated_speed": GOAL, "runs": runs,
                      "median_of_medians_at_calibrated_speed": round(statistics.median(medians), 4) if runs else None,
                      "median_of_medians_raw": round(statistics.median(
                          r["raw"]["median_abs_error"] for r in runs), 4) if runs else None,
                      "runs_meeting_goal": len(met), "runs_total": len(runs), "met": met,
                      "plans": plan_summary(runs)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
