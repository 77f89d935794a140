"""`testbed sweep`: a grid over plan and topology fields into a DuckDB database, and its plots.

``testbed sweep SPEC.yaml`` evaluates every point of the SPEC's grid that
the database (``--db``, default ``NAME.duckdb``) does not hold yet, in
``--workers`` processes (or on a Ray or Dask cluster with ``--executor``);
an interrupted sweep resumes where it stopped. ``--plot DIR`` draws the
curves and Pareto fronts, after the sweep or, without a SPEC, from an
existing ``--db``. The SPEC format is in docs/explore.md.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace
from typing import Any

from testbed.errors import InputError
from testbed.output import CommandResult, output_target
from testbed.text import markup, shown
from testbed.units import format_bytes, format_time

__all__ = ["sweep"]


def _add(parser: argparse.ArgumentParser) -> None:
    from testbed.explore.sweep import EXECUTORS

    parser.add_argument("spec", nargs="?", help="the sweep SPEC YAML (omit with --db and --plot to plot only)")
    parser.add_argument("--db", help="the DuckDB database (default: NAME.duckdb, NAME the SPEC's name)")
    parser.add_argument("--workers", type=int, help="parallel workers (default: the CPU count; 1 = in this process)")
    parser.add_argument("--executor", default="process", choices=list(EXECUTORS),
                        help="process (default), or ray / dask (optional extras) to run on a cluster")
    parser.add_argument("--address", help="the Ray or Dask scheduler address (default: a local cluster)")
    parser.add_argument("--plot", nargs="?", const="", metavar="DIR",
                        help="draw the curves and Pareto fronts as PNGs into DIR (default NAME-plots)")
    parser.add_argument("--top", type=int, default=10, help="fastest points shown (default 10)")
    parser.add_argument("--max-points", type=int, default=None, metavar="N",
                        help="refuse a grid of more than N points before building it (default 10,000)")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line on stderr per finished point")


def _row_text(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"invalid: {shown(row['error'], 400)}"
    return (f"{row['devices']} devices {row['data']}.{row['fsdp']}.{row['tensor']}.{row['stage']} "
            f"{format_time(row['step_time_s'])}")


def _points_table(console: Any, points: list[dict[str, Any]]) -> Any:
    """The fastest points at the console's width (testbed.cli.tables)."""
    import json

    from rich.text import Text

    from testbed.cli.tables import Col, compact, fitted_table

    # The parameters identify a point (wrapped between k=v, never cut); the d.f.t.s mesh, step, MFU and
    # tok/$ are what points are compared by; the rest go first when the terminal is narrow.
    columns = [Col(header="#"), Col(header="params", key=True, wrap=True, justify="left"),
               Col(header="dev", drop=3), Col(header="d.f.t.s", justify="left"),
               Col(header="sched", drop=2, justify="left"), Col(header="mb", drop=4), Col(header="step"),
               Col(header="comm", drop=6), Col(header="bubble", drop=5), Col(header="MFU"),
               Col(header="memory", drop=1), Col(header="tok/$")]
    cells = []
    for i, r in enumerate(points, 1):
        params = ", ".join(f"{shown(k.split('.')[-1])}={shown(v)}" for k, v in json.loads(r["params"]).items())
        memory = format_bytes(r["memory_bytes"])
        cells.append([str(i), params, str(r["devices"]), f"{r['data']}.{r['fsdp']}.{r['tensor']}.{r['stage']}",
                      shown(r["schedule"]), str(r["microbatches"]), format_time(r["step_time_s"]),
                      format_time(r["exposed_comm_s"] or 0.0), f"{r['bubble_fraction'] or 0:.0%}",
                      f"{r['mfu'] or 0:.0%}", memory if r["fits"] else Text(memory + " !", style="red"),
                      f"{r['tokens_per_dollar']:,.0f}" if r["tokens_per_dollar"] else "-"])
    return fitted_table(console, columns, cells, **compact())


def _execute(args: argparse.Namespace) -> CommandResult:
    from testbed.explore.sweep import read_rows

    spec = _spec(args)
    db = args.db or f"{spec.name}.duckdb"
    summary = _run(args, spec, db) if spec is not None else None
    rows = read_rows(db, spec.name if spec else None)
    files: list[str] = []
    if args.plot is not None:
        from testbed.explore.sweep_plot import plot_sweep

        folder = args.plot or f"{spec.name if spec else 'sweep'}-plots"
        files = [str(p) for p in plot_sweep(rows, folder, title=spec.name if spec else "")]
    ok = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["step_time_s"])
    data = {"db": db, "sweep": spec.name if spec else None, "points": len(rows),
            "ok": len(ok), "invalid": len(rows) - len(ok), "files": files,
            "summary": None if summary is None else {"total": summary.total, "skipped": summary.skipped,
                                                      "evaluated": summary.evaluated, "invalid": summary.invalid,
                                                      "seconds": summary.seconds},
            "rows": rows}

    def render(console) -> None:
        if summary is not None:
            console.print(f"[bold]{markup(spec.name)}[/bold]: {summary.total} points, {summary.skipped} already in "
                          f"{markup(db)}, {summary.evaluated} evaluated ({summary.invalid} invalid) in "
                          f"{summary.seconds:.1f} s")
        else:
            console.print(f"{markup(db)}: {len(rows)} points, {len(ok)} valid")
        console.print(_points_table(console, ok[:args.top]))
        console.print("dev: devices; d.f.t.s: data.fsdp.tensor.stage degrees; mb: microbatches; comm: exposed "
                      "communication; bubble: idle pipeline share; memory: the fullest device (! over its memory); "
                      "tok/$: tokens per dollar")
        bad = [r for r in rows if r["status"] != "ok"]
        if bad:
            console.print(f"{len(bad)} invalid points, e.g. point {bad[0]['point']}: {markup(bad[0]['error'], 400)}")
        for f in files:
            console.print(f"wrote {markup(f)}")

    return CommandResult(data, render, files=files)


def _spec(args: argparse.Namespace) -> Any:
    """The sweep SPEC the command runs (None: only plot ``--db``), its flags checked first."""
    from testbed.explore.sweep_spec import MAX_POINTS, load_sweep_spec

    if args.spec is not None and not args.spec.strip():  # "" is not a SPEC (nor the absence of one)
        raise InputError("is empty; give the sweep SPEC YAML path", field="spec")
    if args.db is not None and not args.db.strip():
        raise InputError("is empty; give the DuckDB file path (without --db: NAME.duckdb)", field="--db")
    if args.spec is None and (args.db is None or args.plot is None):
        raise InputError("give a SPEC to sweep, or --db FILE --plot DIR to plot a database", field="spec")
    max_points = MAX_POINTS if args.max_points is None else args.max_points
    if max_points < 1:
        raise InputError(f"must be a whole number >= 1, got {max_points}", field="--max-points")
    return load_sweep_spec(args.spec, max_points=max_points) if args.spec else None


def _run(args: argparse.Namespace, spec: Any, db: str) -> Any:
    """Sweep ``spec`` into ``db`` with a progress bar whose ETA leaves out the points already there; each row on
    stderr with ``--verbose``. The run's summary."""
    from testbed.cli.progress import progress_bar
    from testbed.explore.sweep import run_sweep

    output_target(db, "--db")  # refuses a folder, a device or one of the command's inputs
    with progress_bar("sweeping", eta=True) as bar:
        state: dict[str, Any] = {}

        def progress(done: int, total: int) -> None:
            if "task" not in state:  # points already in the database do not count towards the ETA
                state["base"] = done
                label = markup(spec.name) + (f" ({done} already done)" if done else "")
                state["task"] = bar.add_task(label, total=total - done)
            bar.update(state["task"], completed=done - state["base"])

        def on_row(row: dict[str, Any]) -> None:
            if args.verbose:
                sys.stderr.write(f"point {row['point']} {shown(row['key'], 200)}: {_row_text(row)}\n")
                sys.stderr.flush()

        return run_sweep(spec, db, executor=args.executor, workers=args.workers, address=args.address,
                         progress=progress, on_row=on_row)


sweep = SimpleNamespace(add_arguments=_add, execute=_execute)
