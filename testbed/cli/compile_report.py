"""`testbed check-sharding --plan P --compile tpu:v5e:4x4`: XLA:TPU's own compile of a plan for a slice, without it.

The target names the slice (:mod:`testbed.topology.compile_target`). Its
topology: the one named by ``--topology`` or the plan's ``topology:``, which
must hold the target's devices (same TPU family, e.g. ``TPU-v5e`` for
``tpu:v5e:...``, and as many devices), else the family's bundled device on a
torus of the target's dims. The plan is placed on it as for ``simulate``, then
:func:`testbed.runner.tpu_compile.compile_plan` compiles the runner's own
step (pipelines: every stage's programs) and the report gives XLA's memory per
device against the chip's capacity, the collectives per mesh axis per step
(kind, count, bytes, how many XLA scheduled asynchronously), fusions and
FLOPs. Exit 0 when it compiles and fits, 1 when it compiles but does not fit
or XLA refuses it (the message, no traceback), 2 on bad input or without
libtpu (one line).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from testbed.cli.basic import plan_topology
from testbed.errors import InputError
from testbed.output import CommandResult
from testbed.plan.io import load_plan
from testbed.plan.placement import place
from testbed.text import markup
from testbed.topology.compile_target import (CompileTarget, check_target_devices, libtpu_missing, parse_target,
                                             target_topology)
from testbed.units import format_bytes

__all__ = ["execute_compile", "compile_topology"]


def compile_topology(plan: Any, target: CompileTarget, topology_arg: str | None, plan_file: str | None) -> Any:
    """The topology a compile for ``target`` is checked and placed on (module doc); InputError if it disagrees."""
    if not topology_arg and not plan.topology:
        return target_topology(target)
    topology = plan_topology(plan, topology_arg, plan_file)
    check_target_devices(target, topology, "pass --topology with the target's devices, or a plan without "
                         "`topology:` (the target's own topology is used)")
    return topology


def execute_compile(args: argparse.Namespace) -> CommandResult:
    target = parse_target(args.compile)
    plan = load_plan(args.plan)
    try:
        topology = compile_topology(plan, target, args.topology, args.plan)
        place(plan, topology)
    except InputError as exc:
        raise exc.with_file(args.plan) from None
    missing = libtpu_missing()
    if missing:
        raise InputError(missing, field="--compile")
    if "jax" not in sys.modules:  # JAX on one host CPU device: the slice's devices are libtpu's, deviceless
        from testbed.runner import devices

        devices.prepare(devices.DeviceRequest(kind="emulated", count=1))
    from testbed.runner.tpu_compile import compile_plan, versions

    error = None
    try:
        report = compile_plan(plan, target).to_dict()
    except InputError:
        raise
    except Exception as exc:  # XLA refuses the program (e.g. it needs more memory than the chip has)
        from testbed.runner.check_sharding import _message

        report, error = None, _message(exc)
    capacity = int(topology.device.memory_bytes)
    data = {"ok": error is None, "plan": plan.name, "target": target.name, "topology": topology.name,
            "capacity": capacity, "fits": report is not None and report["memory_total"] <= capacity,
            "error": error, "versions": versions(), "report": report}
    return CommandResult(data, lambda console: _render(console, data),
                         exit_code=0 if data["ok"] and data["fits"] else 1)


def _render(console: Any, data: dict[str, Any]) -> None:
    from testbed.cli.tables import Col, compact, fitted_table

    report = data["report"]
    if report is None:
        console.print(f"plan `{markup(data['plan'])}` on {data['target']}: XLA:TPU did not compile it:")
        console.print(data["error"], markup=False, highlight=False)
        return
    verdict = "fits" if data["fits"] else "[red]does not fit[/red]"
    console.print(f"plan `{markup(data['plan'])}` compiled by XLA:TPU for {data['target']} ({report['devices']:,} "
                  f"devices, libtpu {data['versions']['libtpu']}) in {report['compile_s']:.1f} s: "
                  f"{format_bytes(report['memory_total'])} per device of {format_bytes(data['capacity'])}, {verdict}")
    columns = [Col(header="program", key=True, justify="left"), Col(header="runs"), Col(header="argument"),
               Col(header="output"), Col(header="temp"), Col(header="alias"), Col(header="code"),
               Col(header="total"), Col(header="fusions"), Col(header="GFLOP")]
    cells = [[p["name"], str(p["runs_per_step"]), *(format_bytes(p["memory"][k]) for k in
             ("argument", "output", "temp", "alias", "generated_code", "total")), str(p["fusions"]["instructions"]),
              "-" if p["flops"] is None else f"{p['flops'] / 1e9:,.1f}"] for p in report["programs"]]
    console.print(fitted_table(console, columns, cells, title="XLA's memory per device (memory_analysis)",
                               **compact()))
    for stage in report["stages"]:
        console.print(f"stage {stage['stage']}: peak {format_bytes(stage['total'])} (state "
                      f"{format_bytes(stage['state'])}, activations {format_bytes(stage['activations'])}, workspace "
                      f"{format_bytes(stage['workspace'])}; update {format_bytes(stage['update'])})")
    if report["per_axis"]:
        columns = [Col(header="axes", key=True, justify="left"), Col(header="kind", key=True, justify="left"),
                   Col(header="group"), Col(header="count"), Col(header="async"), Col(header="bytes")]
        cells = [[r["axes"], r["kind"], str(r["group"]), str(r["count"]), str(r["async"]), format_bytes(r["bytes"])]
                 for r in report["per_axis"]]
        console.print(fitted_table(console, columns, cells, title="compiled collectives per mesh axis, per device "
                                   "per step", **compact()))
    console.print("FLOPs: XLA's cost analysis per device; a while loop's body (the microbatch loop) counts once")
