"""``testbed validate``: the simulator's predicted step time and memory against the runner's.

For each plan, the simulator's step time and memory on the (calibrated)
topology beside the runner's measured median step time (``--rounds``: the
least disturbed round's) and XLA's compiled memory, plus the controller's
CPU time per step both ways, and calibrate's own data-parallel step timed
again (the reference step: has the host drifted since it was calibrated?).
The measuring is :func:`testbed.runner.validate.measure_plans`; each plan's
prediction and measurement are Reports compared field by field
(:func:`testbed.calibration.validation.compare_reports`).

JSON: the headline (``plans`` with ``error``, ``memory_error``, ``errors``
per Report field, ``predicted_report``, ``measured_report``;
``median_abs_error``, ``max_abs_error``, ``*_abs_memory_error``) at the top;
the host-drift figures (``reference_step``,
``*_abs_error_at_calibrated_speed``; per plan ``host_speeds``,
``measured_at_calibrated_speed_s``, ``error_at_calibrated_speed``) under
``diagnostics``, and rendered last, as diagnostics.

JAX is imported only inside ``execute``, after :func:`testbed.runner.devices.prepare`
set the device count.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

from testbed.calibration.validation import validation_summary
from testbed.cli.progress import progress_bar
from testbed.errors import InputError
from testbed.output import CommandResult
from testbed.plan.io import load_plan
from testbed.plan.spec import check_plan
from testbed.text import markup, shown
from testbed.topology.io import load_topology

__all__ = ["validate"]


def _validate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plans", nargs="*", metavar="PLAN", help="plan YAML files (or bundled plan names)")
    parser.add_argument("--topology", required=True, help="calibrated topology (YAML path or bundled name)")
    parser.add_argument("--devices", default=None, help="emulated:N or local (default emulated:<mesh size>)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per plan after one warm-up (default 5)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="time every plan this many times (later rounds in reverse order; each plan compiled "
                             "once) and keep each plan's least disturbed median: for shared hosts (default 5)")
    parser.add_argument("--cluster", default=None, metavar="NAME",
                        help="measure on emulated cluster NAME (testbed cluster up) against the topology "
                             "`testbed calibrate --cluster NAME` wrote (docs/cluster.md)")
    from testbed.cli.program_run import add_program_arguments

    add_program_arguments(parser, timeout=True)


def _validate(args: argparse.Namespace) -> CommandResult:
    from testbed.runner import devices as dev

    if args.steps < 1:
        raise InputError(f"must be at least 1, got {args.steps}", field="--steps")
    if args.rounds < 1:
        raise InputError(f"must be at least 1, got {args.rounds}", field="--rounds")
    if args.program:
        from testbed.cli.program_run import execute_program

        return execute_program(args, "validate")
    if not args.plans:
        raise InputError("give plan files (or bundled plan names) or --program MODULE:FUNCTION", field="plans")
    if args.cluster is not None:
        from testbed.cli.validate_cluster import validate_on_cluster

        return validate_on_cluster(args)
    topology = load_topology(args.topology)
    plans = [load_plan(p) for p in args.plans]
    for path, plan in zip(args.plans, plans):
        try:
            check_plan(plan, topology.num_devices, where=f"topology {topology.name}")
        except InputError as exc:
            raise exc.with_file(path) from None
    request = dev.parse_devices(args.devices, topology.num_devices)
    dev.prepare(request)
    from testbed.runner import validate as runner

    devices = dev.select_devices(topology.num_devices)
    with progress_bar() as bar:
        task = bar.add_task("", total=len(plans) * args.rounds)

        def show(description: str, done: int) -> None:
            bar.update(task, description=markup(description), completed=done)

        rows, reference = runner.measure_plans(topology, plans, args.plans, devices, steps=args.steps,
                                               rounds=args.rounds, progress=show)
    summary = validation_summary(rows)
    summary["diagnostics"] = {"reference_step": reference, **summary["diagnostics"]}
    data = {"topology": topology.name, "devices": dev.describe(devices), "steps": args.steps, "rounds": args.rounds,
            **summary}
    return CommandResult(data=data, render=lambda console: render_validation(console, data))


def render_validation(console: Any, data: dict[str, Any]) -> None:
    """Headline: predicted vs measured per plan and the median / max errors; then the host-drift diagnostics."""
    from testbed.cli.tables import Col, fitted_table
    from testbed.units import format_bytes, format_time

    rounds = data.get("rounds", 1)
    title = (f"predicted vs measured on {markup(data['topology'])} ({data['devices']['devices']} "
             f"{data['devices']['platform']} devices, median of {data['steps']} steps"
             + (f", least of {rounds} rounds)" if rounds > 1 else ")"))
    columns = [Col(header="plan", key=True, justify="left"), Col(header="predicted"), Col(header="measured"),
               Col(header="error"), Col(header="pred. mem", drop=3), Col(header="XLA mem", drop=2),
               Col(header="mem. error", drop=1)]
    cells = []
    for p in data["plans"]:
        mem = p["measured_memory"]
        cells.append([shown(p["plan"]), format_time(p["predicted_s"]), format_time(p["measured_s"]),
                      "-" if p["error"] is None else f"{p['error']:+.1%}",
                      format_bytes(p["predicted_memory"]), format_bytes(mem) if mem is not None else "-",
                      f"{p['memory_error']:+.1%}" if p["memory_error"] is not None else "-"])
    console.print(fitted_table(console, columns, cells, title=title))
    console.print(f"step time |error|: median {data['median_abs_error']:.1%}, max {data['max_abs_error']:.1%}")
    if data.get("median_abs_memory_error") is not None:
        console.print(f"memory |error|: median {data['median_abs_memory_error']:.1%}, "
                      f"max {data['max_abs_memory_error']:.1%}")
    diagnostics = data.get("diagnostics") or {}
    ref = diagnostics.get("reference_step")
    if not ref and diagnostics.get("median_abs_error_at_calibrated_speed") is None:
        return
    console.rule("diagnostics: host drift (not the model's accuracy)")
    if ref:
        console.print(f"reference step ({markup(ref['plan'])} over all devices, as calibrated): predicted "
                      f"{format_time(ref['predicted_s'])}, measured {format_time(ref['measured_s'])} (least "
                      f"disturbed of {len(ref['measured_rounds_s'])}): the host runs at {ref['speed']:.2f}x its "
                      f"calibrated speed")
    if diagnostics.get("median_abs_error_at_calibrated_speed") is not None:
        console.print(f"step time |error| at the calibrated host speed (each round scaled by the reference step's "
                      f"speed beside it): median {diagnostics['median_abs_error_at_calibrated_speed']:.1%}, "
                      f"max {diagnostics['max_abs_error_at_calibrated_speed']:.1%}")


validate = SimpleNamespace(add_arguments=_validate_arguments, execute=_validate)
