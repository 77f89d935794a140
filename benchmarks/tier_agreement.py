"""The analytic tier against the task graph on every bundled plan and every published run.

Both tiers play one walk of the step (testbed.sim.step.step_rules.action_steps): the task graph (testbed.sim.graph.program,
played by the DES, testbed.sim.graph.engine) and the analytic tier (testbed.explore.analytic). Their step times differ by
what the DES adds (link sharing between concurrent streams, a shared host's share as stages idle), so the gap on
a plan measures that, not two readings of a rule. Plans: ``plans/*.yaml`` and ``plans/validation/`` on their own
topology, ``plans/validation-1dev/`` on ``tpu-v5e-1``, and every published run of ``benchmarks/published/`` (as
benchmarks/search_vs_published.py builds them).

Prints one JSON object: ``rows`` (``plan``, ``topology``, ``des_s``, ``analytic_s``, ``ratio`` analytic over DES),
``max_gap`` (the largest ``|ratio - 1|``), ``worst`` (its plan), ``over_3pct`` (the plans off by more than 3%).

Run: ``.venv/bin/python benchmarks/tier_agreement.py [--bundled-only] [--max-devices N]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from search_vs_published import published_runs  # noqa: E402

from testbed.explore.analytic import estimate  # noqa: E402
from testbed.plan.io import load_plan  # noqa: E402
from testbed.sim.graph.engine import simulate  # noqa: E402
from testbed.topology.io import load_topology  # noqa: E402


def bundled() -> list[tuple[str, object, object]]:
    """(name, plan, topology) of every bundled plan."""
    out = []
    for folder, default in (("plans", None), ("plans/validation", None), ("plans/validation-1dev", "tpu-v5e-1")):
        for path in sorted((ROOT / folder).glob("*.yaml")):
            plan = load_plan(str(path))
            name = plan.topology or default
            if name is not None:
                out.append((f"{folder}/{path.stem}", plan, load_topology(name)))
    return out


def row(name: str, plan, topology) -> dict:
    """One plan's two step times and their ratio."""
    des = simulate(plan, topology).report.step_time_s
    analytic = estimate(plan, topology).step_time_s
    return {"plan": name, "topology": topology.name, "devices": topology.num_devices, "des_s": round(des, 6),
            "analytic_s": round(analytic, 6), "ratio": round(analytic / des, 5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundled-only", action="store_true", help="leave the published runs out")
    parser.add_argument("--max-devices", type=int, help="keep the published runs on at most this many devices")
    args = parser.parse_args()
    runs = bundled()
    if not args.bundled_only:
        runs += [(f"published/{n}", p, t) for n, p, t in published_runs()
                 if not args.max_devices or t.num_devices <= args.max_devices]
    rows = []
    for name, plan, topology in runs:
        rows.append(row(name, plan, topology))
        print(f"{name}: {rows[-1]['ratio']}", file=sys.stderr, flush=True)
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1.0))
    print(json.dumps({"rows": rows, "max_gap": round(abs(worst["ratio"] - 1.0), 5), "worst": worst["plan"],
                      "over_3pct": [r["plan"] for r in rows if abs(r["ratio"] - 1.0) > 0.03]}))


if __name__ == "__main__":
    main()
