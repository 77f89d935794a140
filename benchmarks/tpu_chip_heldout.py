"""Plans the chip suite never saw, predicted before they ran on the v5e chip, against today's predictions.

Two sets of one-chip plans, each a folder of ``benchmarks/tpu_chip/`` with the plans (``*.yaml``), testbed's
predictions made before the first chip call (``predicted.json``, its commit and date) and the runner's measurements
(``runs.json``: median step time, XLA:TPU's ``memory_analysis()``; benchmarks/tpu_chip.py):

- ``heldout``: ten plans of shapes and settings the suite lacks (head dims 96/128, seq 256-8192, a sliding
  window, MoE, parallel blocks with tied embeddings, SGD with 8 microbatches, fp32 at seq 512, ``save-dots``);
- ``heldout2``: four more (a 128,256-token tied vocabulary, multi-query attention at head dims 256 and 128, head dim
  128 at seq 4096 with two microbatches);
- ``moe``: six mixtures of experts (4-16 experts, top-1 and top-2, dropless and capacity factors 1.25 and 2).

For each plan: the measured median, the prediction recorded before the run and today's (testbed.sim.graph.engine
on the bundled ``tpu-v5e-1``), today's step-time error, and today's memory (testbed.model.memory) against XLA:TPU's
total (arguments + outputs + temporaries - aliases) and peak; per set the median and max of the absolute errors
beside the single-chip goals (step 8% / 15%, memory 3% / 8%). Prints ONE JSON object; ``--out`` also writes it
atomically (benchmarks/results/tpu_chip_heldout.json, read by docs_validation.py).

    python benchmarks/tpu_chip_heldout.py [--out benchmarks/results/tpu_chip_heldout.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testbed.model.memory import memory_breakdown  # noqa: E402
from testbed.output import write_atomic  # noqa: E402
from testbed.plan.io import load_plan  # noqa: E402
from testbed.sim.graph.engine import simulate  # noqa: E402
from testbed.topology.io import load_topology  # noqa: E402

CHIP = ROOT / "benchmarks" / "tpu_chip"
SETS = ("heldout", "heldout2", "moe")
GOALS = {"step_time": {"median_abs": 0.08, "max_abs": 0.15}, "memory_vs_xla": {"median_abs": 0.03, "max_abs": 0.08}}


def plan_row(folder: Path, run: dict, recorded: dict, chip) -> dict:
    """One measured plan: measured, recorded and today's predictions, today's errors."""
    plan = load_plan(str(folder / f"{run['plan']}.yaml"))
    step = simulate(plan, chip).report.step_time_s
    memory = memory_breakdown(plan, chip).total
    xla = run["memory"]
    return {"measured_s": round(run["median_s"], 5), "recorded_prediction_s": recorded["step_time_s"],
            "predicted_s": round(step, 5), "error": round(step / run["median_s"] - 1, 4),
            "mfu_measured": round(run["mfu"], 4), "xla_total": xla["total"], "xla_peak": xla["peak"],
            "predicted_memory": int(memory), "memory_error": round(memory / xla["total"] - 1, 4),
            "memory_error_vs_peak": round(memory / xla["peak"] - 1, 4)}


def _spread(errors: list[float]) -> dict[str, float]:
    return {"median_abs": round(statistics.median(abs(e) for e in errors), 4),
            "max_abs": round(max(abs(e) for e in errors), 4)}


def set_report(name: str, chip) -> dict:
    """One set's rows and their spread; ``ValueError`` if a plan has no measurement or no prior prediction."""
    folder = CHIP / name
    runs = json.loads((folder / "runs.json").read_text())
    predicted = json.loads((folder / "predicted.json").read_text())
    if predicted["predicted_on"] > runs["date"][:10]:
        raise ValueError(f"{folder}/predicted.json is dated after the chip runs")
    rows = {}
    for run in runs["plans"]:
        if not run["ok"]:
            raise ValueError(f"{folder}/runs.json: {run['plan']} did not run")
        rows[run["plan"]] = plan_row(folder, run, predicted["plans"][run["plan"]], chip)
    if sorted(rows) != sorted(predicted["plans"]):
        raise ValueError(f"{folder}: the measured plans are not the predicted ones")
    return {"date": runs["date"], "versions": runs["versions"], "device_kind": runs["device_kind"],
            "command": runs["command"], "predicted_at": predicted["testbed_commit"],
            "step_time": _spread([r["error"] for r in rows.values()]),
            "recorded_step_time": _spread([r["recorded_prediction_s"] / r["measured_s"] - 1 for r in rows.values()]),
            "memory_vs_xla": _spread([r["memory_error"] for r in rows.values()]),
            "memory_vs_xla_peak": _spread([r["memory_error_vs_peak"] for r in rows.values()]),
            "rows": rows}


def report() -> dict:
    chip = load_topology("tpu-v5e-1")
    return {"benchmark": "tpu_chip_heldout", "topology": "tpu-v5e-1", "goal": GOALS,
            "sets": {name: set_report(name, chip) for name in SETS}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON here (atomically)")
    args = parser.parse_args(argv)
    text = json.dumps(report(), indent=1)
    if args.out:
        write_atomic(Path(args.out), text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
