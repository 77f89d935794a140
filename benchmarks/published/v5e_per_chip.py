"""How much of a published v5e step is one chip's own work? The chip's share of each run, measured on a v5e chip.

Each published v5e run (runs.yaml: AXLearn's Fuji-7B on 4 x v5e-256, MaxText's 16B-128B on v5e-256) trains its
layers on every chip at the chip's share of the batch (fsdp; under tensor parallelism a shard of each layer).
benchmarks/tpu_chip/proxies/ holds that share with 1, 2 or 4 of the model's layers as one-chip plans, predicted on
topologies/tpu-v5e-1.yaml before they ran (``predicted.json``) and then run by the runner on a v5e chip
(``runs.json``, benchmarks/tpu_chip.py). This script prints ONE JSON object:

- per proxy: the recorded and today's prediction against the chip's time (``error`` = predicted / measured - 1);
- per published run: the chip's measured time for all the run's layers, ``chip_step_s``: the proxy's measured time
  times today's prediction of the full-depth proxy over the proxy's (where two depths ran, also the two-point
  ``per_layer_s`` and the depth-free rest: ``linear_step_s``); beside it the published step time
  (global batch x seq / chips / published tokens per second per chip) and testbed's prediction of the run on its
  slices (step and compute), so ``compute_share`` says how much of the published step the chip's own work is.

The proxies run the runner's splash kernel and SGD (so the layers' state fits 16 GiB); a run's own attention kernel
and AdamW shard (1/256 of a layer's update) are not in ``chip_step_s``.

    python benchmarks/published/v5e_per_chip.py
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runs import case_plan, case_topology, load_cases  # noqa: E402

from testbed.plan.io import load_plan  # noqa: E402
from testbed.plan.spec import Plan  # noqa: E402
from testbed.sim.graph.engine import simulate  # noqa: E402
from testbed.topology.io import load_topology  # noqa: E402

PROXIES = Path(__file__).resolve().parents[1] / "tpu_chip" / "proxies"

#: Each published run's proxies (benchmarks/tpu_chip/proxies/<name>.yaml), shallowest first.
RUNS = {
    "axlearn-fuji-7b-v5e-1024chip": ("proxy-fuji7b-v5e-l2", "proxy-fuji7b-v5e-l4"),
    "maxtext-16b-v5e-256chip": ("proxy-maxtext16b-v5e-l1", "proxy-maxtext16b-v5e-l2"),
    "maxtext-32b-v5e-256chip": ("proxy-maxtext32b-v5e-l1",),
    "maxtext-64b-v5e-256chip": ("proxy-maxtext64b-v5e-l1",),
    "maxtext-128b-v5e-256chip": ("proxy-maxtext128b-v5e-l2",),
}


def _step(plan: Plan, topology) -> float:
    return simulate(plan, topology).report.step_time_s


def proxy_rows(chip, measured: dict, recorded: dict) -> dict[str, dict]:
    """Each proxy's measured median, recorded and today's prediction, and today's error."""
    rows = {}
    for name, run in measured.items():
        predicted = _step(load_plan(PROXIES / f"{name}.yaml"), chip)
        rows[name] = {"measured_s": round(run["median_s"], 5), "recorded_prediction_s": recorded[name]["step_time_s"],
                      "predicted_s": round(predicted, 5), "error": round(predicted / run["median_s"] - 1, 4),
                      "mfu_measured": round(run["mfu"], 4)}
    return rows


def chip_share(case: dict, inline: dict, chip, proxies: dict[str, dict]) -> dict:
    """The run's layers on one chip, measured (scaled from its proxies), beside the published and predicted step."""
    plan = case_plan(case)
    names = RUNS[case["name"]]
    shallow = load_plan(PROXIES / f"{names[0]}.yaml")
    deep = replace(shallow, model=replace(shallow.model, layers=plan.model.layers))
    ratio = _step(deep, chip) / _step(shallow, chip)
    row = {"proxies": list(names), "layers": plan.model.layers,
           "chip_step_s": round(proxies[names[0]]["measured_s"] * ratio, 3)}
    if len(names) == 2:
        depths = [load_plan(PROXIES / f"{n}.yaml").model.layers for n in names]
        times = [proxies[n]["measured_s"] for n in names]
        per_layer = (times[1] - times[0]) / (depths[1] - depths[0])
        row |= {"per_layer_s": round(per_layer, 5),
                "linear_step_s": round(times[0] + (plan.model.layers - depths[0]) * per_layer, 3)}
    published = plan.batch.global_batch * plan.model.seq_len / int(case["gpus"]) / float(case["tokens_per_s_per_gpu"])
    report = simulate(plan, case_topology(case, inline)).report
    return row | {"published_step_s": round(published, 3), "compute_share": round(row["chip_step_s"] / published, 3),
                  "predicted_step_s": round(report.step_time_s, 3), "predicted_compute_s": round(report.compute_s, 3)}


def main() -> None:
    chip = load_topology("tpu-v5e-1")
    record = json.loads((PROXIES / "runs.json").read_text())
    measured = {r["plan"]: r for r in record["plans"] if r["ok"]}
    recorded = json.loads((PROXIES / "predicted.json").read_text())["plans"]
    proxies = proxy_rows(chip, measured, recorded)
    cases, inline = load_cases()
    runs = {c["name"]: chip_share(c, inline, chip, proxies) for c in cases if c["name"] in RUNS}
    errors = [abs(r["error"]) for r in proxies.values()]
    print(json.dumps({"date": record["date"], "versions": record["versions"], "device_kind": record["device_kind"],
                      "proxies": proxies, "summary": {"median_abs_error": round(statistics.median(errors), 4),
                                                      "max_abs_error": round(max(errors), 4)},
                      "runs": runs}))


if __name__ == "__main__":
    main()
