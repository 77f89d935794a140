"""Does the one chip's calibration carry to published v5e slices? MaxText's v5e runs priced both ways.

The 24 MaxText v5e cases of runs.yaml (16B-128B on 1-32 v5e-256 slices) are simulated on their inline topology
``tpu-v5e-16x16-dcn`` twice: as shipped (one matmul efficiency fitted over MaxText's TPU cases, tpu_fit.py) and
with the calibration measured and fitted on one v5e chip (topologies/tpu-v5e-1.yaml: the matmul cap, memory
streams, elementwise passes, splash efficiency, XLA:TPU's rules: fused updates, the MXU width, one bf16 pass for
fp32), nothing fitted to the slices. Prints ONE JSON object: each case's error (predicted / published
tokens per second per chip - 1) both ways and their medians and maxima of |error|.

    python benchmarks/published/v5e_from_chip.py
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runs import case_plan, case_topology, load_cases  # noqa: E402

from testbed.sim.graph.engine import simulate  # noqa: E402
from testbed.topology.io import load_topology  # noqa: E402

SLICES = "tpu-v5e-16x16-dcn"


def chip_calibrated(slices, chip):
    """``slices`` with the one chip's device rules and compute, memory and elementwise calibration."""
    device = replace(slices.device, peak_flops=chip.device.peak_flops, buffer_rules=chip.device.buffer_rules,
                     systolic_width=chip.device.systolic_width, fp32_matmuls=chip.device.fp32_matmuls)
    calibration = replace(slices.calibration, compute=chip.calibration.compute, memory=chip.calibration.memory,
                          elementwise=chip.calibration.elementwise)
    return replace(slices, device=device, calibration=calibration)


def error(case: dict, inline: dict) -> float:
    plan = case_plan(case)
    step = simulate(plan, case_topology(case, inline)).report.step_time_s
    return round(plan.batch.global_batch * plan.model.seq_len / step / int(case["gpus"])
                 / float(case["tokens_per_s_per_gpu"]) - 1, 4)


def main() -> None:
    cases, inline = load_cases()
    chip = dict(inline, **{SLICES: chip_calibrated(inline[SLICES], load_topology("tpu-v5e-1"))})
    rows = [{"case": c["name"], "fitted": error(c, inline), "chip": error(c, chip)}
            for c in cases if c["topology"] == SLICES]
    summary = {k: {"median_abs": round(statistics.median(abs(r[k]) for r in rows), 4),
                   "max_abs": round(max(abs(r[k]) for r in rows), 4),
                   "median": round(statistics.median(r[k] for r in rows), 4)} for k in ("fitted", "chip")}
    print(json.dumps({"cases": len(rows), "summary": summary, "rows": rows}))


if __name__ == "__main__":
    main()
