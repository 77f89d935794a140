"""The tables of every published case, from ``published_runs.py``'s JSON, as a delimited Markdown section.

``benchmarks/published_runs.py`` prints one JSON object (categories, size bands,
the pooled end-to-end categories, ``runtime_mechanisms``, ``fits`` and every
case's ``results``). :func:`section` turns it into, in this order: the summary
per category; the size bands of the collectives and of TPU ICI; the pooled
end-to-end errors by stack, device, precision, scale and architecture; what
each runtime mechanism moved; the fitted parameters with their leave-one-out
errors; and one table per category of every case with its source, predicted,
published and error, each run with the error each of its runtime fields added.
benchmarks/docs_validation.py writes docs/validation.md with it. As a command it
rewrites the section between :data:`BEGIN` and :data:`END` of another Markdown
file (appended the first time):

    .venv/bin/python benchmarks/published/validation_table.py runs.json --doc OTHER.md

Bad input (a file that is not JSON, an object without ``categories`` or
``results``, a case without its fields) exits with status 2 and a message
naming the file and the field; the document is written atomically. ``--check``
writes nothing and exits 1 when the section is out of date.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from testbed.output import write_atomic

BEGIN = "<!-- BEGIN GENERATED: every published case (benchmarks/published/validation_table.py) -->"
END = "<!-- END GENERATED: every published case -->"
#: The categories in the order the section lists them, and what each table calls its unit.
ORDER = ("end_to_end", "runs", "collectives", "ici", "memory")
TITLES = {"end_to_end": "Megatron-LM SC21 Table 1", "runs": "Published training runs",
          "collectives": "NCCL collectives (nccl-tests)", "ici": "TPU ICI collectives", "memory": "ZeRO model states"}
_CASE_FIELDS = ("case", "predicted", "published", "error")


class TableInputError(ValueError):
    """The JSON does not have the shape ``published_runs.py`` prints (the message names the field)."""


def _pct(value: float | None, signed: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value * 100:+.1f}%" if signed else f"{value * 100:.1f}%"


def _cell(text: object) -> str:
    """Text safe inside a Markdown table cell (pipes escaped, one line)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _summary_row(name: str, s: dict) -> tuple:
    return (name, s.get("cases", ""), _pct(s.get("median_abs_error")), _pct(s.get("max_abs_error")))


def validate(data: object, source: str) -> dict:
    """``data`` if it is ``published_runs.py``'s object, else :class:`TableInputError` naming the field."""
    def bad(field: str, valid: str) -> TableInputError:
        return TableInputError(f"{source}: field '{field}' {valid}. The input must be the JSON object "
                               "benchmarks/published_runs.py prints.")
    if not isinstance(data, dict):
        raise bad("(top level)", "is not a JSON object")
    for key in ("categories", "results"):
        if not isinstance(data.get(key), dict):
            raise bad(key, "is missing or not an object of categories")
    for name, rows in data["results"].items():
        if not isinstance(rows, list):
            raise bad(f"results.{name}", "is not a list of cases")
        for i, row in enumerate(rows):
            missing = [f for f in _CASE_FIELDS if not isinstance(row, dict) or f not in row]
            if missing:
                raise bad(f"results.{name}[{i}].{missing[0]}", "is missing (every case has case, predicted, "
                          "published and error)")
            if not isinstance(row["error"], (int, float)) or isinstance(row["error"], bool):
                raise bad(f"results.{name}[{i}].error", "is not a number")
        if name not in data["categories"]:
            raise bad(f"categories.{name}", "is missing for a category that has results")
    return data


def _summaries(data: dict) -> list[str]:
    out = ["#### Summary by category", ""]
    out += _table(("category", "unit", "cases", "median abs error", "max abs error"),
                  [(TITLES.get(n, n) + f" (`{n}`)", s.get("unit", ""), *_summary_row(n, s)[1:])
                   for n, s in _ordered(data["categories"])])
    for key, title in (("collective_bands", "NCCL collectives by size band"), ("ici_bands", "TPU ICI by size band")):
        if data.get(key):
            out += ["", f"#### {title}", ""]
            out += _table(("band", "cases", "median abs error", "max abs error"),
                          [_summary_row(b, s) for b, s in data[key].items()])
    if data.get("end_to_end_all"):
        out += ["", "#### End to end (Table 1 and the runs pooled) by category", ""]
        rows = [_summary_row("all", data["end_to_end_all"]) + (_pct(data["end_to_end_all"].get("median_signed_error"),
                                                                    True),)]
        for key, groups in (data.get("end_to_end_by") or {}).items():
            rows += [_summary_row(f"{key} {value}", s) + (_pct(s.get("median_signed_error"), True),)
                     for value, s in groups.items()]
        out += _table(("category", "cases", "median abs error", "max abs error", "median signed error"), rows)
    return out


def _mechanisms(data: dict) -> list[str]:
    mechanisms = data.get("runtime_mechanisms") or {}
    if not mechanisms:
        return []
    out = ["", "#### What each runtime mechanism moved", "",
           "Per runtime field (and a topology's `device.power_limit`): the runs whose profile sets it, the runs it "
           "moves by more than 0.01%, and over those the error with the field minus the error without it "
           "(negative: the prediction became slower). Each run's own changes are in its row below.", ""]
    out += _table(("field", "set", "moved", "median change", "least", "most"),
                  [(f"`{f}`", m.get("set", ""), m.get("moved", ""), _pct(m.get("median_error_change"), True),
                    _pct(m.get("min"), True), _pct(m.get("max"), True)) for f, m in sorted(mechanisms.items())])
    return out


def _fits(data: dict) -> list[str]:
    fits = data.get("fits") or {}
    rows = []
    for name, f in sorted(fits.items()):
        if not isinstance(f, dict):
            continue
        ins, loo = f.get("in_sample") or {}, f.get("leave_one_out") or {}
        rows.append((f"`{name}`", f.get("category", ""), f.get("cases", ins.get("cases", "")),
                     json.dumps(f.get("fitted", ""), sort_keys=True), _pct(ins.get("median_abs_error")),
                     _pct(ins.get("max_abs_error")), _pct(loo.get("median_abs_error")), _pct(loo.get("max_abs_error"))))
    if not rows:
        return []
    return ["", "#### Fitted parameters", ""] + _table(
        ("fit", "category", "cases", "fitted", "in-sample median", "in-sample max", "left-out median", "left-out max"),
        rows)


def _held_out(data: dict) -> list[str]:
    """The end-to-end fits held out a stack and a source at a time (held_out.py): overall beside in-sample, per
    held-out group, and per fitted parameter with the rows it is fitted on."""
    held = data.get("held_out") or {}
    if not held.get("in_sample"):
        return []
    kinds = (("in_sample", "in-sample"), ("leave_one_stack_out", "a stack held out"),
             ("leave_one_source_out", "a source held out"))
    out = ["", "#### Held out: every fitted number refitted without a stack, or without a source", "",
           "Each held-out group's cases leave every end-to-end fit (GPU `device.sustained`, TPU matmul "
           "`efficiency`) at once; each is refitted over the other groups and predicts the held-out cases "
           "(benchmarks/published/held_out.py; a parameter with fewer than two cases of its own left takes its "
           "family's fit over every case of the family left, then its unfitted value, as `fallback` in the JSON "
           "says).", ""]
    out += _table(("errors", "cases", "median abs error", "max abs error", "median signed error"),
                  [_summary_row(title, held[k]["overall"]) + (_pct(held[k]["overall"].get("median_signed_error"),
                                                                   True),) for k, title in kinds if k in held])
    for kind, key, title in (("leave_one_stack_out", "stack", "stack"), ("leave_one_source_out", "source", "source")):
        groups = (held.get(kind) or {}).get("groups") or {}
        inside = held["in_sample"].get("groups", {}).get(key, {})
        rows = [(name.removeprefix("https://"), g.get("cases", ""), _pct(inside.get(name, {}).get("median_abs_error")),
                 _pct(inside.get(name, {}).get("max_abs_error")), _pct(g.get("median_abs_error")),
                 _pct(g.get("max_abs_error")), ", ".join(f"{p} {v:g}" for p, v in sorted(g.get("refitted", {}).items())))
                for name, g in groups.items()]
        out += ["", f"By {title} held out:", ""] + _table(
            (title, "cases", "in-sample median", "in-sample max", "held-out median", "held-out max", "refitted"), rows)
    return out + _attribution(held) + _held_out_fits(data)


def _attribution(held: dict) -> list[str]:
    """held_out.py's ``attribution``: the overall errors with one stack's cases, then one case, priced exactly in
    sample, beside the errors as predicted: where the held-out error comes from."""
    found = held.get("attribution") or {}
    if not found:
        return []
    kinds = ("in_sample", "leave_one_stack_out", "leave_one_source_out")

    def cells(entry: dict) -> tuple:
        return tuple(_pct((entry.get(k) or {}).get(m)) for k in kinds for m in ("median_abs_error", "max_abs_error"))

    predicted = {"in_sample": held["in_sample"]["overall"], **{k: held[k]["overall"] for k in kinds[1:] if k in held}}
    rows = [("none (as predicted)", "", *cells(predicted))]
    rows += [(f"stack {name}", entry.get("cases", ""), *cells(entry))
             for name, entry in (found.get("by_stack") or {}).items()]
    rows += [(f"case {name} ({_pct(entry.get('in_sample_error'), True)})", 1, *cells(entry))
             for name, entry in (found.get("by_case") or {}).items() if _moves(entry, predicted)]
    return ["", "Where the held-out error comes from: the same errors with one stack's cases, or one case (each whose "
            "in-sample error is over 10% and whose exact price moves a held-out median or max by a point or more; "
            "every such case is in the JSON), priced exactly in sample and every fit refitted (held_out.py "
            "`attribution`):", ""] + _table(
        ("priced exactly", "cases", "in-sample median", "in-sample max", "stack-out median", "stack-out max",
         "source-out median", "source-out max"), rows)


def _moves(entry: dict, predicted: dict) -> bool:
    """Whether pricing a case exactly moves a held-out median or max by a point (0.01) or more."""
    return any(abs((entry.get(k) or {}).get(m, 0.0) - (predicted.get(k) or {}).get(m, 0.0)) >= 0.01
               for k in ("leave_one_stack_out", "leave_one_source_out") for m in ("median_abs_error", "max_abs_error"))


def _held_out_fits(data: dict) -> list[str]:
    rows = []
    for f in (data.get("fits") or {}).values():
        for parameter, h in sorted(((f.get("held_out") or {}) if isinstance(f, dict) else {}).items()):
            stack, source = h.get("leave_one_stack_out") or {}, h.get("leave_one_source_out") or {}
            rows.append((f"`{parameter}`", len(h.get("fitted_on", [])), ", ".join(h.get("stacks", [])),
                         len(h.get("sources", [])), _pct(stack.get("median_abs_error")), _pct(stack.get("max_abs_error")),
                         _pct(source.get("median_abs_error")), _pct(source.get("max_abs_error"))))
    if not rows:
        return []
    return ["", "Per fitted parameter (the cases each is fitted on are listed under `fits` in the JSON):", ""] + _table(
        ("parameter", "cases", "stacks", "sources", "stack-out median", "stack-out max", "source-out median",
         "source-out max"), rows)


def _sweeps_out(data: dict) -> list[str]:
    """The fits that also report a leave-one-sweep-out error (each cluster's whole log predicted by the fit over
    the others: the NCCL multi-node fit), a row each."""
    rows = [(f"`{name}`", f["leave_one_sweep_out"].get("held_out", ""),
             _pct(f["leave_one_sweep_out"].get("median_abs_error")), _pct(f["leave_one_sweep_out"].get("max_abs_error")))
            for name, f in sorted((data.get("fits") or {}).items())
            if isinstance(f, dict) and isinstance(f.get("leave_one_sweep_out"), dict)]
    if not rows:
        return []
    return ["", "Left out a sweep at a time (one cluster's whole size sweep, each single case its own):", ""] + _table(
        ("fit", "sweeps held out", "left-out median", "left-out max"), rows)


def _cases(data: dict) -> list[str]:
    out = []
    oom = set(data.get("predicted_out_of_memory") or [])
    for name, rows in _ordered(data["results"]):
        unit = data["categories"][name].get("unit", "")
        runs = any("mechanisms" in r for r in rows)
        out += ["", f"#### {TITLES.get(name, name)} (`{name}`): every case, {unit}", ""]
        header = ("case", "source", "predicted", "published", "error")
        header += ("what each mechanism added",) if runs else ()
        table = []
        for r in rows:
            case = r["case"] + (" (predicted out of memory)" if r["case"] in oom else "")
            row = (case, r.get("source", ""), r["predicted"], r["published"], _pct(r["error"], True))
            if runs:
                row += (", ".join(f"{f} {_pct(d, True)}" for f, d in (r.get("mechanisms") or {}).items()),)
            table.append(row)
        out += _table(header, table)
    return out


def _ordered(mapping: dict) -> list[tuple]:
    rank = {n: i for i, n in enumerate(ORDER)}
    return sorted(mapping.items(), key=lambda kv: (rank.get(kv[0], len(ORDER)), kv[0]))


def section(data: dict) -> str:
    """The generated section, :data:`BEGIN` to :data:`END` (no trailing newline)."""
    lines = [BEGIN, "", "### Every published case (generated)", "",
             "Generated by `benchmarks/published/validation_table.py` from the JSON "
             "`benchmarks/published_runs.py` printed; do not edit by hand. Error is predicted / published - 1 "
             "(for ICI, predicted bandwidth over published), in percent.", ""]
    lines += _summaries(data) + _mechanisms(data) + _fits(data) + _held_out(data) + _sweeps_out(data) + _cases(data)
    return "\n".join(lines + ["", END])


def updated(document: str, data: dict, name: str = "the document") -> str:
    """``document`` with its generated section replaced (or appended when it has none)."""
    new = section(data)
    start, end = document.find(BEGIN), document.find(END)
    if start >= 0 and end > start:
        return document[:start] + new + document[end + len(END):]
    if start >= 0 or end >= 0:
        raise TableInputError(f"{name}: has only one of the markers {BEGIN!r} and {END!r}: restore the "
                              "other or delete both")
    return document.rstrip("\n") + "\n\n" + new + "\n"


def _read(path: str) -> dict:
    source = "standard input" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise TableInputError(f"{source}: cannot be read ({exc.strerror}); give the file "
                              "benchmarks/published_runs.py's output was saved to, or - for standard input.") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TableInputError(f"{source}: not JSON (line {exc.lineno}: {exc.msg}). The input must be the JSON "
                              "object benchmarks/published_runs.py prints.") from None
    return validate(data, source)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="?", default="-", help="published_runs.py's JSON (a file, or - for stdin)")
    parser.add_argument("--doc", required=True, help="the Markdown document whose section to update")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the section is out of date")
    args = parser.parse_args(argv)
    try:
        data = _read(args.json)
        doc = Path(args.doc)
        document = doc.read_text()
        new = updated(document, data, args.doc)
    except OSError as exc:
        print(f"{args.doc}: the document cannot be read ({exc.strerror}); --doc must name an existing Markdown "
              "file.", file=sys.stderr)
        return 2
    except TableInputError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.check:
        return 0 if new == document else 1
    if new != document:
        write_atomic(doc, new, "--doc")
    return 0


if __name__ == "__main__":
    sys.exit(main())
