"""`testbed demo`: the whole mission on the embedded demo plan, in about a minute.

1. check the plan and show its placement on its topology;
2. predict: per-device memory and a simulated step (trace + Gantt PNG);
3. run the plan on emulated devices and time it (the measured steps' trace too);
4. verify it against the single-device fp32 reference;
5. print predicted vs measured side by side: the simulator's Report against
   the run's (``source="measured"``), field by field (step time, memory,
   MFU at the topology's peak), and calibrate's step for the host's drift;
6. compare the plan across host, NVLink, PCIe, Ethernet and TPU topologies
   (data degree scaled to each), with a stacked-bar PNG.

It lives in ``testbed.runner`` because steps 3-5 execute JAX; everything it decides
comes from ``testbed``. Outputs go to ``--out`` (default ``testbed-out/``),
each written atomically. Progress goes to stderr so ``--json`` stays one
object on stdout.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from testbed.cli.basic import placement_report, plan_topology, render_placement
from testbed.errors import InputError
from testbed.output import CommandResult, output_folder, write_atomic
from testbed.plan.placement import place
from testbed.plan.io import load_plan
from testbed.sim.graph.trace_args import span_args
from testbed.text import markup, shown
from testbed.topology.io import load_topology
from testbed.units import format_bytes, format_time

__all__ = ["add_arguments", "execute", "COMPARE_TOPOLOGIES"]

#: Host, NVLink, PCIe, Ethernet and TPU ICI: the comparison of step 6.
COMPARE_TOPOLOGIES = ("host-cpu-8", "dgx-h100", "a100-pcie-8", "eth-100g-8", "tpu-v5e-4x4")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", default="demo", help="plan to demo (default: the bundled demo plan)")
    parser.add_argument("--topology", default=None,
                        help="topology to predict on, e.g. a file from `testbed calibrate` (default: the plan's)")
    parser.add_argument("--out", default="testbed-out", help="folder for the trace and pictures (default testbed-out)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of the run (default 5)")
    parser.add_argument("--no-run", action="store_true", help="only check, predict and compare (no JAX)")


def _stage(console: Any, text: str) -> float:
    if console is not None:
        console.print(f"[bold cyan]>[/bold cyan] {text}")
    return time.perf_counter()


def execute(args: argparse.Namespace) -> CommandResult:
    from rich.console import Console

    from testbed.calibration.validation import compare_reports
    from testbed.cli.compare import compare_rows, draw_breakdown
    from testbed.model.memory import memory_breakdown
    from testbed.sim.graph.engine import simulate
    from testbed.sim.report.trace_files import write_gantt, write_trace

    if args.steps < 1:
        raise InputError(f"must be at least 1, got {args.steps}", field="--steps")
    console = None if args.json else Console(stderr=True)
    started = time.perf_counter()
    out = output_folder(args.out, "--out")
    plan = load_plan(args.plan)
    topology = plan_topology(plan, args.topology, args.plan)
    files: list[str] = []

    _stage(console, f"1/6 check plan `{markup(plan.name)}` against `{markup(topology.name)}`")
    placement = place(plan, topology)
    report = placement_report(plan, topology, placement)

    _stage(console, "2/6 predict memory and one training step (simulator)")
    memory = memory_breakdown(plan, topology)
    sim = simulate(plan, topology)
    files.append(str(write_trace(sim.timeline, out / "demo-trace.json",
                                 args=span_args(sim.program, sim.timeline, topology))))
    files.append(str(write_gantt(sim.timeline, out / "demo-gantt.png", title=f"{plan.name} on {topology.name}")))
    predicted = sim.report.to_dict()

    run, measured, verified = (None, None, None) if args.no_run else _run_and_verify(console, args, plan, topology,
                                                                                    out, files)

    _stage(console, "5/6 predicted vs measured")
    errors = compare_reports(sim.report, run.report) if run else None
    side_by_side = _side_by_side(sim.report, run, measured, errors)

    _stage(console, f"6/6 compare across {', '.join(COMPARE_TOPOLOGIES)} (data degree scaled)")
    rows = compare_rows(plan, [load_topology(t) for t in COMPARE_TOPOLOGIES], args.plan, scale="data")
    files.append(str(draw_breakdown(rows, str(out / "demo-compare.png"), title=f"{plan.name}: one step per topology")))
    from testbed.viz.plots import draw_topology

    files.append(str(draw_topology(topology, out / "demo-topology.png")))
    data = {"plan": plan.name, "topology": topology.name, "devices": topology.num_devices, "placement": report,
            "memory": memory.as_dict(), "predicted": predicted, "measured": measured, "verify": verified,
            "predicted_vs_measured": side_by_side, "report_errors": errors, "compare": rows, "files": files,
            "elapsed_s": time.perf_counter() - started}
    import json

    from testbed.output import to_jsonable

    files.append(str(write_atomic(out / "demo.json", json.dumps(to_jsonable(data), indent=1, default=str))))
    exit_code = 1 if verified is not None and not verified["ok"] else 0
    return CommandResult(data, lambda c: _render(c, data), exit_code=exit_code, files=files)


def _run_and_verify(console: Any, args: argparse.Namespace, plan: Any, topology: Any, out: Path,
                    files: list[str]) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Steps 3-4: (the run, its dict with XLA's compiled memory and calibrate's reference step, the verification's
    dict); the measured trace is appended to ``files``."""
    from testbed.runner import devices as dev
    from testbed.sim.report.trace_files import write_trace

    request = dev.parse_devices(None, plan.mesh.size)
    _stage(console, f"3/6 run {args.steps} steps on {request} (compiles first)")
    dev.prepare(request)
    devices = dev.select_devices(plan.mesh.size)
    from testbed.runner.train import run_plan, verify_plan
    from testbed.runner.validate import ReferenceStep

    # The prediction's peak FLOP/s, so predicted and measured MFU compare; XLA's memory analysis
    # compiles the run's programs once more without running them (pipelines: every stage's).
    peak = topology.device.flops(plan.precision.compute_dtype)
    run = run_plan(plan, devices, args.steps, compiled_memory=True, peak_flops=peak)
    files.append(str(write_trace(run.timeline, out / "demo-measured-trace.json")))
    measured = run.to_dict()
    measured["compiled_memory_bytes"] = run.report.memory_total
    # Calibrate's own step right after: how fast the host runs now against its calibration.
    measured["reference_step"] = ReferenceStep(topology, devices).time()
    _stage(console, "4/6 verify against the single-device fp32 reference (2 steps)")
    verified = verify_plan(plan, devices, steps=2, peak_flops=peak).to_dict()
    return run, measured, verified


def _side_by_side(predicted: Any, run: Any, measured: dict[str, Any] | None,
                  errors: dict[str, float] | None) -> dict[str, dict[str, Any]]:
    """Step 5: field by field, the simulator's Report against the run's (source "measured"), and the step as if
    the host ran at its calibrated speed: the model's error apart from the host's drift."""
    from testbed.calibration.validation import relative_error

    side_by_side: dict[str, dict[str, Any]] = {
        "step_time_s": {"predicted": predicted.step_time_s, "measured": run.report.step_time_s if run else None,
                        "error": errors["step_time_s"] if errors else None},
        "memory_bytes": {"predicted": predicted.memory_total, "measured": run.report.memory_total if run else None,
                         "error": errors["memory"] if errors else None},
        "mfu": {"predicted": predicted.mfu, "measured": run.report.mfu if run else None,
                "error": errors["mfu"] if errors else None},
    }
    if measured:
        ref = measured["reference_step"]
        side_by_side["reference_step_s"] = {"predicted": ref["predicted_s"], "measured": ref["measured_s"]}
        side_by_side["step_time_at_calibrated_speed_s"] = {
            "predicted": predicted.step_time_s, "measured": run.report.step_time_s * ref["speed"]}
        for name in ("reference_step_s", "step_time_at_calibrated_speed_s"):
            row = side_by_side[name]
            row["error"] = relative_error(row["predicted"], row["measured"])
    return side_by_side


def _fmt(value: float | None, kind: str) -> str:
    if value is None:
        return "-"
    return {"time": format_time, "bytes": format_bytes}.get(kind, lambda v: f"{v:.1%}")(value)


def _render(console: Any, data: dict[str, Any]) -> None:
    """Readable at 80 columns (rich's width when piped): short headers, numbers never wrapped."""
    from rich.table import Table

    from testbed.cli.tables import Col, fitted_table

    console.rule(f"testbed demo: plan `{markup(data['plan'])}` on `{markup(data['topology'])}`")
    render_placement(console, data["placement"])
    p = data["predicted"]
    console.print(f"predicted step {format_time(p['step_time_s'])}, MFU {p['mfu']:.1%}\n  compute "
                  f"{format_time(p['compute_s'])}, exposed comm {format_time(p['exposed_comm_s'])}, "
                  f"bubble {p['bubble_fraction']:.1%}")
    if data["measured"]:
        m = data["measured"]
        console.print(f"ran {m['steps']} steps on {m['devices']} {m['platform']} devices: median "
                      f"{format_time(m['median_step_time_s'])}, loss {m['loss']:.5f} (compile {m['compile_time_s']:.1f} s)")
    v = data["verify"]
    if v:
        verdict = "[green]ok[/green]" if v["ok"] else "[red]NOT ok[/red]"
        e, t = v["errors"], v["thresholds"]
        console.print(f"verify {verdict} vs the single-device reference: loss {max(e['loss_rel']):.1e} "
                      f"(threshold {t['loss']:.2g}), gradients {max(e['grad_rel']):.1e} (threshold {t['grads']:.2g}), "
                      f"parameters {e['param_steps']:.1e} optimizer steps apart; collectives found "
                      f"{ {k: n for k, n in v['collectives']['found'].items() if n} }")
    table = Table(title="predicted vs measured (per device)")
    for col in ("quantity", "predicted", "measured", "error"):
        table.add_column(col, justify="right" if col != "quantity" else "left", no_wrap=col != "quantity")
    rows = data["predicted_vs_measured"]
    ref = (data["measured"] or {}).get("reference_step")
    labels = {"step_time_s": ("step time", "time"), "memory_bytes": ("memory", "bytes"), "mfu": ("MFU", "ratio"),
              "reference_step_s": (f"calibrate's step {shown(ref['plan'])}" if ref else "", "time"),
              "step_time_at_calibrated_speed_s": ("step time at calibrated speed", "time")}
    for name, (label, kind) in labels.items():
        if name in rows:
            row = rows[name]
            table.add_row(label, _fmt(row["predicted"], kind), _fmt(row["measured"], kind),
                          "-" if row["error"] is None else f"{row['error']:+.0%}")
    console.print(table)
    if ref:
        console.print(f"the host ran at {ref['speed']:.2f}x the speed it was calibrated at (calibrate's data-parallel "
                      f"step {markup(ref['plan'])}, timed after the plan); the last row scales the measured step by it")
    columns = [Col(header="topology", key=True, justify="left"), Col(header="dev"), Col(header="data", drop=3),
               Col(header="step"), Col(header="compute", drop=2), Col(header="comm"), Col(header="bubble", drop=1),
               Col(header="MFU"), Col(header="mem")]
    cells = [[shown(r["topology"]), str(r["devices"]), str(r["data"]), format_time(r["step_time_s"]),
              format_time(r["compute_s"]), format_time(r["exposed_comm_s"]), f"{r['bubble_fraction']:.1%}",
              f"{r['mfu']:.1%}", "fits" if r["fits"] else "OOM"] for r in data["compare"]]
    console.print(fitted_table(console, columns, cells, title="the same plan on other topologies (data degree scaled)",
                               padding=(0, 1), pad_edge=False))
    console.print("comm: exposed communication; mem: fits in device memory, or OOM")
    for f in data["files"]:
        console.print(f"wrote {markup(f)}")
    console.print(f"done in {data['elapsed_s']:.0f} s")
