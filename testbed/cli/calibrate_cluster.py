"""``testbed calibrate --cluster NAME --out F.yaml``: gloo's host costs on an emulated cluster, as a topology.

On a cluster ``testbed cluster up NAME`` built, this probes the host's TCP
and times all-reduce, all-gather and reduce-scatter over every device
(:mod:`testbed.runner.cluster_calibrate`; the reduce-scatter at 4 KiB only,
whose rounds, 4 against the rings' 7 and 14 on 8 devices, separate a call's
cost from a round's), fits the per-call and per-round costs and
the link efficiency (:mod:`testbed.cluster.fit`) and writes the topology the
cluster is (:meth:`ClusterSpec.emulated_topology`) with them: the network
level's bandwidth is the links' TCP goodput times the efficiency, and
``calibration.collectives.overhead_s`` the per-round cost. ``simulate``,
``validate --cluster`` and every other command then price the cluster with
it. The raw rows go to ``F.measurements.json``; ``--from-measurements`` refits
them (no privilege needed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from testbed.cluster.measurements import load_measurements
from testbed.cluster.fit import CAPPED_OPS, HostCosts, HostProbe, emulated, fit_from_bytes, fit_host_costs, row_errors
from testbed.cluster.spec import ClusterSpec, cluster_spec
from testbed.errors import InputError
from testbed.output import CommandResult, write_atomic
from testbed.text import markup
from testbed.topology.io import load_topology

__all__ = ["calibrate", "read_cluster_measurements", "calibrated_topology"]


def read_cluster_measurements(path: str) -> tuple[ClusterSpec, dict[str, Any]]:
    """A ``.measurements.json`` that ``calibrate --cluster`` wrote, checked field by field
    (:mod:`testbed.cluster.measurements`): the cluster's spec and the document."""
    raw = load_measurements(path)
    try:
        spec = cluster_spec(load_topology(raw["topology"]), name=raw["cluster"], scale=raw["scale"], mtu=raw["mtu"])
    except InputError as exc:
        raise exc.with_file(path) from None
    return spec, raw


def calibrated_topology(spec: ClusterSpec, raw: dict[str, Any]) -> tuple[Any, HostCosts, list[dict[str, Any]]]:
    """The emulated topology priced with the host costs fitted to ``raw``; the costs; each row's error."""
    probe = HostProbe.from_dict(raw["probe"])
    rows = [r for r in raw["rows"] if r.get("ok", True)]
    costs = fit_host_costs(spec, probe, rows, min_bytes=fit_from_bytes(raw))
    return emulated(spec, probe, costs), costs, row_errors(spec, probe, costs, rows)


def _measure(args: argparse.Namespace) -> tuple[ClusterSpec, dict[str, Any]]:
    from testbed.cli.cluster import require_privilege, saved_spec
    from testbed.runner import launch
    from testbed.runner.cluster_calibrate import measure

    spec = saved_spec(args.cluster, field="--cluster")
    require_privilege("--cluster")
    try:
        raw = measure(spec, "keep", max_call_s=args.max_call_s, capped=CAPPED_OPS)
    except launch.WorkerFailed as exc:
        raise InputError(f"a worker on cluster `{spec.name}` failed: {exc}", field="--cluster") from None
    write_atomic(Path(args.out).with_suffix(".measurements.json"), json.dumps(raw, indent=1), field_name="--out")
    return spec, raw


def _calibrate(args: argparse.Namespace) -> CommandResult:
    from testbed.topology.io import dump_topology

    if not str(args.out).endswith((".yaml", ".yml")):
        raise InputError(f"expected a .yaml path for the calibrated topology, got `{args.out}`", field="--out")
    if not args.max_call_s > 0:
        raise InputError(f"must be a positive number of seconds, got {args.max_call_s}", field="--max-call-s")
    spec, raw = read_cluster_measurements(args.from_measurements) if args.from_measurements else _measure(args)
    try:
        topology, costs, rows = calibrated_topology(spec, raw)
    except InputError as exc:  # e.g. no row large enough to fit
        raise (exc.with_file(args.from_measurements) if args.from_measurements else exc) from None
    errors = [abs(r["error"]) for r in rows]
    header = (f"# Fitted by `testbed calibrate --cluster {spec.name}` on emulated cluster `{spec.name}` "
              f"({spec.topology.name} at scale {spec.scale:g}, links {raw['link_rate_bps'] / 1e6:g} Mb/s): gloo's "
              f"host costs {costs.overhead_s * 1e3:.3f} ms a round, link efficiency {costs.link_efficiency:.3f} "
              f"(= {costs.per_byte_s * 1e9:.2f} ns/B), load average {raw['load_before']:.1f} -> "
              f"{raw['load_after']:.1f}.\n")
    write_atomic(args.out, header + dump_topology(topology), field_name="--out")
    data = {"topology": str(args.out), "name": topology.name, "cluster": spec.name, "scale": spec.scale,
            "link_rate_bps": raw["link_rate_bps"], "measurements": str(Path(args.out).with_suffix(".measurements.json")),
            "costs": costs.to_dict(), "rows": rows, "median_abs_error": sorted(errors)[len(errors) // 2],
            "max_abs_error": max(errors), "load_before": raw["load_before"], "load_after": raw["load_after"],
            "queue": raw.get("queue")}
    return CommandResult(data=data, render=lambda console: _render(console, data), files=[str(args.out)])


def _render(console: Any, data: dict[str, Any]) -> None:
    from testbed.units import format_bytes, format_time

    c = data["costs"]
    console.print(f"calibrated emulated cluster [bold]{markup(data['cluster'])}[/] (links "
                  f"{data['link_rate_bps'] / 1e6:g} Mb/s): {format_time(c['overhead_s'])} a round of a collective, "
                  f"{c['link_efficiency']:.1%} of the links' TCP goodput ({c['per_byte_s'] * 1e9:.2f} ns per byte); "
                  f"load average {data['load_before']:.1f} -> {data['load_after']:.1f}")
    for r in data["rows"]:
        console.print(f"  {r['op']:<10} {format_bytes(r['bytes']):>9}: measured {format_time(r['measured_s'])}, "
                      f"fitted {format_time(r['predicted_s'])} ({r['error']:+.1%})")
    console.print(f"wrote {markup(data['topology'])}")


calibrate = _calibrate
