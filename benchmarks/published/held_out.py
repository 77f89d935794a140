"""Every fitted end-to-end number refitted with one stack (or one source) held out, predicting what was held out.

The numbers fitted over published end-to-end runs: each GPU generation's ``device.sustained`` (gpu_fit.py: A100,
H100) and each TPU generation's matmul ``calibration.compute.efficiency`` (tpu_fit.py: v5p, v6e). A decomposed
row (gpu_fit ``_split``, tpu_fit ``decompose``) prices its step as ``other_s + math_s / value`` and names its
parameter, stack and source (the ``url`` of its runs.yaml case or of megatron.yaml), so each refit is exact on
that decomposition, as the fits themselves are.

Held out (:func:`held_out`): every row of one group (a stack, or a source) leaves every fit at once; each
parameter is refitted over its remaining rows by its own fit (gpu_fit.fit, tpu_fit.fit_efficiency) and the
held-out rows are predicted with the refits. A parameter with fewer than :data:`MIN_OWN_ROWS` rows left (no value is
fitted to one row) takes the fit over the remaining rows of its family (every GPU or TPU generation's, its own
included, pooled) and, with none of those either, the value a topology carries without a fit (:data:`UNFITTED`);
the report names each such fallback. A held-out row's error scales the
benchmark's own prediction by the decomposition's rate at the refit over its rate at the shipped value, so a
row whose refit equals what ships keeps the benchmark's error exactly.
"""

from __future__ import annotations

import statistics

import gpu_fit
import tpu_fit

#: The value a parameter takes with no row to fit it: GPU ``device.sustained`` 1 (the matmul at mamf-finder's
#: cap, testbed.topology.parts.DeviceSpec's default) and the TPU efficiency the bundled TPU topologies carry
#: (topologies/tpu-*.yaml: 0.7, not fitted).
UNFITTED = {"gpu": 1.0, "tpu": 0.7}
#: The fewest rows a parameter is refitted on by itself; with fewer it takes its family's fit (:func:`refits`).
MIN_OWN_ROWS = 2
#: The groupings held out: a row's key for each.
GROUPINGS = {"leave_one_stack_out": "stack", "leave_one_source_out": "source"}
#: The in-sample error over which a case's own share of the held-out error is reported (:func:`attribution`).
ATTRIBUTED_ERROR = 0.10


def gpu_rows(rows: list[dict]) -> list[dict]:
    """gpu_fit's rows as this module's: parameter ``gpu_compute_<generation>``, family ``gpu``."""
    return [{**r, "parameter": f"gpu_compute_{r['generation']}", "family": "gpu"} for r in rows]


def tpu_rows(rows: list[dict]) -> list[dict]:
    """tpu_fit's rows as this module's (no elementwise passes, as what ships): parameter ``tpu_compute_<device>``."""
    return [{**r, "math_s": r["matmul_s"], "parameter": f"tpu_compute_{r['device']}", "family": "tpu"} for r in rows]


def error(row: dict, value: float) -> float:
    """Predicted over published rate, minus 1, with the row's parameter at ``value`` (the decomposition)."""
    return row["published_s"] / (row["other_s"] + row["math_s"] / value) - 1


def fit(rows: list[dict]) -> float:
    """The value of least squared relative error over ``rows`` (all of one family) by the family's own fit."""
    return gpu_fit.fit(rows) if rows[0]["family"] == "gpu" else tpu_fit.fit_efficiency(rows)


def refits(rows: list[dict], kept: list[dict], parameters: set[str]) -> tuple[dict[str, float], dict[str, str]]:
    """Each of ``parameters`` fitted over the ``kept`` rows, and for those with fewer than :data:`MIN_OWN_ROWS` of
    their own the fallback used: ``({parameter: value}, {parameter: what it fell back to})``."""
    family_of = {r["parameter"]: r["family"] for r in rows}
    values, fallbacks = {}, {}
    for parameter in sorted(parameters):
        own = [r for r in kept if r["parameter"] == parameter]
        family = [r for r in kept if r["family"] == family_of[parameter]]
        if len(own) >= MIN_OWN_ROWS:
            values[parameter] = fit(own)
        elif family:
            values[parameter] = fit(family)
            fallbacks[parameter] = f"{len(own)} row(s) of its own: the family's fit over " + ", ".join(
                f"{name} ({sum(r['parameter'] == name for r in family)})"
                for name in sorted({r["parameter"] for r in family}))
        else:
            values[parameter] = UNFITTED[family_of[parameter]]
            fallbacks[parameter] = f"no row of its family left: the unfitted value {UNFITTED[family_of[parameter]]:g}"
    return values, fallbacks


def summary(errors: list[float]) -> dict:
    magnitudes = [abs(e) for e in errors]
    return {"cases": len(errors), "median_abs_error": round(statistics.median(magnitudes), 4),
            "max_abs_error": round(max(magnitudes), 4),
            "median_signed_error": round(statistics.median(errors), 4)}


def _scaled(benchmark: float, row: dict, value: float) -> float:
    """The benchmark's error with the row's parameter moved from its shipped value to ``value``."""
    return (1 + benchmark) * (1 + error(row, value)) / (1 + error(row, row["shipped"])) - 1


def held_out(rows: list[dict], key: str, benchmark: dict[str, float]) -> dict:
    """Each group of ``rows`` by ``key`` held out: its rows' errors under the refits over the other groups
    (``benchmark``: each case's error in the benchmark, at the shipped values). Per group: the summary, the
    refitted values and any fallback; ``overall``: every row once; ``rows``: {case: error}."""
    groups, errors = {}, {}
    for name in sorted({r[key] for r in rows}):
        out = [r for r in rows if r[key] == name]
        values, fallbacks = refits(rows, [r for r in rows if r[key] != name], {r["parameter"] for r in out})
        picked = {r["case"]: round(_scaled(benchmark[r["case"]], r, values[r["parameter"]]), 4) for r in out}
        errors.update(picked)
        groups[name] = {**summary(list(picked.values())), "refitted": values,
                        **({"fallback": fallbacks} if fallbacks else {})}
    return {"overall": summary(list(errors.values())), "groups": groups, "rows": errors}


def per_fit(rows: list[dict], reports: dict[str, dict]) -> dict[str, dict]:
    """Per fitted parameter: the rows it is fitted on (``fitted_on``), its stacks and sources, and its own rows'
    errors under each grouping held out (``reports``: :func:`held_out` per grouping name)."""
    out = {}
    for parameter in sorted({r["parameter"] for r in rows}):
        own = [r for r in rows if r["parameter"] == parameter]
        out[parameter] = {"fitted_on": [r["case"] for r in own], "stacks": sorted({r["stack"] for r in own}),
                          "sources": sorted({r["source"] for r in own}),
                          **{name: summary([report["rows"][r["case"]] for r in own])
                             for name, report in reports.items()}}
    return out


def exact(rows: list[dict], benchmark: dict[str, float], cases: set[str]) -> tuple[list[dict], dict[str, float]]:
    """``rows`` and ``benchmark`` with ``cases`` priced exactly in sample: each one's published step the
    decomposition's at its shipped value, its benchmark error 0."""
    priced = [{**r, "published_s": r["other_s"] + r["math_s"] / r["shipped"]} if r["case"] in cases else r
              for r in rows]
    return priced, {case: 0.0 if case in cases else e for case, e in benchmark.items()}


def _overall(rows: list[dict], benchmark: dict[str, float]) -> dict:
    """Each grouping's overall held-out summary, and the in-sample one, over ``rows``."""
    return {"in_sample": summary([benchmark[r["case"]] for r in rows]),
            **{name: held_out(rows, key, benchmark)["overall"] for name, key in GROUPINGS.items()}}


def attribution(rows: list[dict], benchmark: dict[str, float]) -> dict:
    """Where the held-out error comes from: the overall summaries (:func:`_overall`) with each stack's cases priced
    exactly (``by_stack``), and with each case whose in-sample error is over :data:`ATTRIBUTED_ERROR` priced exactly
    alone (``by_case``)."""
    by_stack = {name: {"cases": sum(r["stack"] == name for r in rows),
                       **_overall(*exact(rows, benchmark, {r["case"] for r in rows if r["stack"] == name}))}
                for name in sorted({r["stack"] for r in rows})}
    by_case = {r["case"]: {"in_sample_error": round(benchmark[r["case"]], 4),
                           **_overall(*exact(rows, benchmark, {r["case"]}))}
               for r in sorted(rows, key=lambda r: -abs(benchmark[r["case"]]))
               if abs(benchmark[r["case"]]) > ATTRIBUTED_ERROR}
    return {"by_stack": by_stack, "by_case": by_case}


def report(rows: list[dict], benchmark: dict[str, float]) -> dict:
    """``in_sample`` (the benchmark's errors over the fitted rows), each grouping of :data:`GROUPINGS` held out,
    ``attribution`` (:func:`attribution`) and ``by_fit`` (:func:`per_fit`)."""
    reports = {name: held_out(rows, key, benchmark) for name, key in GROUPINGS.items()}
    in_sample = {"overall": summary([benchmark[r["case"]] for r in rows]),
                 "groups": {key: {name: summary([benchmark[r["case"]] for r in rows if r[key] == name])
                                  for name in sorted({r[key] for r in rows})} for key in GROUPINGS.values()}}
    return {"in_sample": in_sample, **reports, "attribution": attribution(rows, benchmark),
            "by_fit": per_fit(rows, reports)}
