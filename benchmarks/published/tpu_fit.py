"""The TPU compute calibration of runs.yaml's TPU cases, fitted over the category with its leave-one-out error.

Cloud TPU documents each chip's peak (bf16 FLOP/s, HBM bandwidth) but no
fraction of it that an XLA training step reaches, and XLA's fusions leave
some memory-bound work between the matmuls (normalisation, rope, SwiGLU,
residual adds, the recomputed forward's elementwise work), which costs far more
on TPU v6e (918 TFLOP/s over 1.64 TB/s: 560 FLOP per byte) than on v5p (459
over 2.77: 166). Two kinds of number describe that on every TPU topology of runs.yaml (no per-slice or per-case value):

- ``efficiency``: ``calibration.compute.efficiency``, the fraction of the
  bf16 peak a matmul reaches, one per TPU generation (v5p, v6e);
- ``passes``: ``calibration.elementwise.replicated_passes`` and
  ``split_passes`` (equal: the TPU cases have no tensor axis), memory
  passes at the device's HBM bandwidth over each byte of activations a compute
  task writes (testbed.model.costs.layer_traffic_bytes), one for all.

Each case runs on its topology under the compiler it compiled with (runs.yaml's TPU topologies declare XLA:TPU's
rules: all-reduces held in program order, a whole slice's scatters and small gathers lowered to all-reduces; a run
whose XLA flags overlap its gradient all-reduces states ``runtime.async_all_reduce``), so the efficiency absorbs the
matmuls' speed, not those collectives. Fitted over every TPU case of runs.yaml (the category: a case whose ``device`` is a
TPU; three stacks, MaxText, AXLearn and PaLM's Pathways, four TPU generations, dense and MoE, 8-8,192 chips) by
least squares of the relative error of tokens/s, on a grid (efficiency step 0.005, passes step 0.1). A case's step
time is linear in ``1 / efficiency`` and ``passes`` while compute dominates
(every case here: its exposed communication is what the simulator says,
unchanged by either), so each case is simulated three times (ideal compute
without passes, half efficiency, one pass) and the fit and each
leave-one-out refit are exact on that decomposition; :func:`fit_report`
prints both, per case and summarised, the values runs.yaml ships (they must be the fit's), and the same
summaries for the alternative of one efficiency and one pass count for both generations (:func:`fit`),
which fits worse in and out of sample: MaxText's own TFLOP/s logs put the v5p runs at 53-71% of the bf16
peak and the v6e runs at 33-50%.

What ships is as few free values as the rows support: one efficiency per generation and no elementwise
passes (:data:`PER_DEVICE_PASSES`: XLA fuses the elementwise work into the matmuls' neighbours; with the
passes free the per-generation fit also chose 0). Least squares, not least absolute error: a one-value least
absolute fit passes exactly through one of its rows, so with three v5p rows that disagree (the dense ones want
0.85-0.92, Mixtral's megablox row 0.685) its in-sample error is 2.5 points under its leave-one-out error
(4.7% vs 7.2% median); least squares spreads the error over the rows it fits, and in-sample and left-out
errors agree within a point (``--check`` exits 1 when runs.yaml's values are not the fit's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

import runs

from testbed.sim.graph.engine import simulate
from testbed.topology.calibration import ElementwiseCalibration
from testbed.topology.spec import Topology

#: The category fitted: runs.yaml's cases whose ``device`` starts with this (every stack's TPU cases).
DEVICE_PREFIX = "TPU"


def in_category(case: dict) -> bool:
    """Whether a runs.yaml case belongs to the fitted category (it runs on a TPU)."""
    return case["device"].startswith(DEVICE_PREFIX)
#: The grids searched: efficiency and passes, (low, high, step).
EFFICIENCY_GRID = (0.5, 0.95, 0.005)
PASSES_GRID = (0.0, 8.0, 0.1)
#: The elementwise passes of the per-generation fit (what ships): none, not a free value.
PER_DEVICE_PASSES = 0.0


def loss(error_: float) -> float:
    """What each fit minimises, summed over its rows: the squared relative error."""
    return error_ * error_


def calibrated(topology: Topology, efficiency: float, passes: float) -> Topology:
    """``topology`` with the compute efficiency and the elementwise passes set (no passes: the group absent)."""
    cal = topology.calibration
    elementwise = ElementwiseCalibration(replicated_passes=passes, split_passes=passes) if passes else None
    return replace(topology, calibration=replace(cal, compute=replace(cal.compute, efficiency=efficiency),
                                                 elementwise=elementwise))


def decompose(case: dict, inline: dict[str, Topology]) -> dict:
    """The case's step time as ``matmul_s / efficiency + passes * pass_s + other_s`` (seconds at ideal compute and
    one pass) and its published step time."""
    plan, topology = runs.case_plan(case), runs.case_topology(case, inline)

    def step(efficiency: float, passes: float) -> float:
        return simulate(plan, calibrated(topology, efficiency, passes)).report.step_time_s

    ideal = step(1.0, 0.0)
    matmul = step(0.5, 0.0) - ideal
    tokens = plan.batch.global_batch * plan.model.seq_len
    return {"case": case["name"], "device": case["device"], "stack": case["stack"], "source": case["url"],
            "shipped": topology.calibration.compute.efficiency, "matmul_s": matmul, "pass_s": step(1.0, 1.0) - ideal,
            "other_s": ideal - matmul, "published_s": tokens / float(case["tokens_per_s_per_gpu"]) / int(case["gpus"])}


def error(row: dict, efficiency: float, passes: float) -> float:
    """Predicted over published tokens/s, minus 1, under the two values (the decomposition's step time)."""
    step = row["matmul_s"] / efficiency + passes * row["pass_s"] + row["other_s"]
    return row["published_s"] / step - 1


def _grid(low: float, high: float, step: float) -> list[float]:
    return [round(low + i * step, 6) for i in range(int(round((high - low) / step)) + 1)]


def fit(rows: list[dict]) -> tuple[float, float]:
    """(efficiency, passes) of least summed :func:`loss` over ``rows`` (ties: the first on the grids)."""
    best = (float("inf"), EFFICIENCY_GRID[0], PASSES_GRID[0])
    for efficiency in _grid(*EFFICIENCY_GRID):
        for passes in _grid(*PASSES_GRID):
            total = sum(loss(error(r, efficiency, passes)) for r in rows)
            if total < best[0] - 1e-12:
                best = (total, efficiency, passes)
    return best[1], best[2]


def _summary(errors: list[float]) -> dict:
    magnitudes = [abs(e) for e in errors]
    return {"cases": len(errors), "median_abs_error": round(statistics.median(magnitudes), 4),
            "max_abs_error": round(max(magnitudes), 4)}


def leave_one_out(rows: list[dict]) -> list[float]:
    """Each row's error under the fit over the other rows."""
    return [error(r, *fit(rows[:i] + rows[i + 1:])) for i, r in enumerate(rows)]


def fit_per_device(rows: list[dict], passes: float = PER_DEVICE_PASSES) -> tuple[dict[str, float], float]:
    """({device: efficiency}, passes) of least summed :func:`loss` over ``rows``: one efficiency per device
    generation (``row["device"]``) at the given elementwise ``passes`` (ties: the first on the grid)."""
    return {device: fit_efficiency([r for r in rows if r["device"] == device], passes)
            for device in sorted({r["device"] for r in rows})}, passes


def fit_efficiency(rows: list[dict], passes: float = PER_DEVICE_PASSES) -> float:
    """The efficiency of least summed :func:`loss` over ``rows`` at the given ``passes`` (ties: the lowest)."""
    cost = {e: sum(loss(error(r, e, passes)) for r in rows) for e in _grid(*EFFICIENCY_GRID)}
    return min(cost, key=lambda e: (round(cost[e], 12), e))


def _device_error(row: dict, efficiencies: dict[str, float], passes: float, shared: float) -> float:
    """:func:`error` under the row's device's efficiency (``shared`` for a device the fit did not see)."""
    return error(row, efficiencies.get(row["device"], shared), passes)


def per_device_report(rows: list[dict], shared: float) -> dict:
    """The per-generation fit (what runs.yaml ships): its values, summed loss, in-sample and leave-one-out errors,
    all and per generation (each efficiency's own rows; a row whose device has no other row takes the ``shared``
    efficiency when left out)."""
    efficiencies, passes = fit_per_device(rows)
    in_sample = [_device_error(r, efficiencies, passes, shared) for r in rows]
    left_out = [_device_error(r, *fit_per_device(rows[:i] + rows[i + 1:]), shared) for i, r in enumerate(rows)]
    by_generation = {d: {kind: _summary([e for r, e in zip(rows, errors) if r["device"] == d])
                         for kind, errors in (("in_sample", in_sample), ("leave_one_out", left_out))}
                     for d in sorted(efficiencies)}
    return {"fitted": {"efficiency": efficiencies, "elementwise_passes": passes},
            "sum_squared_error": round(sum(loss(e) for e in in_sample), 4),
            "in_sample": _summary(in_sample), "leave_one_out": _summary(left_out), "by_generation": by_generation,
            "rows": [{"case": r["case"], "in_sample": round(a, 4), "leave_one_out": round(b, 4)}
                     for r, a, b in zip(rows, in_sample, left_out)]}


def shared_report(rows: list[dict]) -> dict:
    """The one-value alternative (one efficiency and one pass count for every TPU): the same summaries."""
    efficiency, passes = fit(rows)
    in_sample, left_out = [error(r, efficiency, passes) for r in rows], leave_one_out(rows)
    return {"fitted": {"efficiency": efficiency, "elementwise_passes": passes},
            "sum_squared_error": round(sum(loss(e) for e in in_sample), 4),
            "in_sample": _summary(in_sample), "leave_one_out": _summary(left_out)}


def shipped(inline: dict[str, Topology]) -> dict:
    """The values runs.yaml's TPU topologies carry: ``{(efficiency, passes): [topology names]}`` as strings."""
    out: dict[str, list[str]] = {}
    for name, topology in sorted(inline.items()):
        if not topology.device.name.startswith("TPU"):
            continue
        cal = topology.calibration
        passes = cal.elementwise.replicated_passes if cal.elementwise else 0.0
        out.setdefault(f"efficiency {cal.compute.efficiency:g}, passes {passes:g}", []).append(name)
    return out


def stale(cases: list[dict], inline: dict[str, Topology], fitted: dict) -> dict:
    """The category's topologies whose calibration is not their generation's fit: ``{name: {shipped, fitted}}``."""
    out = {}
    for case in cases:
        cal = inline[case["topology"]].calibration
        passes = cal.elementwise.replicated_passes if cal.elementwise else 0.0
        want = (fitted["efficiency"][case["device"]], fitted["elementwise_passes"])
        if (cal.compute.efficiency, passes) != want:
            out[case["topology"]] = {"shipped": [cal.compute.efficiency, passes], "fitted": list(want)}
    return out


def category_rows(path=runs.CASES) -> list[dict]:
    """The category's cases (runs.yaml's TPU cases, :func:`in_category`), decomposed."""
    cases, inline = runs.load_cases(path)
    return [decompose(c, inline) for c in cases if in_category(c)]


def fit_report(path=runs.CASES, rows: list[dict] | None = None) -> dict:
    """The per-generation fit over the category, its in-sample and leave-one-out errors, the values runs.yaml
    ships (``stale``: the topologies whose values are not the fit's), and the shared-value alternative (``rows``:
    :func:`category_rows`, computed when not given)."""
    cases, inline = runs.load_cases(path)
    cases = [c for c in cases if in_category(c)]
    rows = [decompose(c, inline) for c in cases] if rows is None else rows
    alternative = shared_report(rows)
    report = per_device_report(rows, alternative["fitted"]["efficiency"])
    fitted = report.pop("fitted")
    return {"category": "every TPU case", "objective": "least squares of the relative error", "cases": len(rows),
            "fitted": fitted, "shipped": shipped(inline), "stale": stale(cases, inline, fitted), **report,
            "shared_alternative": alternative}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when runs.yaml's values are not the fit's")
    args = parser.parse_args(argv)
    report = fit_report()
    print(json.dumps(report, indent=1))
    if args.check and report["stale"]:
        print(f"stale TPU calibration (ship {report['fitted']}): {report['stale']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
