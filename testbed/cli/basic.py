"""`testbed topologies`, `testbed topology show`, `testbed plan check`."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from testbed.cli.tables import Col, compact, fitted_table
from testbed.errors import InputError
from testbed.model.memory import memory_breakdown
from testbed.output import CommandResult
from testbed.plan.placement import Placement, group_span, place
from testbed.plan.spec import MESH_AXES, Plan
from testbed.plan.io import load_plan, plan_to_dict
from testbed.topology import Topology
from testbed.topology.io import bundled_names, load_topology
from testbed.text import markup, shown
from testbed.units import format_bandwidth, format_bytes, format_flops, format_time

__all__ = ["topologies", "topology", "plan", "plan_topology", "placement_report", "render_placement"]


# -- testbed topologies ----------------------------------------------------------

def _topologies_add(parser: argparse.ArgumentParser) -> None:
    pass


def _topologies_execute(args: argparse.Namespace) -> CommandResult:
    rows = []
    for name in bundled_names():
        t = load_topology(name)
        rows.append({**t.summary(), "description": t.description,
                     "memory_bytes": t.device.memory_bytes, "peak_bf16_flops": t.device.flops("bf16")})

    def render(console) -> None:
        columns = [Col(header="name", key=True, justify="left"), Col(header="devices"),
                   Col(header="levels", drop=2, justify="left"), Col(header="device", drop=1, justify="left"),
                   Col(header="memory"), Col(header="bf16 peak")]
        cells = [[shown(r["name"]), str(r["devices"]), ",".join(shown(level) for level in r["levels"]),
                  shown(r["device"]), format_bytes(r["memory_bytes"]), format_flops(r["peak_bf16_flops"])]
                 for r in rows]
        console.print(fitted_table(console, columns, cells, title="bundled topologies", **compact()))

    return CommandResult({"topologies": rows}, render)


topologies = SimpleNamespace(add_arguments=_topologies_add, execute=_topologies_execute)


# -- testbed topology show -------------------------------------------------------

def _topology_add(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    show = sub.add_parser("show", help="summary, levels and links; --png draws it")
    show.add_argument("topology", help="bundled name or YAML path")
    show.add_argument("--png", help="write a drawing of devices, switches and links")
    show.add_argument("--json", action="store_true", help=argparse.SUPPRESS)


def _topology_execute(args: argparse.Namespace) -> CommandResult:
    t = load_topology(args.topology)
    levels = [{"name": l.name, "size": l.size, "bandwidth": l.bandwidth, "latency": l.latency,
               "kind": None if l.kind is None else str(l.kind), "groups": len(t.groups(l.name))} for l in t.levels]
    kinds: dict[str, int] = {}
    for _, _, d in t.graph.edges(data=True):
        kinds[d["kind"]] = kinds.get(d["kind"], 0) + 1
    data = {**t.summary(), "description": t.description, "switches": sum(1 for _, d in t.graph.nodes(data=True)
                                                                         if d.get("kind") == "switch"),
            "links": t.graph.number_of_edges(), "link_kinds": kinds, "levels": levels,
            "device_spec": {"name": t.device.name, "peak_flops": dict(t.device.peak_flops),
                            "memory_bytes": t.device.memory_bytes, "memory_bandwidth": t.device.memory_bandwidth},
            "calibration": t.calibration.as_dict(full=True)}
    files = []
    if args.png:
        from testbed.viz.plots import draw_topology

        files.append(str(draw_topology(t, args.png)))
        data["png"] = args.png

    def render(console) -> None:
        console.print(f"[bold]{markup(t.name)}[/bold]: {markup(t.description or '', 400)}")
        console.print(f"{t.num_devices} x {markup(t.device.name)}: " + ", ".join(
            f"{k} {format_flops(v)}" for k, v in t.device.peak_flops.items())
            + f"; {format_bytes(t.device.memory_bytes)} at {format_bandwidth(t.device.memory_bandwidth)}")
        columns = [Col(header="level", key=True, justify="left"), Col(header="size"), Col(header="bandwidth/dir"),
                   Col(header="latency"), Col(header="kind", drop=1, justify="left"), Col(header="groups", drop=2)]
        cells = [[shown(l["name"]), str(l["size"]), format_bandwidth(l["bandwidth"]) if l["bandwidth"] else "-",
                  format_time(l["latency"]), l["kind"] or "-", str(l["groups"])] for l in levels]
        console.print(fitted_table(console, columns, cells, title="levels (innermost first)", **compact()))
        console.print(f"{data['switches']} switches, {data['links']} links: "
                      + ", ".join(f"{n} {markup(k)}" for k, n in kinds.items()))
        for f in files:
            console.print(f"wrote {markup(f)}")

    return CommandResult(data, render, files=files)


topology = SimpleNamespace(add_arguments=_topology_add, execute=_topology_execute)


# -- testbed plan check ------------------------------------------------------------

def plan_topology(plan: Plan, topology_arg: str | None, plan_file: str | None = None,
                  devices: int | None = None) -> Topology:
    """The topology named on the command line, else the plan's own ``topology:``; resized to ``devices``.

    Either name may be ``NAME@DEVICES`` (testbed.topology.resize). When the
    plan's ``topology:`` names a path that cannot be used (missing, too long,
    a folder) or a size its topology cannot take, the error names
    ``plan_file`` and the field ``topology``; errors inside the topology file
    name that file.
    """
    from testbed.errors import quote
    from testbed.fields import is_input_file
    from testbed.topology.io import resolve_topology_path, topology_from_text
    from testbed.topology.resize import resize_topology, split_sized_name

    if topology_arg:
        return load_topology(topology_arg, devices)
    name = plan.topology
    if not name:
        raise InputError("no topology: pass --topology NAME or set `topology:` in the plan", field="topology",
                         file=plan_file)
    try:
        base, sized = name, None
        if "@" in name and not is_input_file(name, "topology YAML file"):
            base, sized = split_sized_name(name)
        display, text = resolve_topology_path(base)
    except InputError as exc:
        raise InputError(f"topology {quote(name)}: {exc.message}", field="topology", file=plan_file) from None
    topology = topology_from_text(display, text)
    if sized is not None:
        try:
            topology = resize_topology(topology, sized, field="topology")
        except InputError as exc:
            raise exc.with_file(plan_file) if plan_file else exc from None
    return topology if devices is None else resize_topology(topology, devices)


def add_devices_argument(parser: argparse.ArgumentParser) -> None:
    """``--devices N``: the topology's outermost level resized to N devices (as ``--topology NAME@N``)."""
    parser.add_argument("--devices", type=int, metavar="N",
                        help="resize the topology's outermost level (nodes, a torus's last dim, slices) to N "
                             "devices; the same as --topology NAME@N")


def add_program_argument(parser: argparse.ArgumentParser, verb: str, note: str = "") -> None:
    """``--program MODULE:FUNCTION``, the user's own JAX step in place of a plan; its help says what the command
    does with it (``verb``: predict, measure) and ends with ``note``."""
    parser.add_argument("--program", metavar="MODULE:FUNCTION",
                        help=f"{verb} your own JAX step instead of a plan: FUNCTION(mesh) returns (step, args) "
                             f"(docs/program.md){note}")


def add_program_mesh_arguments(parser: argparse.ArgumentParser) -> None:
    """``--mesh`` and ``--unknown-ops``, the options every ``--program`` command reads: declared here once."""
    parser.add_argument("--mesh", help="with --program: mesh axes and sizes, e.g. data=2,tensor=4 "
                                       "(default: data over every device)")
    parser.add_argument("--unknown-ops", choices=("refuse", "assume"), default="refuse",
                        help="with --program: refuse a custom call or host callback in the prediction (default), "
                             "or price it as a memory-bound op and say so")


def placement_report(plan: Plan, topology: Topology, placement: Placement) -> dict:
    """Per axis: degree, number of groups, first group and the levels it spans."""
    axes = {}
    for axis in MESH_AXES:
        groups = placement.groups(axis)
        axes[axis.value] = {"degree": plan.mesh.degree(axis), "groups": len(groups), "first_group": list(groups[0]),
                            "spans": group_span(topology, groups[0])}
    return {"order": [a.value for a in placement.order], "device_ids": placement.device_ids.tolist(), "axes": axes}


def render_placement(console, report: dict) -> None:
    columns = [Col(header="axis", key=True, justify="left"), Col(header="degree"), Col(header="groups"),
               Col(header="first group", drop=1, justify="left"), Col(header="spans", justify="left")]
    cells = [[axis, str(a["degree"]), str(a["groups"]), str(a["first_group"]), shown(a["spans"])]
             for axis, a in report["axes"].items()]
    console.print(fitted_table(console, columns, cells, title=f"placement (order outermost first: "
                               f"{' > '.join(report['order'])})", **compact()))


def _plan_add(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    check = sub.add_parser("check", help="validate a plan and show its placement on a topology")
    check.add_argument("plan", help="plan YAML file (or a bundled plan name, e.g. demo)")
    check.add_argument("--topology", help="bundled name or YAML path, NAME@DEVICES resizes it (default: the plan's `topology:`)")
    add_devices_argument(check)
    check.add_argument("--fail-if-oom", action="store_true",
                       help="exit 1 when the plan does not fit its topology's device memory (else a warning)")
    check.add_argument("--json", action="store_true", help=argparse.SUPPRESS)


def _plan_execute(args: argparse.Namespace) -> CommandResult:
    p = load_plan(args.plan)
    t = plan_topology(p, args.topology, args.plan, args.devices)
    try:
        placement = place(p, t)
    except Exception as exc:
        if isinstance(exc, InputError):
            raise exc.with_file(args.plan) from None
        raise
    report = placement_report(p, t, placement)
    memory = _memory_fit(p, t, args.plan)
    data = {"ok": True, "plan": plan_to_dict(p), "topology": t.name, "devices": t.num_devices,
            "microbatch_size": p.microbatch_size, "placement": report, "memory": memory,
            "warnings": [] if memory["fits"] else [memory["message"]]}

    def render(console) -> None:
        console.print(f"[green]ok[/green]: plan `{markup(p.name)}` fits the mesh of `{markup(t.name)}` "
                      f"({t.num_devices} devices); {p.batch.microbatches} microbatches of {p.microbatch_size} "
                      f"sequences per replica")
        for warning in data["warnings"]:
            console.print(f"[yellow]warning[/yellow]: {warning}")
        render_placement(console, report)

    return CommandResult(data, render, exit_code=1 if args.fail_if_oom and not memory["fits"] else 0)


def _memory_fit(plan: Plan, topology: Topology, plan_file: str) -> dict:
    """The fullest device's bytes against its capacity, and a warning's text when they overflow."""
    try:
        breakdown = memory_breakdown(plan, topology)
    except InputError as exc:
        raise exc.with_file(plan_file) from None
    message = (f"the fullest device (stage {breakdown.worst_stage}) needs {format_bytes(breakdown.total)} of its "
               f"{format_bytes(breakdown.capacity)}: the plan does not fit in memory (`testbed memory` breaks it down)")
    return {"total": breakdown.total, "capacity": breakdown.capacity, "fits": breakdown.fits,
            "message": None if breakdown.fits else message}


plan = SimpleNamespace(add_arguments=_plan_add, execute=_plan_execute)
