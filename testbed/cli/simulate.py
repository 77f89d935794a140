"""`testbed simulate`: one plan on one topology (`testbed compare`, testbed.cli.compare, sets plans side by side)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

from testbed.cli.basic import add_devices_argument, add_program_argument, add_program_mesh_arguments, plan_topology
from testbed.errors import InputError
from testbed.output import CommandResult
from testbed.plan.spec import Plan
from testbed.plan.io import load_plan_stating_runtime
from testbed.sim.graph.engine import Simulation, simulate as run_simulation
from testbed.sim.step.moe import exposed_stream_s
from testbed.sim.graph.profile_spread import profile_spread
from testbed.sim.graph.ring import RING_STREAM, exposed_ring_s
from testbed.sim.graph.trace_args import write_outputs
from testbed.topology import Topology
from testbed.text import markup, plot_label, shown
from testbed.topology.io import load_topology
from testbed.units import format_bytes, format_time, parse_bytes

__all__ = ["simulate", "simulate_file_plan"]

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


def _band(spread: dict | None) -> str:
    """`` (7.6-9.1 s over runtime profiles)``: the least and most step time of the named profiles, in the unit of
    the larger (empty without a spread)."""
    if not spread:
        return ""
    value, unit = format_time(spread["high_s"]).split(" ")
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[unit]
    decimals = len(value.partition(".")[2])  # the low end to the high end's last digit
    return f" ({spread['low_s'] / scale:.{decimals}f}-{value} {unit} over runtime profiles)"


# -- testbed simulate ----------------------------------------------------------------

def _simulate_add(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", help="plan YAML file or bundled plan name (e.g. demo)")
    add_program_argument(parser, "predict", "; needs --topology")
    from testbed.cli.user_code import DEFAULT_TIMEOUT_S

    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help="with --program: the time limit for importing, calling and tracing it (default 600 s); "
                             "past it the command stops with exit status 2")
    add_program_mesh_arguments(parser)
    parser.add_argument("--compile", metavar="TARGET",
                        help="with --program: compile it with XLA:TPU for a slice of --topology's devices (e.g. "
                             "tpu:v5e:1x1, no chip needed; needs libtpu) and report XLA:TPU's memory")
    parser.add_argument("--topology", help="bundled name or YAML path, NAME@DEVICES resizes it (default: the plan's `topology:`)")
    add_devices_argument(parser)
    parser.add_argument("--trace", help="write a Chrome/Perfetto trace JSON (open in ui.perfetto.dev)")
    parser.add_argument("--max-trace-bytes", default="256MiB",
                        help="refuse a --trace estimated larger than this (default 256MiB; e.g. 4GiB)")
    parser.add_argument("--gantt", help="write a Gantt chart PNG of the representative streams")
    parser.add_argument("--no-profile-spread", action="store_true",
                        help="for a plan without `runtime:`, skip simulating it under every named runtime profile "
                             "(the step time's band over them)")
    parser.add_argument("--fail-if-oom", action="store_true",
                        help="exit 1 when the fullest device's memory overflows (as `memory --fail-if-oom`)")


def _simulate_execute(args: argparse.Namespace) -> CommandResult:
    if getattr(args, "program", None):
        from testbed.cli.program import execute

        return execute(args)
    if not args.plan:
        raise InputError("give --plan (a plan YAML file or bundled name) or --program MODULE:FUNCTION", field="--plan")
    if args.compile:
        raise InputError("--compile takes --program; a plan compiles with `testbed check-sharding --plan P --compile "
                         "TARGET`", field="--compile")
    max_trace = parse_bytes(args.max_trace_bytes, field="--max-trace-bytes")
    plan, states_runtime = load_plan_stating_runtime(args.plan)
    topology = plan_topology(plan, args.topology, args.plan, args.devices)
    sim = simulate_file_plan(plan, topology, args.plan)
    data = _summary(sim)
    if not states_runtime and not args.no_profile_spread:  # the stack unknown: the band the named profiles give
        data["runtime_spread"] = profile_spread(plan, topology, sim.report.step_time_s).to_dict()
    written = write_outputs(sim.timeline, sim.program, topology, args.trace, args.gantt, max_trace,
                            title=f"{plan.name} on {topology.name}")
    data.update({k: getattr(args, k) for k in written})
    files = list(written.values())

    def render(console) -> None:
        m = data["memory"]
        console.print(f"[bold]{markup(plan.name)}[/bold] on [bold]{markup(topology.name)}[/bold] ({topology.num_devices} devices, "
                      f"{sim.report.tasks} tasks)")
        console.print(f"step time      {format_time(data['step_time_s'])}{_band(data.get('runtime_spread'))}")
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
