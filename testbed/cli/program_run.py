"""`testbed run --program` and `testbed validate --program`: a user's own step measured on devices, beside its
prediction.

The ``--program`` function is called once, with a concrete mesh of the selected devices (``--devices
emulated:N|local``; ``--mesh``, default one ``data`` axis over them), in the scope of
:mod:`testbed.cli.user_code` (time limit, ``sys.path``, its prints on stderr, every error one paragraph). The
step it returns is traced as ``simulate --program`` traces it and priced on ``--topology`` (``validate``
requires one; ``run`` predicts where one is given), then compiled and timed on the devices
(:func:`testbed.runner.program.measure.measure_program`, the runner's :class:`~testbed.runner.step_timer.StepTimer`).
``validate`` also times calibrate's reference step after every round, as for plans: the host's speed, a
diagnostic of drift apart from the headline. JAX is imported after :func:`testbed.runner.devices.prepare`.

JSON: ``measured_s`` (the least disturbed round's median), ``round_medians_s``, ``compile_time_s``,
``measured_memory`` (XLA's memory analysis, whole in ``xla_memory``), ``compiled_collectives``; with a topology
``predicted_s``, ``error``, ``predicted_memory`` (the live-range estimate), ``memory_error``, ``collectives``
(per axes and kind, predicted and compiled bytes) and ``bytes_per_axis_equal``; ``diagnostics`` (validate's host
drift: the reference step, each round's host speed, the error at the calibrated speed).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from typing import Any

from testbed.cli.basic import add_program_argument, add_program_mesh_arguments
from testbed.errors import InputError
from testbed.output import CommandResult
from testbed.text import markup

__all__ = ["add_program_arguments", "execute_program"]


def add_program_arguments(parser: argparse.ArgumentParser, *, timeout: bool) -> None:
    """``--program``, ``--mesh``, ``--unknown-ops``, and ``--timeout`` where the command has none of its own."""
    add_program_argument(parser, "measure")
    add_program_mesh_arguments(parser)
    if timeout:
        parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                            help="with --program: the time limit for importing, calling and tracing it "
                                 "(default 600 s)")


def _device_count(args: argparse.Namespace, topology: Any) -> tuple[dict[str, int] | None, Any]:
    """``(mesh or None, device request)``: the mesh ``--mesh`` names (checked against the topology), the request
    ``--devices`` makes (default emulated over the mesh's, else the topology's, devices)."""
    from testbed.cli.program import parse_axes, parse_mesh
    from testbed.runner import devices as dev

    mesh = parse_mesh(args.mesh, topology) if topology is not None else (parse_axes(args.mesh) if args.mesh else None)
    count = math.prod(mesh.values()) if mesh else None
    request = dev.parse_devices(args.devices, count or 1)
    if request.kind == "emulated" and args.devices and count is not None and request.count != count:
        raise InputError(f"emulated:{request.count} does not match the mesh {mesh} of {count} devices; use "
                         f"--devices emulated:{count}", field="--devices")
    return mesh, request


def _select(args: argparse.Namespace, topology: Any) -> tuple[dict[str, int], list[Any]]:
    """The mesh and the devices it runs on (JAX started here, with ``--devices``' count)."""
    from testbed.runner import devices as dev

    mesh, request = _device_count(args, topology)
    dev.prepare(request)
    if mesh is None:
        mesh = {"data": request.count if request.kind == "emulated" else len(dev.select_devices())}
    return mesh, dev.select_devices(math.prod(mesh.values()))


def _check(args: argparse.Namespace, command: str) -> None:
    if getattr(args, "plan", None) or getattr(args, "plans", None):
        raise InputError("give plans or --program, not both", field="--program")
    for flag in ("processes", "cluster", "distributed", "trace"):
        value = getattr(args, flag, None)
        if value not in (None, False, 1):
            raise InputError(f"`{command} --program` runs in this process on its devices; leave --{flag} out",
                             field=f"--{flag}")
    if args.steps < 1:
        raise InputError(f"must be at least 1, got {args.steps}", field="--steps")
    if getattr(args, "rounds", 1) < 1:
        raise InputError(f"must be at least 1, got {args.rounds}", field="--rounds")


def execute_program(args: argparse.Namespace, command: str) -> CommandResult:
    """``run --program`` (``command="run"``: one round, a prediction where ``--topology`` is given) or
    ``validate --program`` (rounds, the reference step, ``--topology`` required)."""
    from testbed.cli.user_code import DEFAULT_TIMEOUT_S, check_timeout
    from testbed.topology.io import load_topology

    _check(args, command)
    topology = load_topology(args.topology) if args.topology else None
    timeout = check_timeout(args.timeout if getattr(args, "timeout", None) is not None else DEFAULT_TIMEOUT_S)
    mesh, devices = _select(args, topology)
    step, args_, workload, jax_mesh = _called(args.program, mesh, devices, args.unknown_ops, timeout,
                                              trace=topology is not None)
    measurement, reference = _measured(args, step, args_, jax_mesh, topology, devices, validate=command == "validate")
    data = program_data(args, mesh, devices, measurement, topology, workload, reference)
    return CommandResult(data, lambda console: render_program(console, data, command))


def _called(spec: str, mesh: dict[str, int], devices: list[Any], on_unknown: str, timeout: float, *,
            trace: bool) -> tuple[Any, Any, Any, Any]:
    """``(step, args, workload or None, the jax Mesh)``: the function called once on the devices' mesh, its step
    traced for the prediction (where there is a topology), in the user's code's scope."""
    from testbed.cli.program import call_program, local_mesh, program_folder, trace_returned
    from testbed.cli.user_code import reported, user_code

    concrete = local_mesh(mesh, devices)
    with user_code(spec, program_folder(spec), timeout), reported(spec, "running"):
        step, args = call_program(spec, concrete, mesh)
        workload = trace_returned(spec, step, args, concrete, on_unknown) if trace else None
    return step, args, workload, concrete


def _measured(args: argparse.Namespace, step: Any, step_args: Any, mesh: Any, topology: Any, devices: list[Any], *,
              validate: bool) -> tuple[Any, dict[str, Any] | None]:
    """The step timed on the devices (its prints on stderr, its errors one paragraph) and, for validate, the
    least disturbed reference step."""
    from testbed.cli.progress import phase_progress, progress_bar
    from testbed.cli.user_code import reported
    from testbed.runner.program.measure import measure_program

    rounds = args.rounds if validate else 1
    references: list[dict[str, Any]] = []
    after = None
    if validate:
        from testbed.runner.validate import ReferenceStep

        reference_step = ReferenceStep(topology, devices)

        def after() -> float:
            references.append(reference_step.time())
            return references[-1]["speed"]
    name = args.program.rpartition(":")[2]
    with progress_bar("running", heartbeat=True) as bar, contextlib.redirect_stdout(sys.stderr), \
            reported(args.program, "being run on the devices"):
        progress = phase_progress(bar, {"compile": f"{name}: compile and first step", "steps": f"{name}: rounds"})
        measurement = measure_program(step, step_args, mesh, steps=args.steps, rounds=rounds, after_round=after,
                                      progress=progress)
    reference = None
    if references:
        reference = dict(min(references, key=lambda r: r["measured_s"]),
                         measured_rounds_s=[r["measured_s"] for r in references])
    return measurement, reference


def program_data(args: argparse.Namespace, mesh: dict[str, int], devices: list[Any], m: Any, topology: Any,
                 workload: Any, reference: dict[str, Any] | None) -> dict[str, Any]:
    """The command's JSON (module docstring)."""
    from testbed.runner import devices as dev

    data: dict[str, Any] = {
        "program": args.program, "mesh": mesh, "devices": dev.describe(devices), "steps": args.steps,
        "rounds": len(m.round_medians_s), "compile_time_s": m.compile_s, "measured_s": m.measured_s,
        "round_medians_s": list(m.round_medians_s), "step_times_s": list(m.step_times_s),
        "measured_memory": None if m.memory is None else float(m.memory.total),
        "xla_memory": None if m.memory is None else m.memory.to_dict(), "compiled_collectives": m.collectives}
    if workload is not None:
        data.update(_predicted(workload, topology, m))
    if reference is not None:
        data["diagnostics"] = _diagnostics(data, m, reference)
    return data


def _predicted(workload: Any, topology: Any, m: Any) -> dict[str, Any]:
    """The prediction on ``topology`` beside the measurement: step time, memory, bytes per axis."""
    import dataclasses

    from testbed.calibration.validation import collective_rows, relative_error
    from testbed.sim.graph.traced import device_collectives, device_memory, simulate_workload

    if m.transposes is not None:  # the compiled step's transposing kernels (docs/program.md)
        workload = dataclasses.replace(workload, transposes=m.transposes)
    report = simulate_workload(workload, topology).report
    estimate = float(device_memory(workload, topology)["total"])
    moved = device_collectives(workload, topology).collective_bytes()  # as the topology's compiler moves them
    rows = collective_rows(moved, m.collectives)
    measured_memory = None if m.memory is None else float(m.memory.total)
    return {"topology": topology.name, "predicted_s": report.step_time_s,
            "error": relative_error(report.step_time_s, m.measured_s),
            "predicted_memory": estimate, "predicted_memory_method": workload.memory.get("method"),
            "memory_error": None if measured_memory is None else relative_error(estimate, measured_memory),
            "collectives": rows, "bytes_per_axis_equal": all(r["equal"] for r in rows),
            "predicted_collectives": moved, "dtype": workload.dtype,
            "assumptions": list(workload.assumptions)}


def _diagnostics(data: dict[str, Any], m: Any, reference: dict[str, Any]) -> dict[str, Any]:
    """Host drift, as validate reports it for plans: not the model's accuracy."""
    from testbed.calibration.validation import relative_error

    at_calibrated = m.measured_at_calibrated_speed_s
    out = {"reference_step": reference, "host_speeds": list(m.host_speeds),
           "measured_at_calibrated_speed_s": at_calibrated}
    if "predicted_s" in data and at_calibrated:
        out["error_at_calibrated_speed"] = relative_error(data["predicted_s"], at_calibrated)
    return out


def render_program(console: Any, data: dict[str, Any], command: str) -> None:
    """Predicted vs measured (as validate shows plans), the bytes per axis, then the host-drift diagnostics."""
    from testbed.cli.tables import Col, fitted_table
    from testbed.units import format_bytes, format_time

    d = data["devices"]
    where = f" on {markup(data['topology'])}" if "topology" in data else ""
    rounds = f", least of {data['rounds']} rounds" if data["rounds"] > 1 else ""
    title = (f"testbed {command}: {markup(data['program'])}{where} ({d['devices']} {d['platform']} devices, mesh "
             f"{', '.join(f'{k}={v}' for k, v in data['mesh'].items())}; median of {data['steps']} steps{rounds})")
    mem = data["measured_memory"]
    predicted = "predicted_s" in data
    columns = [Col(header="", key=True, justify="left"), Col(header="predicted"), Col(header="measured"),
               Col(header="error")]
    cells = [["step time", format_time(data["predicted_s"]) if predicted else "-", format_time(data["measured_s"]),
              f"{data['error']:+.1%}" if predicted else "-"],
             ["memory per device", format_bytes(data["predicted_memory"]) + " (estimate)" if predicted else "-",
              (format_bytes(mem) + " (XLA)") if mem is not None else "-",
              f"{data['memory_error']:+.1%}" if predicted and data["memory_error"] is not None else "-"]]
    console.print(fitted_table(console, columns, cells, title=title))
    console.print(f"compile + first step {data['compile_time_s']:.2f} s; memory: the estimate is the live-range "
                  "estimate over the traced program, XLA's is its memory analysis of the compiled step")
    _render_collectives(console, data)
    diagnostics = data.get("diagnostics")
    if diagnostics:
        ref = diagnostics["reference_step"]
        console.rule("diagnostics: host drift (not the model's accuracy)")
        console.print(f"reference step ({markup(ref['plan'])}): predicted {format_time(ref['predicted_s'])}, "
                      f"measured {format_time(ref['measured_s'])}: the host runs at {ref['speed']:.2f}x its "
                      "calibrated speed")
        if diagnostics.get("error_at_calibrated_speed") is not None:
            console.print(f"step time error at the calibrated host speed: "
                          f"{diagnostics['error_at_calibrated_speed']:+.1%}")


def _render_collectives(console: Any, data: dict[str, Any]) -> None:
    """Bytes per device per step over each mesh axis: predicted beside the compiled program's."""
    from testbed.units import format_bytes

    if "collectives" in data:
        for r in data["collectives"]:
            mark = "" if r["equal"] else "  [yellow]differs[/yellow]"
            console.print(f"  over {markup(r['axes'])}: {r['kind']} predicted {format_bytes(r['predicted_bytes'])}, "
                          f"compiled {format_bytes(r['compiled_bytes'])} per device{mark}")
        verdict = "equal" if data["bytes_per_axis_equal"] else "[yellow]not equal[/yellow]"
        console.print(f"bytes per axis, predicted vs the compiled program: {verdict}")
        return
    for axes, kinds in data["compiled_collectives"].items():
        moved = ", ".join(f"{k} {format_bytes(v)}" for k, v in kinds.items())
        console.print(f"  over {markup(axes)}: {moved} per device (compiled)")
