"""The GPU compute calibration's sustained fraction, fitted per device generation over every published GPU step.

The GPU topologies cap a matmul at mamf-finder's Maximum Achievable Matmul FLOPS (A100 0.859, H100 0.801 of
the datasheet peak: one matmul shape at a time, for well under a second); at that cap alone every published GPU
step is predicted faster than it ran (median +13% on A100, +30% on H100). What a whole training step sustains is
lower: clocks held down by the board's power and thermal limits over minutes (a matmul's speed depends on its
power draw: Horace He, "Strangely, Matrix Multiplications on GPUs Run Faster When Given 'Predictable' Data",
thonking.ai, 2024: 295 vs 257 TFLOP/s on an A100 for zeros vs randn, 13%), and compute-proportional work no
plan lists. No published measurement pins the sustained fraction of a training step, so it is one number per
GPU generation, ``device.sustained`` (testbed.topology.parts.DeviceSpec: it multiplies every matmul's rate -
GEMMs at any shape, fp8, attention kernels - and never a memory pass or a transfer), fitted here over the
whole category of that generation:

- ``A100``: every A100 case of runs.yaml and the ten rows of Megatron-LM's SC21 Table 1 (megatron.yaml);
- ``H100``: every H100 case of runs.yaml.

Least squares of the relative error of the published rate (tokens/s per device, Table 1's TFLOP/s per GPU), on
a grid (0.5-1.0 by 0.005): the TPU fit's objective (tpu_fit.loss). A case's step time is ``other_s + math_s / sustained`` (math: every matmul; other: memory
passes, exposed communication, bubbles at their ``sustained`` 1 size); each case is simulated twice, at
``sustained`` 1 and at :data:`PROBE`, on its topology as shipped otherwise (power limit, comm_slowdown included),
and the fit and every leave-one-out refit are exact on that decomposition (it is linear only while the exposed
communication does not change with the math's speed: the fit's in-sample errors are checked against the
benchmark's own simulation at the shipped values). :func:`fit_report` prints the fitted values, in-sample and
leave-one-out errors per category and per case, the one-value-for-both-generations alternative beside them, and
which topologies carry which value; ``--check`` exits 1 when a shipped value differs from the fit (after a
change to any pricing, rerun this and ship what it prints under ``ship``).

    .venv/bin/python benchmarks/published/gpu_fit.py [--check]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import end_to_end
import runs
import yaml
from tpu_fit import loss

from testbed.explore.space import resize_topology
from testbed.plan.io import plan_from_dict
from testbed.sim.graph.engine import simulate
from testbed.topology.io import load_topology
from testbed.topology.spec import Topology

#: GPU generations fitted, by the device name of a case's topology (each topology's device must name one).
GENERATIONS = ("A100", "H100")
#: The grid searched for ``sustained``: (low, high, step).
GRID = (0.5, 1.0, 0.005)
#: The second ``sustained`` each case is simulated at (with 1) to split its step into math and the rest.
PROBE = 0.8


def generation(topology: Topology) -> str | None:
    """The GPU generation a topology's device belongs to (None: not fitted here, e.g. a TPU)."""
    return next((g for g in GENERATIONS if g in topology.device.name), None)


def held(topology: Topology, sustained: float) -> Topology:
    """``topology`` with its device's ``sustained`` fraction set."""
    return replace(topology, device=replace(topology.device, sustained=sustained))


def _split(name: str, category: str, plan, topology: Topology, published_s: float, base: str,
           origin: tuple[str, str]) -> dict:
    """One case's step as ``other_s + math_s / sustained`` and the step time its published rate means (``base``:
    the name of the topology the case resizes; ``origin``: its stack and source url; ``shipped``: the value its
    topology carries)."""
    step = {x: simulate(plan, held(topology, x)).report.step_time_s for x in (1.0, PROBE)}
    math = (step[PROBE] - step[1.0]) / (1 / PROBE - 1)
    return {"case": name, "category": category, "generation": generation(topology), "topology": base,
            "stack": origin[0], "source": origin[1], "shipped": topology.device.sustained,
            "math_s": math, "other_s": step[1.0] - math, "published_s": published_s}


def run_rows(path=runs.CASES) -> list[dict]:
    """runs.yaml's GPU cases, decomposed (published step: global batch x sequence / published tokens/s / devices)."""
    cases, inline = runs.load_cases(path)
    out = []
    for case in cases:
        plan, topology = runs.case_plan(case), runs.case_topology(case, inline)
        if generation(topology) is None:
            continue
        tokens = plan.batch.global_batch * plan.model.seq_len
        out.append(_split(case["name"], f"runs {case['stack']}", plan, topology,
                          tokens / float(case["tokens_per_s_per_gpu"]) / int(case["gpus"]), case["topology"],
                          (case["stack"], case["url"])))
    return out


def table1_rows(path=end_to_end.CASES) -> list[dict]:
    """Megatron-LM SC21 Table 1's rows, decomposed (published step: the FLOPs the simulated step executes over the
    published TFLOP/s per GPU and the GPUs, so the error is end_to_end.py's)."""
    data = yaml.safe_load(Path(path).read_text())
    setup = data["setup"]
    base = load_topology(setup["topology"])
    out = []
    for row in data["cases"]:
        spec = end_to_end.plan_dict(row, setup)
        plan = plan_from_dict(spec, default_name=spec["name"])
        gpus = int(row["gpus"])
        published_s = end_to_end.executed_flops(plan) / (float(row["tflops_per_gpu"]) * 1e12 * gpus)
        out.append(_split(spec["name"], "end_to_end megatron-lm", plan, resize_topology(base, gpus), published_s,
                          setup["topology"], ("megatron-lm", data["url"])))
    return out


def all_rows(path=runs.CASES, table1=end_to_end.CASES) -> list[dict]:
    """Every GPU case decomposed: runs.yaml's and Table 1's."""
    return run_rows(path) + table1_rows(table1)


def error(row: dict, sustained: float) -> float:
    """Predicted over published rate, minus 1, at ``sustained`` (the decomposition's step time)."""
    return row["published_s"] / (row["other_s"] + row["math_s"] / sustained) - 1


def _grid() -> list[float]:
    low, high, step = GRID
    return [round(low + i * step, 6) for i in range(int(round((high - low) / step)) + 1)]


def fit(rows: list[dict]) -> float:
    """The ``sustained`` of least summed :func:`tpu_fit.loss` over ``rows`` (ties: the highest on the grid)."""
    cost = {x: sum(loss(error(r, x)) for r in rows) for x in _grid()}
    return min(cost, key=lambda x: (round(cost[x], 12), -x))


def leave_one_out(rows: list[dict]) -> list[float]:
    """Each row's error under the fit over the other rows."""
    return [error(r, fit(rows[:i] + rows[i + 1:])) for i, r in enumerate(rows)]


def summary(errors: list[float]) -> dict:
    magnitudes = [abs(e) for e in errors]
    return {"cases": len(errors), "median_abs_error": round(statistics.median(magnitudes), 4),
            "max_abs_error": round(max(magnitudes), 4),
            "median_signed_error": round(statistics.median(errors), 4)}


def _by_category(rows: list[dict], errors: list[float]) -> dict:
    groups: dict[str, list[float]] = {}
    for r, e in zip(rows, errors):
        groups.setdefault(r["category"], []).append(e)
    return {name: summary(picked) for name, picked in sorted(groups.items())}


def generation_report(rows: list[dict]) -> dict:
    """One generation's fit: value, in-sample and leave-one-out errors (all, per category, per case), and the
    errors at ``sustained`` 1 (no fit) for comparison."""
    value = fit(rows)
    in_sample, left_out, unfitted = [error(r, value) for r in rows], leave_one_out(rows), [error(r, 1.0) for r in rows]
    return {"fitted": value, "cases": len(rows), "unfitted": summary(unfitted), "in_sample": summary(in_sample),
            "leave_one_out": summary(left_out),
            "by_category": {"in_sample": _by_category(rows, in_sample), "leave_one_out": _by_category(rows, left_out)},
            "rows": [{"case": r["case"], "unfitted": round(u, 4), "in_sample": round(a, 4), "leave_one_out": round(b, 4)}
                     for r, u, a, b in zip(rows, unfitted, in_sample, left_out)]}


def shared_report(rows: list[dict]) -> dict:
    """The alternative of one ``sustained`` for every GPU generation: its value and summaries."""
    value = fit(rows)
    return {"fitted": value, "in_sample": summary([error(r, value) for r in rows]),
            "leave_one_out": summary(leave_one_out(rows))}


def shipped(rows: list[dict], path=runs.CASES) -> dict:
    """``{generation: {value: [topology names]}}``: the ``device.sustained`` each topology the cases run on
    carries (bundled ones from topologies/, inline ones from runs.yaml)."""
    _, inline = runs.load_cases(path)
    out: dict[str, dict[str, list[str]]] = {}
    for name in sorted({r["topology"] for r in rows}):
        topology = inline[name] if name in inline else load_topology(name)
        out.setdefault(generation(topology), {}).setdefault(f"{topology.device.sustained:g}", []).append(name)
    return out


def stale(ships: dict, fitted: dict[str, float]) -> dict:
    """The topologies of :func:`shipped` whose value is not their generation's ``fitted`` one:
    ``{name: {shipped, fitted}}`` (empty when the data files hold the fit)."""
    return {name: {"shipped": float(value), "fitted": fitted[g]} for g, values in ships.items()
            for value, names in values.items() for name in names if float(value) != fitted[g]}


def fit_report(path=runs.CASES, table1=end_to_end.CASES, rows: list[dict] | None = None) -> dict:
    """Per generation: the fit, its errors and what ships (``ship``: the value each generation's topologies must
    state; ``stale``: those that do not); the one-value alternative (``rows``: :func:`all_rows`, computed when
    not given)."""
    rows = all_rows(path, table1) if rows is None else rows
    fits = {g: generation_report([r for r in rows if r["generation"] == g]) for g in GENERATIONS}
    ship = {g: fits[g]["fitted"] for g in GENERATIONS}
    ships = shipped(rows, path)
    return {"parameter": "device.sustained", "objective": "least squares of the relative error", "ship": ship,
            "shipped": ships, "stale": stale(ships, ship), "generations": fits,
            "shared_alternative": shared_report(rows)}


def fits(report: dict) -> dict:
    """:func:`fit_report` as one entry per fitted value (``gpu_compute_A100``, ...), each with its category, cases,
    value, in-sample and leave-one-out summaries and the topologies that carry it: the shape
    benchmarks/published_runs.py prints under ``fits`` beside ``tpu_compute``."""
    out = {}
    for g, fit_ in report["generations"].items():
        out[f"gpu_compute_{g}"] = {
            "parameter": report["parameter"], "category": f"every {g} case (runs.yaml{' and Table 1' if g == 'A100' else ''})",
            "cases": fit_["cases"], "fitted": fit_["fitted"], "in_sample": fit_["in_sample"],
            "leave_one_out": fit_["leave_one_out"], "unfitted": fit_["unfitted"], "by_category": fit_["by_category"],
            "shipped": report["shipped"].get(g, {}),
            "stale": {n: v for n, v in report["stale"].items()
                      if any(n in names for names in report["shipped"].get(g, {}).values())},
            "shared_alternative": report["shared_alternative"]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a shipped value is not the fit")
    args = parser.parse_args(argv)
    report = fit_report()
    json.dump(report, sys.stdout, indent=1)
    print()
    if args.check and report["stale"]:
        print(f"stale device.sustained (ship {report['ship']}): {report['stale']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
