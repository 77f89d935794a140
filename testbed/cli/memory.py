"""`testbed memory --plan P [--topology T] [--fail-if-oom]`: per-device memory of a plan.

Prints the worst device's breakdown (parameters, gradients, optimizer state,
activations, workspace, total, capacity, fits) and one row per pipeline
stage; under XLA:TPU's rules the total also holds twice the heap's
fragmentation (``fragmentation``; ``live_peak`` the total without it). Exit status 1 with ``--fail-if-oom`` when the plan does not fit.
"""

from __future__ import annotations

import argparse

from testbed.cli.basic import add_devices_argument, plan_topology
from testbed.errors import InputError
from testbed.model.memory import memory_breakdown
from testbed.output import CommandResult
from testbed.plan.io import load_plan
from testbed.model.leaves import padded_params, runner_whole_params
from testbed.text import markup
from testbed.units import format_bytes

__all__ = ["add_arguments", "execute"]

_PARTS = ("params", "grads", "optimizer", "activations", "workspace", "total")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", required=True, help="plan YAML file (or a bundled plan name, e.g. demo)")
    parser.add_argument("--topology", help="bundled name or YAML path, NAME@DEVICES resizes it (default: the plan's `topology:`)")
    add_devices_argument(parser)
    parser.add_argument("--fail-if-oom", action="store_true", help="exit 1 when the plan does not fit in memory")


def _explained(plan, breakdown) -> list[str]:
    """Lines naming the worst stage's workspace terms and why a part may look surprising."""
    lines = []
    if breakdown.workspace_parts:
        parts = ", ".join(f"{name} {format_bytes(size)}" for name, size in breakdown.workspace_parts)
        lines.append(f"work (stage {breakdown.worst_stage}) = {parts}")
    if breakdown.grads == 0 and breakdown.activations > 0:
        from testbed.model.memory import DEFERRED

        if any(name == DEFERRED for name, _ in breakdown.workspace_parts):
            lines.append("grads 0 B: the peak is inside the layers' backward, before any weight gradient exists: "
                         "XLA computes them after the layers' backward, from the operands counted in work; the "
                         "gradients peak later, beside no activations")
        else:
            lines.append("grads 0 B: the peak is where the backward starts, before any gradient is written; one "
                         "microbatch keeps no accumulator, and gradients grow as activations are freed")
    if breakdown.rematerialised_loss:
        lines.append("the loss's fp32 buffers are rematerialised: without that the program would not fit, as "
                     "XLA compiles against the device's limit (so memory can fall as the sequence grows)")
    if breakdown.fragmentation:
        lines.append(f"total = live peak {format_bytes(breakdown.live_peak)} + 2 x heap fragmentation "
                     f"{format_bytes(breakdown.fragmentation)}: XLA:TPU's step places its temporaries in one heap, "
                     "whose gaps libtpu reports in temp beside the heap (testbed.model.step_heap)")
    if breakdown.delayed_gathers:
        lines.append("no block's gather starts ahead at the peak: with the prefetch the program would not fit, "
                     "as XLA schedules against the device's limit")
    return lines


def execute(args: argparse.Namespace) -> CommandResult:
    plan = load_plan(args.plan)
    try:
        topology = plan_topology(plan, args.topology, args.plan, args.devices)
        breakdown = memory_breakdown(plan, topology)
    except InputError as exc:
        raise exc.with_file(args.plan) from None
    data = {**breakdown.as_dict(), "live_peak": breakdown.live_peak, "plan": plan.name, "topology": topology.name, "device": topology.device.name,
            "mesh_devices": plan.mesh.size, "topology_devices": topology.num_devices,
            "precision": plan.precision.value, "remat": plan.remat.value, "zero": plan.zero,
            "schedule": plan.schedule.name.value,
            # Parameters no free dim of which the shard count divides: sharded flattened and padded (counted so
            # here); the JAX runner still holds the listed kinds of their state whole (runner_whole).
            "padded": {w: list(padded_params(plan, w)) for w in ("params", "grads", "optimizer")
                       if padded_params(plan, w)},
            "runner_whole": {w: list(names) for w, names in runner_whole_params(plan).items()}}
    exit_code = 1 if args.fail_if_oom and not breakdown.fits else 0

    def render(console) -> None:
        from testbed.cli.tables import Col, fitted_table

        console.print(f"plan `{markup(plan.name)}` on `{markup(topology.name)}` ({markup(topology.device.name)}, "
                      f"{format_bytes(breakdown.capacity)} per device): {breakdown.params_count:,} parameters, "
                      f"{plan.precision.value}, remat {plan.remat.value}, ZeRO {plan.zero}, {plan.schedule.name.value}")
        if plan.mesh.size != topology.num_devices:
            console.print(f"[yellow]note[/yellow]: the mesh uses {plan.mesh.size} devices, the topology has "
                          f"{topology.num_devices}; only the device type is used here")
        columns = [Col(header="stage", key=True, justify="left"), Col(header="mb"),
                   *(Col(header=h) for h in ("params", "grads", "optim", "acts", "work", "total"))]
        cells = [[str(s.stage), str(s.inflight), *(format_bytes(getattr(s, p)) for p in _PARTS)]
                 for s in breakdown.per_stage]
        console.print(fitted_table(console, columns, cells,
                                   title=f"bytes per device (worst: stage {breakdown.worst_stage})"))
        console.print("params, grads, optim(izer state), acts (activations kept for the backward), work "
                      "(buffers of one phase) at the device's peak instant; mb: (microbatch, chunk) activation sets "
                      "held at peak, from the schedule")
        for line in _explained(plan, breakdown):
            console.print(line)
        if data["padded"]:
            kinds = ", ".join(f"{w} of {len(names)}" for w, names in data["padded"].items())
            console.print(f"padded: {kinds} parameters sharded flattened and padded (no dim divides the shard count; "
                          "ceil(elements / ways) per device, the padding counted)")
        if data["runner_whole"]:
            kinds = ", ".join(f"{w} of {', '.join(names)}" for w, names in data["runner_whole"].items())
            console.print(f"[yellow]note[/yellow]: the JAX runner still holds these whole: {kinds}")
        verdict = "[green]fits[/green]" if breakdown.fits else "[red]does not fit[/red]"
        console.print(f"{verdict}: {format_bytes(breakdown.total)} of {format_bytes(breakdown.capacity)} "
                      f"({100 * breakdown.total / breakdown.capacity:.1f}%)")

    return CommandResult(data, render, exit_code)
