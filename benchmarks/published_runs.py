"""testbed's predictions against published runs, every category in one JSON object.

Categories:

- ``collectives``: nccl-tests bus bandwidths (benchmarks/published/collectives.py,
  cases in nccl_tests.yaml), predicted vs published GB/s;
- ``end_to_end``: Megatron-LM training throughput (benchmarks/published/end_to_end.py,
  Narayanan et al. 2021 Table 1 in megatron.yaml), predicted vs published TFLOP/s per GPU;
- ``runs``: other stacks' training throughput (benchmarks/published/runs.py, runs.yaml:
  Megatron-Bridge/NeMo, torchtitan, llm-foundry, Megatron-DeepSpeed, Meta's Llama 3 on A100 and H100, MaxText,
  AXLearn and PaLM's Pathways on TPU v4, v5e, v5p and v6e, BF16 and FP8, dense and MoE, 8 to 16,384 devices),
  predicted vs published tokens/s per device;
- ``ici``: TPU collective times over ICI (benchmarks/published/collectives.py, cases in ici.yaml),
  predicted vs published microseconds, error as bandwidth (published / predicted time - 1);
- ``memory``: model states per device under ZeRO 1-3 (benchmarks/published/memory.py,
  Rajbhandari et al. 2020 Table 1 in zero_memory.yaml), predicted vs published GB.

Prints ``{"categories": {NAME: {cases, median_abs_error, max_abs_error}}, "end_to_end_all": {...},
"end_to_end_by": {stack|device|precision|scale|architecture: {VALUE: {...}}}, "runtime_mechanisms":
{FIELD: {...}}, "fits": {"tpu_compute": {...}}, "collective_bands": {BAND: {...}}, "results": {NAME: [{case,
predicted, published, error}, ...]}}``;
error is predicted / published - 1. ``end_to_end_by`` pools ``end_to_end`` (Megatron-LM, A100, BF16, dense)
and ``runs``; ``end_to_end_all`` summarises the pool. Every case runs under its stack's runtime profile
(testbed.plan.runtime; runs.py's ``STACK_PROFILES``, megatron.yaml's ``setup.runtime``) and
``runtime_mechanisms`` says what each of the profiles' fields changed (runs.py ``mechanisms``; its
``device.power_limit``: what a topology's device power limit changed). ``fits`` prints
each parameter fitted over a category of ``runs``, with its in-sample and leave-one-out errors and the values the
data files ship (``tpu_compute``: runs.yaml's TPU calibration over its TPU cases, tpu_fit.py;
``gpu_compute_A100``, ``gpu_compute_H100``: each GPU generation's ``device.sustained`` over its runs.yaml cases
and, for A100, Table 1, gpu_fit.py, which simulates each GPU case twice more).
``held_out`` (benchmarks/published/held_out.py) refits every one of those end-to-end fits without one stack, and
without one source (a case's ``url``), at a time and predicts what was held out: ``in_sample``,
``leave_one_stack_out`` and ``leave_one_source_out``, each ``overall`` and per held-out group (with the refitted
values and any fallback), and ``rows`` (each case's held-out error); ``attribution``: the same overall errors with one
stack's cases, then one case (each over 10% in sample), priced exactly, so where the held-out error comes from shows
(held_out.py ``attribution``); each fit under ``fits`` names the cases it is
fitted on (``held_out.<parameter>.fitted_on``) with its own rows' held-out summaries.
The largest Megatron rows take about a minute each to simulate.

With ``collectives`` run, ``fits`` also carries ``nccl_multinode``: testbed.collectives.nccl_fit's
``MULTINODE_FIT``, refitted over every multi-node nccl-tests case with its in-sample, leave-one-out and
leave-one-sweep-out errors (collectives.py ``fit``: one refit per case and per sweep sharing one memo of
every case's error per fit, about 20 s on the shared 2-core machine).

``--cases REGEX`` keeps only the runs.yaml cases whose name matches (``re.search``), for a quick look at part of
the suite (``--only runs --cases 'maxtext|axlearn'``: every TPU case, their fit and its held-out report, about a
fifth of the full run's time); a fit whose category lost a generation's every row is left out, so the printed
``fits`` and ``held_out`` cover the kept cases only. What benchmarks/results/published_runs.json records is the
full run.

    .venv/bin/python benchmarks/published_runs.py [--only collectives|end_to_end|runs|memory] [--cases REGEX]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent / "published"))

import collectives as published_collectives  # noqa: E402
import end_to_end as published_end_to_end  # noqa: E402
import gpu_fit  # noqa: E402
import held_out  # noqa: E402
import memory as published_memory  # noqa: E402
import runs as published_runs  # noqa: E402
import tpu_fit  # noqa: E402

CATEGORIES = {"collectives": published_collectives.evaluate, "end_to_end": published_end_to_end.evaluate,
              "runs": published_runs.evaluate, "memory": published_memory.evaluate,
              "ici": published_collectives.evaluate_ici}
UNITS = {"collectives": "busbw GB/s", "end_to_end": "TFLOP/s per GPU", "runs": "tokens/s per GPU",
         "memory": "GB of model states per device", "ici": "us per collective"}
#: What the Megatron-LM SC21 Table 1 rows are, in the runs' categories (megatron.yaml).
_TABLE1 = {"stack": "megatron-lm", "device": "A100", "precision": "bf16", "architecture": "dense"}


def _moved(row: dict) -> dict:
    """A run's ``mechanisms`` in ``results``: what each runtime field the case sets added to its error (error with
    it minus error without it), for the fields that move it by more than 0.01% (runs.py's ``mechanisms`` holds
    the error without each field). Every result also carries its ``source``; validation_table.py writes both
    into docs/validation.md."""
    changes = {field: round(row["error"] - without, 4) for field, without in row["mechanisms"].items()}
    return {field: change for field, change in sorted(changes.items()) if abs(change) > 1e-4}


def nccl_fit() -> dict:
    """The NCCL multi-node fit over its category (``fits``' ``nccl_multinode``): the fitted and shipped values,
    in-sample, leave-one-out (one refit per case) and leave-one-sweep-out errors (collectives.py ``fit``)."""
    return published_collectives.fit(leave_one_out=True)


def _compute_fits(path: Path, table1: bool) -> tuple[dict, list[dict]]:
    """``fits``' end-to-end entries (tpu_fit.py's, gpu_fit.py's) over ``path``'s cases (and Table 1's with
    ``table1``) and their rows as held_out.py reads them: each case decomposed once for both. A GPU fit runs only
    with a row of every generation it fits (a ``--cases`` selection may keep none)."""
    tpu, gpu = tpu_fit.category_rows(path), gpu_fit.run_rows(path) + (gpu_fit.table1_rows() if table1 else [])
    fits = {"tpu_compute": tpu_fit.fit_report(path, rows=tpu)} if tpu else {}
    if {r["generation"] for r in gpu} >= set(gpu_fit.GENERATIONS):
        fits.update(gpu_fit.fits(gpu_fit.fit_report(rows=gpu)))
    else:
        gpu = []
    return fits, held_out.tpu_rows(tpu) + held_out.gpu_rows(gpu)


def selected_cases(pattern: str, directory: str) -> Path:
    """runs.yaml with only the cases whose name matches ``pattern`` (``re.search``), written into ``directory``."""
    data = yaml.safe_load(published_runs.CASES.read_text())
    data["cases"] = [c for c in data["cases"] if re.search(pattern, c["name"])]
    out = Path(directory) / "runs.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def _held_out(rows: list[dict], pooled: list[dict], fits: dict) -> dict:
    """held_out.py's report over every fitted case (``pooled``: the benchmark's errors); each fit of ``fits``
    gains the rows it was fitted on and their held-out summaries (``by_fit``, under the fit's own name)."""
    errors = {r["case"]: r["error"] for r in pooled}
    report = held_out.report([r for r in rows if r["case"] in errors], errors)
    for parameter, entry in report.pop("by_fit").items():
        name = "tpu_compute" if parameter.startswith("tpu_") else parameter
        fits[name].setdefault("held_out", {})[parameter] = entry
    return report


def run(only: list[str] | None = None, cases: str | None = None) -> dict:
    """Every category of :data:`CATEGORIES` (or those of ``only``), runs.yaml's cases matching ``cases``
    (with ``cases``, the GPU fits leave Table 1 out)."""
    with tempfile.TemporaryDirectory() as directory:
        return _run(only, selected_cases(cases, directory) if cases else published_runs.CASES, table1=not cases)


def _run(only: list[str] | None, path: Path, table1: bool) -> dict:
    categories, results, pooled, out = {}, {}, [], {}
    for name, evaluate in CATEGORIES.items():
        if only and name not in only:
            continue
        rows = published_runs.evaluate(path) if name == "runs" else evaluate()
        categories[name] = {**published_collectives.summary(rows), "unit": UNITS[name]}
        results[name] = [{"case": r["case"], "source": r.get("source", ""), "predicted": r["predicted"],
                          "published": r["published"], "error": r["error"],
                          **({"memory_gib": r["memory_gib"]} if "memory_gib" in r else {}),
                          **({"mechanisms": _moved(r)} if r.get("mechanisms") else {})}
                         for r in rows]
        if name in ("collectives", "ici"):
            out["collective_bands" if name == "collectives" else "ici_bands"] = published_collectives.by_band(rows)
        if name == "end_to_end":
            pooled += [{**r, **_TABLE1, "gpus": int(r["case"].rsplit("-", 1)[1].removesuffix("gpu"))} for r in rows]
        if name == "runs":
            pooled += rows
            out["runtime_mechanisms"] = published_runs.mechanisms(rows)
            out["predicted_out_of_memory"] = [r["case"] for r in rows if not r["fits"]]
            out["fits"], fitted_rows = _compute_fits(path, table1)
    if "collectives" in categories:
        out["fits"] = {**out.get("fits", {}), "nccl_multinode": nccl_fit()}
    if pooled and "fits" in out:
        out["held_out"] = _held_out(fitted_rows, pooled, out["fits"])
    if pooled:
        out["end_to_end_all"] = published_runs.summary(pooled)
        out["end_to_end_by"] = published_runs.by_category(pooled)
    return {"categories": categories, **out, "results": results}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=sorted(CATEGORIES), help="run only this category")
    parser.add_argument("--cases", metavar="REGEX", help="keep only the runs.yaml cases whose name matches")
    args = parser.parse_args(argv)
    if args.cases:
        try:
            re.compile(args.cases)
        except re.error as exc:
            print(f"--cases: `{args.cases}` is not a regular expression ({exc}); give one that matches case "
                  f"names of {published_runs.CASES.name}, e.g. 'maxtext|axlearn'", file=sys.stderr)
            raise SystemExit(2) from None
    json.dump(run(args.only, args.cases), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
