"""``testbed calibrate``: fit a topology to this machine (checked by ``testbed validate``, testbed.cli.validate).

Run the microbenchmarks of :mod:`testbed.runner.measure` on the chosen
devices, fit the calibration with :func:`testbed.calibration.calibrated.fit_all`, and
write the calibrated topology YAML (plus the raw samples beside it as
``FILE.measurements.json``), both atomically.

JAX is imported only inside ``execute``, after :func:`testbed.runner.devices.prepare`
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

from testbed.calibration import fit
from testbed.calibration.measurements import measurements_path, read_measurements
from testbed.calibration.calibrated import base_topology, fit_saved, saved_base
from testbed.cli import calibrate_multi
from testbed.cli.calibration_table import render_calibration
from testbed.cli.progress import progress_bar
from testbed.errors import InputError
from testbed.output import CommandResult, write_atomic

__all__ = ["calibrate"]


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
                        help="time the training steps and the host's sharing comparisons this many times (later "
                             "rounds in reverse order) and keep each step's least disturbed median, as validate "
                             "--rounds does, and each comparison's median round (default 5)")
    parser.add_argument("--name", default=None, help="name of the calibrated topology (default BASE-calibrated)")
    parser.add_argument("--from-measurements", default=None, metavar="JSON",
                        help="refit from a saved FILE.measurements.json instead of measuring (no JAX)")
    parser.add_argument("--cluster", default=None, metavar="NAME",
                        help="calibrate gloo's host costs on emulated cluster NAME (testbed cluster up); writes the "
                             "topology the cluster is, priced with them (docs/cluster.md)")
    parser.add_argument("--max-call-s", type=float, default=2.0,
                        help="with --cluster: time sizes whose collective takes up to this long (default 2)")


def _calibrate(args: argparse.Namespace) -> CommandResult:
    from testbed.runner import devices as dev

    if not str(args.out).endswith((".yaml", ".yml")):
        raise InputError(f"expected a .yaml path for the calibrated topology, got `{args.out}`", field="--out")
    if args.rounds < 1:
        raise InputError(f"must be at least 1, got {args.rounds}", field="--rounds")
    if args.cluster is not None:
        from testbed.cli import calibrate_cluster

        return calibrate_cluster.calibrate(args)
    if calibrate_multi.wanted(args):  # --processes K: K local workers emulate K hosts
        return calibrate_multi.calibrate(args)
    if args.from_measurements:
        raw = read_measurements(args.from_measurements)
        info = {"platform": raw.get("platform", "cpu"), "devices": raw.get("devices", 8),
                "device_kind": raw.get("device_kind", "")}
        base = saved_base(raw, args.base)
        elapsed, mpath = float(raw.get("seconds", 0.0)), Path(args.from_measurements)
        request = f"... --from-measurements {mpath}"
    else:
        request = dev.parse_devices(args.devices, 8)
        dev.prepare(request)
        from testbed.runner import measure

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
               "cache_bytes": dev.host_cache_bytes(info["platform"]), "samples": fit.samples_to_rows(samples)}
        mpath = measurements_path(args.out)
        write_atomic(mpath, json.dumps(raw, indent=1), field_name="--out")
    topo, fitted, fits = fit_saved(raw, base, name=args.name)
    from testbed.topology.io import dump_topology

    header = (f"# Fitted by `testbed calibrate --devices {request}` from {info['devices']} {info['platform']} "
              f"device(s) ({info.get('device_kind', '')}), base {base.name}.\n")
    write_atomic(args.out, header + dump_topology(topo), field_name="--out")
    data = {"topology": str(args.out), "name": topo.name, "measurements": str(mpath), "platform": info["platform"],
            "devices": info["devices"], "base": base.name, "seconds": elapsed, "fitted": fitted,
            "fits": {f.name: f.summary() for f in fits}}
    return CommandResult(data=data, render=lambda console: render_calibration(console, data), files=[str(args.out), str(mpath)])


calibrate = SimpleNamespace(add_arguments=_calibrate_arguments, execute=_calibrate)
