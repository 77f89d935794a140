"""`testbed collective OP --topology T --over LEVELS --bytes N [--algorithm A] [--sweep] [--png F]`.

Times one collective on a topology. ``--over`` names the levels a group spans;
when that gives several groups (``--over node`` on a multi-node cluster) they
run at once, sharing links, and the slowest is reported. ``--sweep`` times
message sizes 1 KiB .. 4 GiB (x4) for every applicable algorithm, as
nccl-tests prints them; ``--png`` plots bus bandwidth against size.

``--execute emulated:N`` (or ``local``) then runs the chosen algorithm's step
program -- the one just timed -- on N devices with ``lax.ppermute``
(:mod:`testbed.runner.collectives`), checks it against JAX's collective on random
fp32 data and times both; a mismatch exits 1. With ``auto`` on a topology
where NCCL's algorithms win (they have no step program) the fastest step
program is executed. Emulated devices are requested before JAX starts its
backend, as ``testbed run --devices`` does; JAX is imported only then.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from testbed.cli.collective_cluster import execute_on_cluster, is_cluster, render_cluster_execution
from testbed.collectives.algorithms import ALGORITHMS, parse_algorithm
from testbed.collectives.timing import CollectiveTiming, applicable_algorithms, groups_time, placed_program
from testbed.collectives.ops import BUS_FACTOR, OPS, Op, parse_op
from testbed.errors import InputError
from testbed.output import CommandResult, to_jsonable
from testbed.topology import Topology
from testbed.text import markup, plot_label, shown
from testbed.topology.io import load_topology
from testbed.units import format_bandwidth, format_bytes, format_time, parse_bytes

__all__ = ["add_arguments", "execute", "sweep_sizes", "plot_sweep"]


def sweep_sizes(start: float = 2.0**10, stop: float = 2.0**32, factor: float = 4.0) -> list[float]:
    """Message sizes from ``start`` to ``stop`` inclusive, multiplying by ``factor``."""
    sizes, size = [], float(start)
    while size <= stop * (1 + 1e-12):
        sizes.append(size)
        size *= factor
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("op", help=f"collective op: {', '.join(OPS)}")
    parser.add_argument("--topology", required=True, help="bundled topology name or YAML path; NAME@DEVICES resizes it")
    parser.add_argument("--over", default="all", help="levels the group spans, e.g. node, x,y or all (default all)")
    parser.add_argument("--bytes", default=None,
                        help="buffer size, e.g. 1GiB or 4MB (default 1GiB; 4MiB with --execute)")
    parser.add_argument("--algorithm", default="auto", help="algorithm name or auto (default: the fastest)")
    parser.add_argument("--root", type=int, default=0, help="broadcast root / send source, as a rank of the group")
    parser.add_argument("--peer", type=int, default=None, help="send destination rank (default: the last rank)")
    parser.add_argument("--sweep", action="store_true", help="time sizes 1KiB..4GiB (x4) for every algorithm")
    parser.add_argument("--png", default=None, help="with --sweep: plot busbw vs size per algorithm to this PNG")
    parser.add_argument("--execute", default=None, metavar="DEVICES",
                        help="also run the algorithm's step program on devices (emulated:N with N the group size, "
                             "or local), check it against JAX's collective and time both; or cluster[:NAME]: time "
                             "JAX's collective on an emulated cluster (testbed cluster)")
    parser.add_argument("--scale", type=float, default=None,
                        help="with --execute cluster: link rate = level bandwidth x SCALE (docs/cluster.md)")
    parser.add_argument("--repeats", type=int, default=10,
                        help="with --execute: timed calls of each (median reported; default 10)")


def _row(t: CollectiveTiming) -> dict[str, object]:
    return {"algorithm": t.algorithm, "bytes": t.bytes, "time_s": t.time_s, "algbw": t.algbw, "busbw": t.busbw,
            "bound_s": t.bound_s, "rounds": t.rounds}


def plot_sweep(rows: list[dict[str, object]], title: str, path: str) -> None:
    """busbw against message size (log x) with one line per algorithm."""
    from testbed.viz.plots import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    styles = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("x", "--"), ("P", "-."), ("*", ":")]
    for i, name in enumerate(dict.fromkeys(r["algorithm"] for r in rows)):
        mine = [r for r in rows if r["algorithm"] == name]
        marker, line = styles[i % len(styles)]
        # Distinct markers and dashes: algorithms with equal busbw would otherwise hide each other.
        ax.plot([r["bytes"] for r in mine], [r["busbw"] / 1e9 for r in mine], marker=marker, linestyle=line,
                markersize=5, label=name)
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=4))  # 1 KiB, 4 KiB, 16 KiB ...: sizes read as sizes, not 2^n
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_bytes(v)))
    ax.xaxis.set_minor_formatter(NullFormatter())
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    ax.set_xlabel("message size")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(plot_label(title, 160))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def _validate(args: argparse.Namespace, topology: Topology, op: Op, n: int) -> tuple[int, int | None]:
    root = args.root
    if not 0 <= root < n:
        raise InputError(f"must be a rank 0..{n - 1} of the group, got {root}", field="root")
    peer = args.peer
    if op is Op.SEND:
        if n < 2:
            raise InputError(f"send needs a group of two or more devices; --over {args.over} on {topology.name} "
                             "gives groups of one", field="over")
        peer = n - 1 if peer is None else peer
        if not 0 <= peer < n or peer == root:
            raise InputError(f"must be a rank 0..{n - 1} other than the root {root}, got {peer}", field="peer")
    elif peer is not None and not 0 <= peer < n:  # the timing's bounds index the group by it, whatever the op
        raise InputError(f"must be a rank 0..{n - 1} of the group, got {peer}", field="peer")
    return root, peer


def execute(args: argparse.Namespace) -> CommandResult:
    op = parse_op(args.op)
    algorithm = parse_algorithm(args.algorithm)
    topology = load_topology(args.topology)
    default_bytes = "4MiB" if args.execute is not None else "1GiB"
    nbytes = parse_bytes(args.bytes if args.bytes is not None else default_bytes, field="bytes")
    groups = topology.groups(args.over)
    n = len(groups[0])
    root, peer = _validate(args, topology, op, n)
    able = applicable_algorithms(topology, op, groups[0])
    if algorithm != "auto" and algorithm not in able:
        groups_time(topology, op, groups, nbytes, algorithm, root, peer)  # raises with which algorithms apply
    result = groups_time(topology, op, groups, nbytes, algorithm, root, peer)
    compared = [_row(groups_time(topology, op, groups, nbytes, a, root, peer)) for a in able]
    data: dict[str, object] = {
        **{k: v for k, v in to_jsonable(result).items()},
        "topology": topology.name, "over": args.over, "group_devices": list(groups[0]),
        "algorithms": compared,
    }
    sweep_rows: list[dict[str, object]] = []
    if args.sweep:
        chosen = able if algorithm == "auto" else [algorithm]
        for name in chosen:
            for size in sweep_sizes():
                sweep_rows.append(_row(groups_time(topology, op, groups, size, name, root, peer)))
        data["sweep"] = sweep_rows
    files = []
    if args.png:
        if not args.sweep:
            raise InputError("--png plots a sweep; add --sweep", field="png")
        title = f"{op} on {topology.name}, --over {args.over} ({n} ranks x {len(groups)} groups)"
        plot_sweep(sweep_rows, title, args.png)
        files.append(args.png)
        data["png"] = args.png
    executed: dict[str, Any] | None = None
    if is_cluster(args.execute):
        executed = execute_on_cluster(args, topology, op, groups, nbytes)
        data["execute"] = executed
    elif args.execute is not None:
        executed = _execute_on_devices(args, topology, op, groups, nbytes, algorithm, result, compared, root, peer)
        data["execute"] = executed

    def render(console) -> None:
        console.print(f"[bold]{op}[/] on [bold]{markup(topology.name)}[/] over {markup(args.over)}: {len(groups)} "
                      f"group(s) of {n} ranks, {format_bytes(nbytes)}")
        _render_algorithms(console, compared, result, algorithm, topology, op, groups[0], nbytes)
        _render_sweep(console, sweep_rows)
        if executed is not None and "cluster" in executed:
            render_cluster_execution(console, executed)
        elif executed is not None:
            _render_execution(console, executed, topology.name)
        for f in files:
            console.print(f"wrote {markup(f)}")

    failed = executed is not None and not executed["ok"]
    return CommandResult(data, render, exit_code=1 if failed else 0, files=files)


def _render_algorithms(console: Any, compared: list[dict[str, Any]], result: CollectiveTiming, algorithm: str,
                       topology: Topology, op: Op, group: tuple[int, ...], nbytes: float) -> None:
    """Every applicable algorithm's time, bandwidths, bound and rounds, the chosen one starred with why (on
    NVIDIA hierarchies NCCL's tuning model chooses, not the fastest)."""
    from testbed.cli.tables import Col, fitted_table

    columns = [Col(header="algorithm", key=True, justify="left"), Col(header="time"), Col(header="algbw"),
               Col(header="busbw"), Col(header="bound", drop=1), Col(header="rounds", drop=2)]
    cells = [[f"{row['algorithm']}{' *' if row['algorithm'] == result.algorithm else ''}",
              format_time(row["time_s"]), format_bandwidth(row["algbw"]), format_bandwidth(row["busbw"]),
              format_time(row["bound_s"]), str(row["rounds"])] for row in compared]
    console.print(fitted_table(console, columns, cells))
    console.print("algbw: bytes / time; busbw: algbw x nccl-tests' bus factor (all-reduce 2(n-1)/n); bound: the "
                  "links' lower bound on the time; rounds: steps of the algorithm's program (NCCL's: one call)")
    fastest = min(compared, key=lambda row: row["time_s"])["algorithm"] if compared else result.algorithm
    how = ("requested" if algorithm != "auto" else "auto: fastest" if result.algorithm == fastest
           else "auto: NCCL's tuning model's pick")  # on NVIDIA hierarchies NCCL chooses, not the fastest
    console.print(f"* chosen ({how})")
    if how.startswith("auto: NCCL"):
        console.print(_why_nccl(topology, op, group, nbytes, result.algorithm, fastest))


def _render_sweep(console: Any, sweep_rows: list[dict[str, Any]]) -> None:
    """One table per swept algorithm: size, time, algbw, busbw."""
    from rich.table import Table

    for name in dict.fromkeys(r["algorithm"] for r in sweep_rows):
        sweep = Table(title=f"{name}")
        for column in ("size", "time", "algbw", "busbw"):
            sweep.add_column(column, justify="right")
        for r in (r for r in sweep_rows if r["algorithm"] == name):
            sweep.add_row(format_bytes(r["bytes"]), format_time(r["time_s"]), format_bandwidth(r["algbw"]),
                          format_bandwidth(r["busbw"]))
        console.print(sweep)


# -- --execute: the step program on devices -------------------------------------------------------

#: The JAX collective each executable op is checked against (testbed.runner.collectives.builtin_collective).
LAX_NAMES = {Op.ALL_REDUCE: "lax.psum", Op.ALL_GATHER: "lax.all_gather", Op.REDUCE_SCATTER: "lax.psum_scatter",
             Op.ALL_TO_ALL: "lax.all_to_all"}


def _why_nccl(topology: Any, op: Op, group: Any, nbytes: float, chosen: str, fastest: str) -> str:
    """Why NCCL runs ``chosen`` when ``fastest`` is faster in the table: its own model's predictions."""
    from testbed.collectives.nccl import nccl_predictions

    own = nccl_predictions(topology, op, group, nbytes)
    ranked = ", ".join(f"{name} {format_time(t)} ({protocol})" for name, (protocol, t) in
                       sorted(own.items(), key=lambda kv: kv[1][1]))
    gap = "" if fastest not in own else (f"; {fastest} is fastest in the table, but NCCL only runs what its model "
                                         "ranks first")
    return (f"why {chosen}: NCCL picks the (algorithm, protocol) its own tuning model (src/graph/tuning.cc) predicts "
            f"fastest: {ranked}. The table's times add what measured multi-node runs show that model leaves out "
            f"(NVLS-tree's network shortfall, docs/collectives.md){gap}")


def _executed_algorithm(op: Op, requested: str, chosen: str, compared: list[dict[str, object]]) -> tuple[str, str]:
    """(algorithm to execute, why): the chosen one, or with auto the fastest step program when NCCL's won."""
    if chosen in ALGORITHMS:
        return chosen, "requested" if requested != "auto" else "auto: fastest"
    if requested != "auto":
        able = [r["algorithm"] for r in compared if r["algorithm"] in ALGORITHMS]
        raise InputError(f"`{chosen}` is NCCL's algorithm, timed by NCCL's model, and has no step program to "
                         f"execute; with --execute pass --algorithm one of {', '.join(map(str, able)) or 'none'} "
                         "or auto", field="algorithm")
    programs = [r for r in compared if r["algorithm"] in ALGORITHMS]
    if not programs:
        raise InputError(f"no step-program algorithm applies to {op} on this group, so there is nothing to "
                         "execute", field="execute")
    best = min(programs, key=lambda r: (r["time_s"], r["rounds"]))
    return str(best["algorithm"]), f"auto: fastest step program; {chosen} (NCCL's) has none"


def _prepare_devices(text: str, n: int, where: str) -> str:
    """Request the devices before JAX starts its backend; returns the request as text.

    ``emulated:N`` must give the group's ``n`` ranks. A process whose JAX
    already runs on ``n`` or more host devices (a test session) uses the
    first ``n``: the count can no longer change and a collective needs only
    its own ranks.
    """
    from testbed.runner import devices as dev

    if not text.strip():  # parse_devices reads an empty --devices as absent; an empty --execute is a mistake
        raise InputError(f"is empty; give emulated:{n} (the group's {n} ranks) or local", field="execute")
    try:
        request = dev.parse_devices(text, n)
    except InputError as exc:
        raise InputError(exc.message, field="execute") from None
    if request.kind == "emulated" and request.count != n:
        raise InputError(f"emulated:{request.count} gives {request.count} device(s) but {where} is a group of {n} "
                         f"ranks; use --execute emulated:{n}", field="execute")
    try:
        dev.prepare(request)
    except InputError:
        import jax

        if jax.default_backend() != "cpu" or jax.device_count() < n:
            raise
    have = len(dev.select_devices())
    if have < n:
        raise InputError(f"{request} gives {have} device(s) but {where} is a group of {n} ranks; use "
                         f"--execute emulated:{n} on a CPU host", field="execute")
    return str(request)


#: Copies of the n-rank buffer an execution holds at its peak: the fp32 input and its device copies, both
#: outputs, and the float64 copies the check compares.
_EXECUTE_COPIES = 12


def _available_memory() -> int | None:
    """Bytes of memory this host can still give (Linux MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_host_memory(nbytes: float, n: int) -> None:
    """Refuse an execution whose buffers would not fit in the host's free memory, before JAX starts."""
    need = _EXECUTE_COPIES * n * float(nbytes)
    have = _available_memory()
    if have is not None and need > have:
        raise InputError(f"executing {format_bytes(nbytes)} on {n} ranks needs about {format_bytes(need)} of host "
                         f"memory ({_EXECUTE_COPIES} copies of the {n}-rank buffer), more than the "
                         f"{format_bytes(have)} available; give a smaller --bytes", field="bytes")


def _execute_on_devices(args: argparse.Namespace, topology: Topology, op: Op, groups: list, nbytes: float,
                        algorithm: str, result: CollectiveTiming, compared: list[dict[str, object]], root: int,
                        peer: int | None) -> dict[str, Any]:
    """Run the timed step program on devices; the check, both measured times and the prediction at that size."""
    if args.repeats < 1:
        raise InputError(f"must be at least 1, got {args.repeats}", field="repeats")
    if op not in LAX_NAMES:
        raise InputError(f"{op} has no JAX collective to check a step program against; --execute runs "
                         f"{', '.join(LAX_NAMES)}", field="execute")
    name, why = _executed_algorithm(op, algorithm, result.algorithm, compared)
    program, _ = placed_program(topology, op, name, groups[0], root, peer)
    n = program.n
    _check_host_memory(nbytes, n)
    request = _prepare_devices(args.execute, n, f"{op} over {args.over} on {topology.name}")
    from testbed.runner.collectives import execute_and_check

    run = execute_and_check(program, nbytes, repeats=args.repeats)
    predicted = groups_time(topology, op, groups, run.bytes, name, root, peer)
    out: dict[str, Any] = {**to_jsonable(run), "devices": request, "chosen": why, "lax": LAX_NAMES[op],
                           "predicted_s": predicted.time_s, "predicted_groups": len(groups)}
    if not run.ok:
        error = "not finite" if run.max_abs_error is None else f"{run.max_abs_error:.3g}"
        sys.stderr.write(f"error: the `{name}` step program for {op} on {n} {run.platform} device(s) does not match "
                         f"{LAX_NAMES[op]}: max abs error {error} > tolerance {run.tolerance:.3g}\n")
    return out


def _render_execution(console: Any, run: dict[str, Any], topology: str) -> None:
    """Predicted vs measured times of the executed program and JAX's collective, and the check."""
    from rich.table import Table

    n, nbytes, factor = run["ranks"], run["bytes"], BUS_FACTOR[parse_op(run["op"])](run["ranks"])
    console.print(f"executed [bold]{run['algorithm']}[/] ({run['chosen']}) on {run['devices']}: {n} "
                  f"{run['platform']} device(s), {format_bytes(nbytes)} fp32, median of {run['repeats']}")
    table = Table()
    for column in ("", "time", "algbw", "busbw"):
        table.add_column(column, justify="left" if not column else "right")
    groups = f", {run['predicted_groups']} groups at once" if run["predicted_groups"] > 1 else ""
    rows = [(f"predicted on {shown(topology)}{groups}", run["predicted_s"]),
            (f"measured step program ({run['algorithm']}, ppermute)", run["program_time_s"]),
            (f"measured {run['lax']}", run["builtin_time_s"])]
    for label, seconds in rows:
        algbw = nbytes / seconds if seconds > 0 else 0.0
        table.add_row(label, format_time(seconds), format_bandwidth(algbw), format_bandwidth(algbw * factor))
    console.print(table)
    error = "not finite" if run["max_abs_error"] is None else f"{run['max_abs_error']:.3g}"
    verdict = "[green]ok[/]" if run["ok"] else "[red]MISMATCH[/]"
    console.print(f"check vs {run['lax']}: {verdict}, max abs error {error} (tolerance {run['tolerance']:.3g})")
