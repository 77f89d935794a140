"""`testbed check-sharding --plan P [--topology T]`: a big plan's shardings and collectives, without its devices.

Checks the plan against the topology (mesh size, placement), then lowers the
runner's training step for the plan's full mesh on abstract devices
(:mod:`testbed.runner.check_sharding`): every parameter's PartitionSpec and
per-device shard, and the collectives per mesh axis that Shardy's
partitioning of the lowered programs inserts, with counts and bytes per
device per step. Nothing is compiled or allocated, so a 4096-device plan is
checked on a laptop. Exit 0 when the step lowers, 1 on a sharding error
(JAX's message, no traceback), 2 on bad input.

JAX starts here on the host CPU with one device, whatever the plan's size:
the lowering needs no real device.

``--compile tpu:FAMILY:DIMS`` (e.g. ``tpu:v5e:4x4``) compiles instead: XLA:TPU
compiles the runner's step for that slice without its chips (libtpu's
deviceless topology, :mod:`testbed.runner.tpu_compile`) and reports XLA's
memory per device, the compiled collectives per mesh axis with their async
pairs, fusions and FLOPs (:mod:`testbed.cli.compile_report`). Needs libtpu.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from testbed.cli.basic import add_devices_argument, plan_topology
from testbed.errors import InputError
from testbed.output import CommandResult
from testbed.plan.io import load_plan
from testbed.plan.placement import place
from testbed.text import markup
from testbed.units import format_bytes

__all__ = ["add_arguments", "execute", "param_rows"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", required=True, help="plan YAML file (or a bundled plan name, e.g. demo)")
    parser.add_argument("--topology", help="bundled name or YAML path, NAME@DEVICES resizes it (default: the plan's `topology:`)")
    add_devices_argument(parser)
    parser.add_argument("--compile", metavar="TARGET",
                        help="compile with XLA:TPU for a slice, e.g. tpu:v5e:4x4, tpu:v5p:2x2x2 (needs libtpu)")


def _host_only() -> None:
    """Start JAX on one host CPU device unless it already runs (the lowering uses abstract devices only)."""
    if "jax" in sys.modules:
        return
    from testbed.runner import devices

    devices.prepare(devices.DeviceRequest(kind="emulated", count=1))


def _spec_text(spec: list[Any]) -> str:
    def entry(e: Any) -> str:
        if e is None:
            return "None"
        return f"({', '.join(e)})" if isinstance(e, list) else str(e)
    return f"P({', '.join(entry(e) for e in spec)})"


def param_rows(params: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Parameters with identical shape and specs merged across layers and stages (``layers.*``), with a count."""
    rows: dict[tuple, dict[str, Any]] = {}
    for p in params:
        key_path = re.sub(r"^stage\d+\.chunk\d+\.", "", p["path"])
        key_path = re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.*.", key_path)
        key = (key_path, tuple(p["shape"]), _spec_text(p["spec"]), tuple(p["shard_shape"]))
        row = rows.setdefault(key, {"path": key_path, "shape": p["shape"], "spec": _spec_text(p["spec"]),
                                    "shard_shape": p["shard_shape"], "count": 0})
        row["count"] += 1
    return list(rows.values())


#: Programs one check lowers at most, and stage x virtual-chunk parameter sets it shards at most: each lowering
#: takes about a second on a CPU, so beyond these a check runs for minutes (refused before JAX starts).
MAX_LOWERED, MAX_STAGE_CHUNKS = 120, 4096


def _check_work(plan) -> None:
    """Refuse a plan whose check would lower more than MAX_LOWERED programs or shard MAX_STAGE_CHUNKS chunks."""
    if plan.mesh.stage == 1:
        return
    virtual = plan.schedule.virtual_stages
    per_chunk = 3 if plan.schedule.name.value.startswith("zb") else 2  # F, B (and W)
    lowered = min(plan.mesh.stage, 3) * (virtual * per_chunk + 1)  # first, one middle, last stage (+ update)
    chunks = plan.mesh.stage * virtual
    if lowered > MAX_LOWERED or chunks > MAX_STAGE_CHUNKS:
        raise InputError(f"checking this plan lowers {lowered:,} programs over {chunks:,} stage chunks (at most "
                         f"{MAX_LOWERED} and {MAX_STAGE_CHUNKS:,}: about a second each on a CPU); check a plan with "
                         f"fewer virtual stages or pipeline stages", field="schedule.virtual_stages")


def execute(args: argparse.Namespace) -> CommandResult:
    if getattr(args, "compile", None):
        from testbed.cli.compile_report import execute_compile

        return execute_compile(args)
    plan = load_plan(args.plan)
    try:
        topology = plan_topology(plan, args.topology, args.plan, args.devices)
        place(plan, topology)
        _check_work(plan)
    except InputError as exc:
        raise exc.with_file(args.plan) from None
    _host_only()
    from testbed.runner.check_sharding import check_sharding

    from testbed.cli.progress import progress_bar

    try:
        with progress_bar("checking", heartbeat=True) as bar:  # lowering takes about a second a program
            task = bar.add_task(f"{plan.name}: lowering its programs on abstract devices", total=1)
            result = check_sharding(plan)
            bar.update(task, completed=1)
    except InputError as exc:
        raise exc.with_file(args.plan) from None
    data = {**result.to_dict(), "topology": topology.name}

    def render(console) -> None:
        from testbed.cli.tables import Col, compact, fitted_table

        mesh = " x ".join(f"{k} {v}" for k, v in result.mesh.items() if v > 1) or "1 device"
        console.print(f"plan `{markup(plan.name)}` on `{markup(topology.name)}`: {result.devices} abstract devices "
                      f"({mesh}); {len(result.programs)} program(s) lowered for {result.platform} in "
                      f"{result.seconds['total']:.1f} s")
        if data["params"]:
            # The parameter's path identifies the row (whole); its global shape goes first at narrow widths.
            columns = [Col(header="parameter", key=True, justify="left"), Col(header="shape", drop=1, justify="left"),
                       Col(header="spec", justify="left"), Col(header="shard per device", justify="left"),
                       Col(header="x")]
            cells = [[row["path"], str(tuple(row["shape"])), row["spec"], str(tuple(row["shard_shape"])),
                      str(row["count"])] for row in param_rows(data["params"])]
            console.print(fitted_table(console, columns, cells, title="parameters (layers.*: every layer alike)",
                                       **compact()))
        if result.programs:
            columns = [Col(header="stages", key=True, justify="left"), Col(header="axes", key=True, justify="left"),
                       Col(header="kind", key=True, justify="left"), Col(header="group"), Col(header="count"),
                       Col(header="bytes")]
            cells = [[row["stages"], row["axes"], row["kind"], str(row["group"]), str(row["count"]),
                      format_bytes(row["bytes"])] for row in data["per_axis"]]
            console.print(fitted_table(console, columns, cells, title="collectives per mesh axis, per device per step",
                                       **compact()))
            console.print("lowered: " + ", ".join(f"{markup(g.name)} (x{g.runs})" for g in result.programs))
            console.print("collectives: Shardy's partitioning of the lowered programs; XLA's compiler may merge "
                          "the per-leaf reductions and pick other forms (docs/testing.md)")
        for warning in result.warnings:
            console.print(f"[yellow]warning[/yellow]: {markup(warning, 600)}")
        if result.error:
            console.print("[red]sharding error[/red]:")
            console.print(result.error, markup=False, highlight=False)

    return CommandResult(data, render, exit_code=0 if result.ok else 1)
