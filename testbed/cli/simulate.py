"""`testbed simulate` (one plan, one topology) and `testbed compare` (one plan, several topologies)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

from testbed.cli.basic import add_devices_argument, plan_topology
from testbed.errors import InputError
from testbed.output import CommandResult
from testbed.plan.spec import Plan
from testbed.plan.io import load_plan
from testbed.sim.engine import Simulation, simulate as run_simulation
from testbed.sim.moe import exposed_stream_s
from testbed.sim.ring import RING_STREAM, exposed_ring_s
from testbed.sim.trace_args import write_outputs
from testbed.topology import Topology
from testbed.text import markup, plot_label, shown
from testbed.topology.io import load_topology
from testbed.units import format_bytes, format_time, parse_bytes

__all__ = ["simulate", "compare", "simulate_file_plan"]

MEMORY_KEYS = ("params_count", "params", "grads", "optimizer", "activations", "workspace", "total", "capacity", "fits")


def simulate_file_plan(plan: Plan, topology: Topology, plan_file: str) -> Simulation:
    """Simulate, attributing bad-input errors (mesh vs device count) to the plan file."""
    try:
        return run_simulation(plan, topology)
    except InputError as exc:
        raise exc.with_file(plan_file) from None


def _summary(sim: Simulation) -> dict[str, Any]:
    r = sim.report
    memory = {k: r.memory[k] for k in MEMORY_KEYS if k in r.memory}
    memory.update({k: v for k, v in r.memory.items() if k not in memory})
    out = {"step_time_s": r.step_time_s, "compute_s": r.compute_s, "exposed_comm_s": r.exposed_comm_s,
           "bubble_fraction": r.bubble_fraction, "mfu": r.mfu, "memory": memory, "plan": r.plan,
           "topology": r.topology, "devices": r.devices, "tasks": r.tasks}
    if any(t.op == "all_to_all" for t in sim.program.tasks):  # expert parallelism: the MoE all-to-alls' share
        out["exposed_all_to_all_s"] = exposed_stream_s(sim.timeline)
    if any(t.stream == RING_STREAM for t in sim.program.tasks):  # context parallelism: the ring's share
        out["exposed_ring_s"] = exposed_ring_s(sim.timeline)
    return out


# -- testbed simulate ----------------------------------------------------------------

def _simulate_add(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", help="plan YAML file or bundled plan name (e.g. demo)")
    parser.add_argument("--program", metavar="MODULE:FUNCTION",
                        help="predict your own JAX step instead of a plan: FUNCTION(mesh) returns (step, args) "
                             "(docs/program.md); needs --topology")
    parser.add_argument("--mesh", help="with --program: mesh axes and sizes, e.g. data=64,tensor=8 "
                                       "(default: data over every device)")
    parser.add_argument("--unknown-ops", choices=("refuse", "assume"), default="refuse",
                        help="with --program: refuse a custom call or host callback (default), or price it as a "
                             "memory-bound op and say so")
    parser.add_argument("--topology", help="bundled name or YAML path, NAME@DEVICES resizes it (default: the plan's `topology:`)")
    add_devices_argument(parser)
    parser.add_argument("--trace", help="write a Chrome/Perfetto trace JSON (open in ui.perfetto.dev)")
    parser.add_argument("--max-trace-bytes", default="256MiB",
                        help="refuse a --trace estimated larger than this (default 256MiB; e.g. 4GiB)")
    parser.add_argument("--gantt", help="write a Gantt chart PNG of the representative streams")
    parser.add_argument("--fail-if-oom", action="store_true",
                        help="exit 1 when the fullest device's memory overflows (as `memory --fail-if-oom`)")


def _simulate_execute(args: argparse.Namespace) -> CommandResult:
    if getattr(args, "program", None):
        from testbed.cli.program import execute

        return execute(args)
    if not args.plan:
        raise InputError("give --plan (a plan YAML file or bundled name) or --program MODULE:FUNCTION", field="--plan")
    max_trace = parse_bytes(args.max_trace_bytes, field="--max-trace-bytes")
    plan = load_plan(args.plan)
    topology = plan_topology(plan, args.topology, args.plan, args.devices)
    sim = simulate_file_plan(plan, topology, args.plan)
    data = _summary(sim)
    written = write_outputs(sim.timeline, sim.program, topology, args.trace, args.gantt, max_trace,
                            title=f"{plan.name} on {topology.name}")
    data.update({k: getattr(args, k) for k in written})
    files = list(written.values())

    def render(console) -> None:
        m = data["memory"]
        console.print(f"[bold]{markup(plan.name)}[/bold] on [bold]{markup(topology.name)}[/bold] ({topology.num_devices} devices, "
                      f"{sim.report.tasks} tasks)")
        console.print(f"step time      {format_time(data['step_time_s'])}")
        console.print(f"compute        {format_time(data['compute_s'])}")
        console.print(f"exposed comm   {format_time(data['exposed_comm_s'])}")
        if "exposed_all_to_all_s" in data:
            console.print(f"  all-to-all   {format_time(data['exposed_all_to_all_s'])} (MoE dispatch and combine)")
        if "exposed_ring_s" in data:
            console.print(f"  ring         {format_time(data['exposed_ring_s'])} (ring attention's K/V sends)")
        console.print(f"bubble         {data['bubble_fraction']:.1%}")
        console.print(f"MFU            {data['mfu']:.1%}")
        fits = "[green]fits[/green]" if m.get("fits") else "[red]does not fit[/red]"
        console.print(f"memory         {format_bytes(m.get('total', 0))} of {format_bytes(m.get('capacity', 0))} "
                      f"per device: {fits}")
        for f in files:
            console.print(f"wrote {markup(f)}")

    fits = bool(data["memory"].get("fits", True))
    return CommandResult(data, render, exit_code=1 if args.fail_if_oom and not fits else 0, files=files)


simulate = SimpleNamespace(add_arguments=_simulate_add, execute=_simulate_execute)


# -- testbed compare -------------------------------------------------------------------

def _compare_add(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", required=True, help="plan YAML file or bundled plan name")
    parser.add_argument("--topology", nargs="+", required=True, metavar="T",
                        help="two or more topologies (bundled names or YAML paths)")
    parser.add_argument("--png", help="write a stacked bar chart of the step-time breakdown")
    parser.add_argument("--scale", choices=("data",),
                        help="scale the plan's data degree (and global batch) to each topology's device count")


def compare_rows(plan: Plan, topologies: list[Topology], plan_file: str, scale: str | None = None) -> list[dict]:
    """One summary row per topology (the plan scaled along ``scale`` first, if given)."""
    from testbed.plan.scale import scale_data

    rows = []
    for topology in topologies:
        p = scale_data(plan, topology.num_devices, f"topology `{topology.name}`") if scale == "data" else plan
        s = _summary(simulate_file_plan(p, topology, plan_file))
        rows.append({"topology": topology.name, "devices": topology.num_devices, "data": p.mesh.data,
                     "global_batch": p.batch.global_batch, "step_time_s": s["step_time_s"], "compute_s": s["compute_s"],
                     "exposed_comm_s": s["exposed_comm_s"], "bubble_fraction": s["bubble_fraction"], "mfu": s["mfu"],
                     "fits": bool(s["memory"].get("fits")), "memory_total": s["memory"].get("total")})
    return rows


def draw_breakdown(rows: list[dict], path: str, title: str = ""):
    """Two panels per topology: the step time on a log scale, and its breakdown as shares of the step.

    Step times across topologies span orders of magnitude (a CPU host vs an
    NVSwitch node), so stacked milliseconds leave the fast bars unreadable;
    shares of each topology's own step (compute, exposed communication,
    idle: bubble and waits) keep every breakdown visible.
    """
    from testbed.viz.plots import pyplot, save_figure

    plt = pyplot()
    names = [plot_label(r["topology"], 24) for r in rows]
    steps = [r["step_time_s"] for r in rows]
    share = lambda value, step: 100.0 * value / step if step > 0 else 0.0  # noqa: E731
    compute = [share(r["compute_s"], r["step_time_s"]) for r in rows]
    comm = [share(r["exposed_comm_s"], r["step_time_s"]) for r in rows]
    idle = [max(0.0, 100.0 - c - e) for c, e in zip(compute, comm)]
    width = max(7.0, 1.6 * len(rows) + 3.0)
    fig, (left, right) = plt.subplots(1, 2, figsize=(width, 4.6))
    left.bar(names, [s * 1e3 for s in steps], color="#4e79a7")
    left.set_yscale("log")
    for i, r in enumerate(rows):
        left.text(i, r["step_time_s"] * 1e3, format_time(r["step_time_s"]) + ("" if r["fits"] else " OOM"),
                  ha="center", va="bottom", fontsize=8)
    left.set_ylabel("step time (ms, log scale)")
    left.set_title("step time")
    right.bar(names, compute, label="compute", color="#4e79a7")
    right.bar(names, comm, bottom=compute, label="exposed comm", color="#f28e2b")
    right.bar(names, idle, bottom=[c + e for c, e in zip(compute, comm)], label="idle (bubble, waits)",
              color="#bab0ac")
    for i, r in enumerate(rows):
        right.text(i, 101, f"MFU {r['mfu']:.1%}", ha="center", va="bottom", fontsize=8)
    right.set_ylim(0, 112)
    right.set_ylabel("share of the step (%)")
    right.set_title("breakdown")
    for ax in (left, right):
        plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.subplots_adjust(bottom=0.27)
    fig.legend(*right.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8, frameon=False)
    return save_figure(fig, path)


def _compare_execute(args: argparse.Namespace) -> CommandResult:
    plan = load_plan(args.plan)
    topologies = [load_topology(name) for name in args.topology]
    rows = compare_rows(plan, topologies, args.plan, args.scale)
    data: dict[str, Any] = {"plan": plan.name, "scale": args.scale, "rows": rows}
    files = []
    if args.png:
        files.append(str(draw_breakdown(rows, args.png, title=f"{plot_label(plan.name)}: one training step")))
        data["png"] = args.png

    def render(console) -> None:
        from rich.text import Text

        from testbed.cli.tables import Col, compact, fitted_table

        # Fits 80 columns (piped output): light borders, short headers; the topology's name is whole, and the
        # compute and bubble columns go first when a long name needs the room. The data degree is shown when
        # --scale changed it.
        columns = [Col(header="topology", key=True, justify="left"), Col(header="devices")]
        columns += [Col(header="data")] if args.scale else []
        columns += [Col(header="step"), Col(header="compute", drop=2), Col(header="exp.comm"),
                    Col(header="bubble", drop=1), Col(header="MFU"), Col(header="memory")]
        cells = []
        for r in rows:
            row = [shown(r["topology"]), str(r["devices"])] + ([str(r["data"])] if args.scale else [])
            row += [format_time(r["step_time_s"]), format_time(r["compute_s"]), format_time(r["exposed_comm_s"]),
                    f"{r['bubble_fraction']:.1%}", f"{r['mfu']:.1%}", "fits" if r["fits"] else Text("OOM", style="red")]
            cells.append(row)
        title = markup(plan.name) + (" (data degree scaled)" if args.scale else "")
        console.print(fitted_table(console, columns, cells, title=title, **compact()))
        for f in files:
            console.print(f"wrote {markup(f)}")

    return CommandResult(data, render, files=files)


compare = SimpleNamespace(add_arguments=_compare_add, execute=_compare_execute)
