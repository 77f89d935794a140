"""``testbed validate --cluster NAME --topology CAL.yaml PLAN...``: predicted vs measured steps on an emulated cluster.

For each plan: its step timed on the cluster's shaped links, and again with
the links unshaped (the host's part: compute of the processes sharing the
cores, dispatch, gloo's per-call costs), then the prediction: the host's part
plus what the links add, the compiled step's gloo calls each priced on CAL
less on CAL unshaped, added (:mod:`testbed.cluster.step`; the calls read from
the plan compiled on emulated devices,
:func:`testbed.runner.on_cluster.program_calls`), beside the measurement and
the plan's links added. ``CAL`` is what ``testbed calibrate --cluster NAME``
wrote. The simulator's own step on ``CAL`` is shown too, for what the host's
measured part changes. The 1-minute load average is recorded beside every
measurement: the host is shared.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from testbed.cluster.step import predict_step, step_calls
from testbed.errors import InputError
from testbed.output import CommandResult
from testbed.plan.io import load_plan, plan_to_dict
from testbed.plan.spec import check_plan
from testbed.text import markup
from testbed.topology.io import load_topology

__all__ = ["validate_on_cluster"]


def _plans(args: argparse.Namespace, devices: int) -> list[Any]:
    topology = load_topology(args.topology)
    plans = []
    for path in args.plans:
        plan = load_plan(path)
        try:
            check_plan(plan, topology.num_devices, where=f"topology {topology.name}")
        except InputError as exc:
            raise exc.with_file(path) from None
        if plan.mesh.size != devices:
            raise InputError(f"the plan's mesh has {plan.mesh.size} devices; cluster `{args.cluster}` holds {devices}",
                             file=path, field="mesh")
        plans.append(plan)
    return plans


def validate_on_cluster(args: argparse.Namespace) -> CommandResult:
    """``testbed validate --cluster NAME``: measured beside predicted steps on the cluster."""
    from testbed.cli.cluster import require_privilege, saved_spec
    from testbed.runner import launch
    from testbed.runner.on_cluster import host_and_shaped_steps, program_calls

    spec = saved_spec(args.cluster, field="--cluster")
    topology = load_topology(args.topology)
    plans = _plans(args, len(spec.nodes) * spec.devices_per_node)
    require_privilege("--cluster")
    rows = []
    for path, plan in zip(args.plans, plans):
        try:
            measured = host_and_shaped_steps(spec, "keep", plan_to_dict(plan), args.steps)
        except launch.WorkerFailed as exc:
            raise InputError(f"a worker on cluster `{spec.name}` failed running {path}: {exc}", field="--cluster")
        try:
            calls = step_calls(program_calls(plan_to_dict(plan)))
        except RuntimeError as exc:
            raise InputError(f"{path}: {exc}", field="plan")
        prediction = predict_step(plan, topology, measured["unshaped"]["median_step_s"], calls)
        step = measured["shaped"]["median_step_s"]
        rows.append({"plan": plan.name, "measured_s": step, **prediction.to_dict(),
                     "error": prediction.predicted_s / step - 1,
                     "simulator_alone_error": prediction.simulated_s / step - 1, "load": measured["load"],
                     "measured": measured})
    errors = [abs(r["error"]) for r in rows]
    data = {"cluster": spec.name, "topology": topology.name, "link_rate_bps": min(l.rate_bps for l in spec.links),
            "steps": args.steps, "plans": rows, "median_abs_error": statistics.median(errors),
            "max_abs_error": max(errors)}
    return CommandResult(data=data, render=lambda console: _render(console, data))


def _render(console: Any, data: dict[str, Any]) -> None:
    from testbed.units import format_time

    console.print(f"on emulated cluster [bold]{markup(data['cluster'])}[/] (links {data['link_rate_bps'] / 1e6:g} "
                  f"Mb/s), priced on {markup(data['topology'])}:")
    for r in data["plans"]:
        console.print(f"  {markup(r['plan'])}: measured {format_time(r['measured_s'])}, predicted "
                      f"{format_time(r['predicted_s'])} ({r['error']:+.1%}) = host {format_time(r['host_step_s'])} "
                      f"(measured unshaped) + links {format_time(r['links_s'])} ({r['links_from']}; the plan's "
                      f"{format_time(r['plan_links_s'])}); the simulator alone "
                      f"{format_time(r['simulated_s'])} ({r['simulator_alone_error']:+.1%}); load "
                      f"{', '.join(f'{x:.1f}' for x in r['load'])}")
    console.print(f"step time |error|: median {data['median_abs_error']:.1%}, max {data['max_abs_error']:.1%}")
