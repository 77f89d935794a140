"""``testbed calibrate``: fit a topology to this machine (checked by ``testbed validate``, testbed.cli.validate).

Run the microbenchmarks of :mod:`runners.measure` on the chosen
devices, fit the calibration fields with :mod:`testbed.calibration.fit`, and
write the calibrated topology YAML (plus the raw samples beside it as
``FILE.measurements.json``), both atomically.

JAX is imported only inside ``execute``, after :func:`runners.devices.prepare`
set the device count.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from testbed.calibration import fit as cal
from testbed.calibration import collectives as cal_coll
from testbed.calibration import steps as cal_steps
from testbed.errors import InputError
from testbed.output import CommandResult, write_atomic
from testbed.topology import Topology

__all__ = ["calibrate", "base_topology", "fit_all", "measurements_path", "parse_devices", "progress_bar",
           "simulator_collective_time", "JAX_TO_OP"]


def measurements_path(out: str | Path) -> Path:
    """Where the raw samples go: ``FILE`` with the suffix ``.measurements.json``."""
    return Path(out).with_suffix(".measurements.json")


def parse_devices(text: str) -> Any:
    from runners.devices import DeviceRequest
    import re

    match = re.fullmatch(r"emulated:(\d+)", text.strip())
    if match:
        return DeviceRequest(kind="emulated", count=int(match.group(1)))
    if text.strip() == "local":
        return DeviceRequest(kind="local")
    raise InputError(f"`{text}` is not a device choice; valid: emulated:N (N host devices) or local", field="--devices")


#: jax collective names (runners.measure) -> testbed.collectives.ops op names.
JAX_TO_OP = {"psum": "all_reduce", "all_gather": "all_gather", "psum_scatter": "reduce_scatter",
             "all_to_all": "all_to_all", "ppermute": "send"}


def simulator_collective_time(topology: Topology, sample: cal.Sample, reference: Topology | None = None) -> float:
    """What the simulator predicts for a measured collective: the group of ``ranks`` consecutive devices.

    A ``ppermute`` ring shift is a send between neighbours (every device sends
    and receives one message at once, on its own links).
    """
    from testbed.collectives import timing as collective_timing

    op = JAX_TO_OP.get(sample.op, sample.op)
    if op == "send":
        return float(collective_timing.send_time(topology, 0, 1, sample.bytes))
    group = tuple(range(sample.ranks))
    algorithm = "auto"
    if reference is not None:
        algorithm = collective_timing.collective_time(reference, op, group, sample.bytes).algorithm
    return float(collective_timing.collective_time(topology, op, group, sample.bytes, algorithm).time_s)


def _chip(name: str) -> str:
    """The chip of a device name: ``H100-SXM5-80GB`` -> ``h100``, ``TPU-v5e`` -> ``tpu v5e``."""
    tokens = name.lower().replace("-", " ").replace("_", " ").split()
    return " ".join(tokens[:2]) if tokens and tokens[0] == "tpu" else (tokens[0] if tokens else "")


def base_topology(base: str | None, platform: str, num_devices: int, device_kind: str = "") -> Topology:
    """The topology to calibrate: ``--base`` if given, else one matching the detected devices.

    Emulated host devices start from ``host-cpu-8``; local accelerators from
    the bundled topology whose device chip (``h100``, ``tpu v5e``) appears in
    the JAX device kind, preferring one with the same device count. When the
    count differs, the devices sit on one switch (the template's innermost
    level) and the user should pass ``--base`` for a multi-node layout.
    """
    from testbed.topology import generators
    from testbed.topology.io import bundled_names, load_topology

    if base is not None:
        topo = load_topology(base)
        if topo.num_devices != num_devices:
            raise InputError(f"the base topology has {topo.num_devices} devices but {num_devices} are measured; "
                             f"pass a --base with {num_devices} devices", field="--base")
        return topo
    kind = device_kind.lower().replace("-", " ")
    bundled = [load_topology(name) for name in bundled_names()]
    if platform == "cpu":
        matches = [t for t in bundled if t.name == "host-cpu-8"]
    else:
        matches = [t for t in bundled if _chip(t.device.name) and _chip(t.device.name) in kind]
        matches = matches or [t for t in bundled if t.name == ("dgx-h100" if platform == "gpu" else "tpu-v5e-4x4")]
    matches.sort(key=lambda t: t.num_devices != num_devices)
    template = matches[0]
    if template.num_devices == num_devices:
        return template
    level = template.levels[0]
    return generators.switch(num_devices, device=template.device, bandwidth=level.bandwidth, latency=level.latency,
                             kind=level.kind, level=level.name, name=f"{_chip(template.device.name).replace(' ', '-')}"
                             f"-{num_devices}", calibration=template.calibration)


def fit_all(base: Topology, samples: list[cal.Sample], name: str | None = None, host_cpus: int = 0,
            cache_bytes: float = 0.0) -> tuple[Topology, dict[str, Any], list[cal.Fit]]:
    """Fit every calibration field from ``samples``; (calibrated topology, fitted values, fits).

    ``host_cpus``: the cores of the host emulated devices run on (0: unknown);
    ``cache_bytes``: the largest activation whose elementwise passes run from
    the host's cache (``runners.devices.host_cache_bytes``; 0: unknown).
    """
    launch = cal.fit_dispatch(samples)
    rates, half, fits = cal.fit_compute(samples, launch)
    try:
        memory_bw, memory_fit = cal.fit_memory(samples, launch)
        fits.append(memory_fit)
    except InputError:  # noisy streams on a busy host: keep the base topology's bandwidth
        memory_bw = base.device.memory_bandwidth * base.calibration.memory_efficiency
    shared = cal.fit_host_cores(samples)
    curve = cal.fit_host_throughput(samples)
    # Devices that share a host saturate its cores once that many compute at once; steps then fit the rest.
    has_steps = any(s.kind == "step" for s in samples)
    cores = float(host_cpus) if shared and host_cpus and has_steps else shared
    collectives = None
    # Collective samples are already per collective inside a program (runners.measure loops them).
    rows = [s for s in samples if s.kind == "collective"]
    if rows:
        collectives, coll_fit = cal_coll.fit_collectives(base, rows, simulator_collective_time)
        fits.append(coll_fit)
    topo = cal.calibrated_topology(base, rates=rates, half_flops=half, memory_bandwidth=memory_bw, launch_s=launch,
                                   host_cores=cores, collectives=collectives, name=name, host_throughput=curve,
                                   cache_bytes=cache_bytes)
    buffers = cal_steps.fit_controller_buffers(samples)
    buffer_s = 0.0
    if buffers is not None:
        buffer_s, buffer_fit = buffers
        fits.append(buffer_fit)
    controller = cal_steps.fit_controller(samples, buffer_s)
    controller_step_s = controller_s = pipeline_step_s = 0.0
    if controller is not None:  # its buffer cost: real steps' when they tell it, else the empty programs'
        controller_step_s, controller_s, pipeline_step_s, buffer_s, controller_fit = controller
        fits.append(controller_fit)
    steps = cal_steps.fit_step_compute(topo, samples)
    efficiency, scales, passes = None, None, (0.0, 0.0, 0.0)
    if steps is not None:
        efficiency, half, scales, passes, step_fit = steps
        fits.append(step_fit)
    if steps is not None or controller is not None or buffer_s:
        topo = cal.calibrated_topology(base, rates=rates, half_flops=half, memory_bandwidth=memory_bw,
                                       launch_s=launch, host_cores=cores, collectives=collectives, name=name,
                                       efficiency=efficiency, peak_scales=scales, controller_s=controller_s,
                                       controller_step_s=controller_step_s, controller_buffer_s=buffer_s,
                                       controller_pipeline_step_s=pipeline_step_s, passes=passes,
                                       host_throughput=curve, cache_bytes=cache_bytes)
    c = topo.calibration
    fitted = {
        "compute_efficiency": c.compute_efficiency, "efficiency_half_flops": c.efficiency_half_flops,
        "memory_efficiency": c.memory_efficiency, "replicated_passes": c.replicated_passes,
        "split_passes": c.split_passes, "cached_passes": c.cached_passes, "cache_bytes": c.cache_bytes,
        "launch_overhead_s": c.launch_overhead_s,
        "collective_overhead_s": c.collective_overhead_s, "host_cores": c.host_cores, "shared_host_cores": shared,
        "host_throughput": {str(n): t for n, t in c.host_throughput},
        "controller_overhead_s": c.controller_overhead_s, "controller_step_s": c.controller_step_s,
        "controller_pipeline_step_s": c.controller_pipeline_step_s,
        "controller_buffer_s": c.controller_buffer_s,
        "peak_flops": dict(topo.device.peak_flops), "memory_bandwidth": topo.device.memory_bandwidth,
        "sustained_flops": rates, "sustained_memory_bandwidth": memory_bw,
        "levels": {l.name: {"bandwidth": l.bandwidth, "latency": l.latency} for l in topo.levels},
    }
    return topo, fitted, fits


def _read_measurements(path: str) -> dict[str, Any]:
    """A ``.measurements.json`` file written by calibrate (InputError naming the file if unreadable)."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputError("measurements file not found", file=path, field="--from-measurements") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"not a measurements JSON file ({exc})", file=path, field="--from-measurements") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("samples"), list):
        raise InputError("expected an object with a `samples` list (written by `testbed calibrate`)", file=path,
                         field="samples")
    return raw


def progress_bar() -> Any:
    """A rich progress bar on stderr (stdout stays clean for --json)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]measuring[/] {task.description}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)


# -- calibrate -----------------------------------------------------------------------

def _calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", default="emulated:8", help="emulated:N (N host devices) or local (default emulated:8)")
    parser.add_argument("--processes", type=int, default=1,
                        help="K local worker processes (gloo) emulating K hosts of N/K devices each; fits a "
                             "two-level topology (node inside a process, cluster between them); default 1")
    parser.add_argument("--out", required=True, help="calibrated topology YAML to write")
    parser.add_argument("--base", default=None, help="topology to calibrate (bundled name or YAML); "
                                                     "default: host-cpu-8 for emulated, detected for local")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and ops (about half the time)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="time the training steps this many times (later rounds in reverse order) and keep "
                             "each one's least disturbed median, as validate --rounds does (default 5)")
    parser.add_argument("--name", default=None, help="name of the calibrated topology (default BASE-calibrated)")
    parser.add_argument("--from-measurements", default=None, metavar="JSON",
                        help="refit from a saved FILE.measurements.json instead of measuring (no JAX)")


def _calibrate(args: argparse.Namespace) -> CommandResult:
    from runners import devices as dev

    if not str(args.out).endswith((".yaml", ".yml")):
        raise InputError(f"expected a .yaml path for the calibrated topology, got `{args.out}`", field="--out")
    if args.rounds < 1:
        raise InputError(f"must be at least 1, got {args.rounds}", field="--rounds")
    from runners import calibrate_multi

    if calibrate_multi.wanted(args):  # --processes K: K local workers emulate K hosts
        return calibrate_multi.calibrate(args)
    if args.from_measurements:
        raw = _read_measurements(args.from_measurements)
        samples = cal.samples_from_rows(raw["samples"])
        info = {"platform": raw.get("platform", "cpu"), "devices": raw.get("devices", 8),
                "device_kind": raw.get("device_kind", "")}
        from testbed.topology.io import bundled_names

        saved = raw.get("base") if raw.get("base") in bundled_names() else None
        base = base_topology(args.base or saved, info["platform"], info["devices"], info["device_kind"])
        elapsed, mpath = float(raw.get("seconds", 0.0)), Path(args.from_measurements)
        request = f"... --from-measurements {mpath}"
    else:
        request = parse_devices(args.devices)
        dev.prepare(request)
        from runners import measure

        devices = dev.select_devices(request.count)
        info = dev.describe(devices)
        base = base_topology(args.base, info["platform"], len(devices), str(info.get("device_kind", "")))
        started = time.perf_counter()
        with progress_bar() as progress:
            task = progress.add_task("")

            def show(bench: Any, done: int, total: int) -> None:
                progress.update(task, description=bench.label, completed=done, total=total)
            samples = measure.measure(devices, quick=args.quick, rounds=args.rounds, progress=show)
        elapsed = time.perf_counter() - started
        # The raw samples first: they stay useful even when a fit fails.
        raw = {"platform": info["platform"], "devices": info["devices"], "device_kind": info.get("device_kind", ""),
               "base": base.name, "seconds": elapsed, "rounds": args.rounds, "host_cpus": len(os.sched_getaffinity(0)),
               "cache_bytes": dev.host_cache_bytes(info["platform"]), "samples": cal.samples_to_rows(samples)}
        mpath = measurements_path(args.out)
        write_atomic(mpath, json.dumps(raw, indent=1), field_name="--out")
    topo, fitted, fits = fit_all(base, samples, name=args.name, host_cpus=int(raw.get("host_cpus", 0)),
                                 cache_bytes=float(raw.get("cache_bytes", 0)))
    from testbed.topology.io import dump_topology

    header = (f"# Fitted by `testbed calibrate --devices {request}` from {info['devices']} {info['platform']} "
              f"device(s) ({info.get('device_kind', '')}), base {base.name}.\n")
    write_atomic(args.out, header + dump_topology(topo), field_name="--out")
    data = {"topology": str(args.out), "name": topo.name, "measurements": str(mpath), "platform": info["platform"],
            "devices": info["devices"], "base": base.name, "seconds": elapsed, "fitted": fitted,
            "fits": {f.name: f.summary() for f in fits}}
    return CommandResult(data=data, render=lambda console: _render_calibration(console, data), files=[str(args.out), str(mpath)])


def _render_calibration(console: Any, data: dict[str, Any]) -> None:
    from rich.table import Table

    from testbed.units import format_bandwidth, format_flops, format_time

    f = data["fitted"]
    console.print(f"[bold]{data['name']}[/] from {data['devices']} {data['platform']} device(s) in "
                  f"{data['seconds']:.1f} s -> {data['topology']} (samples: {data['measurements']})")
    table = Table(title="fitted calibration")
    table.add_column("field")
    table.add_column("value", justify="right")
    for dtype, rate in f["sustained_flops"].items():
        table.add_row(f"sustained FLOP/s {dtype}", format_flops(rate))
    table.add_row("compute_efficiency", f"{f['compute_efficiency']:.3f}")
    table.add_row("efficiency_half_flops", f"{f['efficiency_half_flops']:.3g}")
    table.add_row("memory bandwidth", format_bandwidth(f["sustained_memory_bandwidth"]))
    if f.get("replicated_passes") or f.get("split_passes"):
        table.add_row("elementwise passes", f"{f['replicated_passes']:.1f} over replicated, "
                                            f"{f['split_passes']:.1f} over split activation bytes")
    if f.get("cache_bytes"):
        table.add_row("cached passes", f"{f['cached_passes']:.1f} over activations of at most "
                                       f"{f['cache_bytes'] / 1024:.0f} KiB")
    table.add_row("launch_overhead_s", format_time(f["launch_overhead_s"]))
    table.add_row("collective_overhead_s", format_time(f["collective_overhead_s"]))
    table.add_row("host_cores", f"{f['host_cores']} (devices alone vs all at once: {f['shared_host_cores']:.2f})")
    if f.get("host_throughput"):
        table.add_row("host_throughput", ", ".join(f"{n} at once: {t:.2f}" for n, t in f["host_throughput"].items()))
    if f.get("controller_overhead_s"):
        table.add_row("controller_overhead_s", f"{format_time(f['controller_overhead_s'])} per dispatched program")
        table.add_row("controller_step_s", f"{format_time(f.get('controller_step_s', 0.0))} per step")
        table.add_row("controller_pipeline_step_s",
                      f"{format_time(f.get('controller_pipeline_step_s', 0.0))} more per pipeline step")
    if f.get("controller_buffer_s"):
        table.add_row("controller_buffer_s", f"{format_time(f['controller_buffer_s'])} per device buffer dispatched")
    for name, level in f["levels"].items():
        table.add_row(f"level {name}", f"{format_bandwidth(level['bandwidth'])}, {format_time(level['latency'])}/hop")
    console.print(table)
    quality = Table(title="fit quality")
    for col in ("fit", "samples", "R^2", "median |rel. residual|", "max |rel. residual|"):
        quality.add_column(col, justify="right" if col != "fit" else "left")
    for name, q in data["fits"].items():
        quality.add_row(name, str(q["samples"]), f"{q['r2']:.4f}", f"{q['median_abs_rel_residual']:.1%}",
                        f"{q['max_abs_rel_residual']:.1%}")
    console.print(quality)


calibrate = SimpleNamespace(add_arguments=_calibrate_arguments, execute=_calibrate)
