"""`testbed demo`: the default job end to end on the embedded demo plan.

For now: load plans/demo.yaml, check it against its topology and show the
placement. Later stages (simulate, run, verify, compare) extend this command.
"""

from __future__ import annotations

import argparse

from testbed.cli_basic import placement_report, plan_topology, render_placement
from testbed.output import CommandResult
from testbed.placement import place
from testbed.plan_io import load_plan

__all__ = ["add_arguments", "execute"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", default="demo", help="plan to demo (default: the bundled demo plan)")
    parser.add_argument("--out", default="testbed-out", help="folder for traces and pictures")


def execute(args: argparse.Namespace) -> CommandResult:
    plan = load_plan(args.plan)
    topology = plan_topology(plan, None)
    placement = place(plan, topology)
    report = placement_report(plan, topology, placement)
    data = {"plan": plan.name, "topology": topology.name, "devices": topology.num_devices, "placement": report}

    def render(console) -> None:
        console.rule(f"testbed demo: plan `{plan.name}` on `{topology.name}`")
        console.print(f"mesh {dict((a.value, plan.mesh.degree(a)) for a in plan.mesh.order)}, "
                      f"schedule {plan.schedule.name.value}, {plan.batch.microbatches} microbatches")
        render_placement(console, report)

    return CommandResult(data, render)
