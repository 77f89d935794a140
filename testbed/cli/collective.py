"""`testbed collective OP --topology T --over LEVELS --bytes N [--algorithm A] [--sweep] [--png F]`.

Times one collective on a topology. ``--over`` names the levels a group spans;
when that gives several groups (``--over node`` on a multi-node cluster) they
run at once, sharing links, and the slowest is reported. ``--sweep`` times
message sizes 1 KiB .. 4 GiB (x4) for every applicable algorithm, as
nccl-tests prints them; ``--png`` plots bus bandwidth against size.
"""

from __future__ import annotations

import argparse

from testbed.collectives.algorithms import parse_algorithm
from testbed.collectives.timing import CollectiveTiming, applicable_algorithms, groups_time
from testbed.collectives.ops import OPS, Op, parse_op
from testbed.errors import InputError
from testbed.output import CommandResult, to_jsonable
from testbed.topology import Topology
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
    parser.add_argument("--topology", required=True, help="bundled topology name or YAML path")
    parser.add_argument("--over", default="all", help="levels the group spans, e.g. node, x,y or all (default all)")
    parser.add_argument("--bytes", default=None, help="buffer size, e.g. 1GiB or 4MB (default 1GiB)")
    parser.add_argument("--algorithm", default="auto", help="algorithm name or auto (default: the fastest)")
    parser.add_argument("--root", type=int, default=0, help="broadcast root / send source, as a rank of the group")
    parser.add_argument("--peer", type=int, default=None, help="send destination rank (default: the last rank)")
    parser.add_argument("--sweep", action="store_true", help="time sizes 1KiB..4GiB (x4) for every algorithm")
    parser.add_argument("--png", default=None, help="with --sweep: plot busbw vs size per algorithm to this PNG")


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
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
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
    return root, peer


def execute(args: argparse.Namespace) -> CommandResult:
    op = parse_op(args.op)
    algorithm = parse_algorithm(args.algorithm)
    topology = load_topology(args.topology)
    nbytes = parse_bytes(args.bytes if args.bytes is not None else "1GiB", field="bytes")
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

    def render(console) -> None:
        from rich.table import Table

        console.print(f"[bold]{op}[/] on [bold]{topology.name}[/] over {args.over}: {len(groups)} group(s) of "
                      f"{n} ranks, {format_bytes(nbytes)}")
        table = Table()
        for column in ("algorithm", "time", "algbw", "busbw", "bound", "rounds"):
            table.add_column(column, justify="left" if column == "algorithm" else "right")
        for row in compared:
            mark = " *" if row["algorithm"] == result.algorithm else ""
            table.add_row(f"{row['algorithm']}{mark}", format_time(row["time_s"]), format_bandwidth(row["algbw"]),
                          format_bandwidth(row["busbw"]), format_time(row["bound_s"]), str(row["rounds"]))
        console.print(table)
        console.print(f"* chosen ({'auto: fastest' if algorithm == 'auto' else 'requested'})")
        if sweep_rows:
            for name in dict.fromkeys(r["algorithm"] for r in sweep_rows):
                sweep = Table(title=f"{name}")
                for column in ("size", "time", "algbw", "busbw"):
                    sweep.add_column(column, justify="right")
                for r in (r for r in sweep_rows if r["algorithm"] == name):
                    sweep.add_row(format_bytes(r["bytes"]), format_time(r["time_s"]), format_bandwidth(r["algbw"]),
                                  format_bandwidth(r["busbw"]))
                console.print(sweep)
        for f in files:
            console.print(f"wrote {f}")

    return CommandResult(data, render, files=files)
