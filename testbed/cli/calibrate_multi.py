"""``testbed calibrate --processes K``: K local worker processes emulate K hosts (:mod:`testbed.runner.calibrate_multi`).

The workers measure (:func:`testbed.runner.calibrate_multi.worker_body`); this
command checks the arguments, builds the two-level base topology
(:func:`testbed.calibration.calibrated.cluster_topology`), launches them,
fits worker 0's samples and writes the topology like the single-process path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from testbed.calibration.measurements import measurements_path, read_measurements, recorded_processes
from testbed.calibration.calibrated import base_topology, cluster_topology, fit_saved
from testbed.cli.calibration_table import render_calibration
from testbed.errors import InputError
from testbed.output import CommandResult, write_atomic
from testbed.text import markup
from testbed.topology import Form, Topology

__all__ = ["wanted", "calibrate"]


def wanted(args: argparse.Namespace) -> bool:
    """Whether ``testbed calibrate`` takes the multi-process path: ``--processes`` other than 1, or a refit of
    measurements taken by several processes."""
    return args.processes != 1 or recorded_processes(args.from_measurements) > 1


def _base(base_arg: str | None, platform: str, devices: int, processes: int, device_kind: str) -> Topology:
    """The two-level topology to calibrate: ``--base`` when given (checked), else built from the detected devices."""
    local = devices // processes
    if base_arg is None:
        return cluster_topology(base_topology(None, platform, devices, device_kind), processes)
    topo = base_topology(base_arg, platform, devices, device_kind)
    if topo.form is not Form.LEVELS or len(topo.levels) < 2 or topo.levels[0].size != local:
        raise InputError(f"with --processes {processes} the base topology needs levels whose innermost one holds "
                         f"the {local} devices of one process (and an outer level joining the processes); "
                         f"`{topo.name}` has {[(l.name, l.size) for l in topo.levels]}. Leave --base out to build "
                         f"one", field="--base")
    return topo


def _check(args: argparse.Namespace) -> Any:
    """The parsed ``--devices`` request for a measured run (InputError naming the bad field)."""
    from testbed.runner.devices import parse_devices

    if args.processes < 1:
        raise InputError(f"must be at least 1, got {args.processes}", field="--processes")
    request = parse_devices(args.devices, 8)
    if request.kind != "emulated":
        raise InputError("--processes K starts K local CPU workers emulating K hosts and needs --devices emulated:N; "
                         "to calibrate real hosts run one process per host (--processes 1 on each host)",
                         field="--processes")
    if request.count % args.processes:
        raise InputError(f"emulated:{request.count} devices cannot be split evenly over {args.processes} processes; "
                         f"pick N divisible by K", field="--processes")
    return request


# -- the command -----------------------------------------------------------------------------

def _measure(args: argparse.Namespace) -> tuple[dict[str, Any], str, Topology]:
    """Launch the workers; (raw measurements as written to the JSON file, the devices asked for, the base)."""
    from testbed.runner import launch
    from testbed.runner.devices import host_cache_bytes

    request = _check(args)
    # Emulated devices are host CPUs: the base is known (and --base checked) before minutes of measuring.
    base = _base(args.base, "cpu", request.count, args.processes, "")
    sys.stderr.write(f"measuring {request.count} emulated devices on {args.processes} processes...\n")
    results = launch.launch({"body": "calibrate", "quick": bool(args.quick), "rounds": args.rounds},
                            processes=args.processes,
                            local_devices=request.count // args.processes)
    first = results[0]
    raw = {"platform": first["platform"], "devices": first["devices"], "processes": args.processes,
           "device_kind": first.get("device_kind", ""), "base": base.name, "seconds": first["seconds"],
           "rounds": args.rounds,
           "host_cpus": len(os.sched_getaffinity(0)), "cache_bytes": host_cache_bytes(first["platform"]),
           "samples": first["samples"]}
    return raw, f"{request} --processes {args.processes}", base


def calibrate(args: argparse.Namespace) -> CommandResult:
    """``testbed calibrate`` with ``--processes K`` (K > 1) or a refit of K-process measurements."""
    from testbed.runner import launch
    from testbed.topology.io import dump_topology

    if args.processes < 1:
        raise InputError(f"must be at least 1, got {args.processes}", field="--processes")
    if args.from_measurements:
        raw = read_measurements(args.from_measurements)
        processes = int(raw.get("processes", 1))
        if args.processes not in (1, processes):
            raise InputError(f"the measurements were taken by {processes} processes, not {args.processes}; leave "
                             f"--processes out to refit them", field="--processes")
        mpath, request = Path(args.from_measurements), f"... --from-measurements {args.from_measurements}"
        base = _base(args.base, raw.get("platform", "cpu"), int(raw.get("devices", 8)), processes,
                     str(raw.get("device_kind", "")))
    else:
        try:
            raw, request, base = _measure(args)
        except launch.WorkerFailed as exc:
            message = str(exc)  # `exc` is unbound once the except block ends; the render runs later
            return CommandResult({"ok": False, "error": message, "worker": exc.worker},
                                 lambda console: console.print(f"[red]calibrate failed:[/red] {markup(message, 2000)}"), exit_code=1)
        # The raw samples first: they stay useful even when a fit fails.
        mpath = measurements_path(args.out)
        write_atomic(mpath, json.dumps(raw, indent=1), field_name="--out")
    topo, fitted, fits = fit_saved(raw, base, name=args.name)
    header = (f"# Fitted by `testbed calibrate --devices {request}` from {raw['devices']} {raw['platform']} "
              f"device(s) in {raw['processes']} processes (gloo between processes), base {base.name}.\n")
    write_atomic(args.out, header + dump_topology(topo), field_name="--out")
    data = {"topology": str(args.out), "name": topo.name, "measurements": str(mpath), "platform": raw["platform"],
            "devices": raw["devices"], "processes": raw["processes"], "base": base.name,
            "seconds": float(raw.get("seconds", 0.0)), "fitted": fitted, "fits": {f.name: f.summary() for f in fits}}
    return CommandResult(data=data, render=lambda console: render_calibration(console, data),
                         files=[str(args.out), str(mpath)])
