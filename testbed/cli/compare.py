"""`testbed compare`: plans side by side, on one or several topologies, with their time and memory breakdowns.

``--plans A.yaml B.yaml`` (or ``--plan P``) and ``--vary FIELD=V1,V2`` (a plan
field, repeatable: every combination) give the plans; ``--topology T...``
(``NAME@DEVICES`` resizes, ``--devices N`` resizes them all) the topologies,
else each plan's own. One row per (plan, topology): the step's time split
into compute, the exposed communication of each kind
(:mod:`testbed.sim.report.exposed`) and idle time, and the fullest device's memory
split into parameters, gradients, optimizer state, activations and
workspace; ``--png`` draws both as stacked bars on linear axes.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from testbed.cli.compare_render import MEMORY_PARTS, draw_breakdown
from testbed.errors import InputError, quote
from testbed.output import CommandResult
from testbed.plan.spec import Plan
from testbed.sim.report.timeline import Report
from testbed.topology import Topology

__all__ = ["compare", "breakdown_row", "compare_rows", "draw_breakdown", "plan_variants", "MEMORY_PARTS"]



@dataclass(frozen=True, slots=True, kw_only=True)
class Variant:
    """One plan to compare: the plan, the file it came from, and the ``--vary`` values that made it."""

    plan: Plan
    source: str
    varied: tuple[tuple[str, Any], ...] = ()

    def label(self, named: bool = True) -> str:
        """``name k=v ...`` (``named`` False: the varied fields alone, when every row is of one plan)."""
        return " ".join([*([self.plan.name] if named or not self.varied else []),
                         *(f"{k}={_short(v)}" for k, v in self.varied)])


def _short(value: Any) -> str:
    """A varied value as a label shows it: a mapping or list by its values (``interleaved/8``)."""
    if isinstance(value, dict):
        return "/".join(_short(v) for v in value.values())
    if isinstance(value, list):
        return "/".join(_short(v) for v in value)
    return str(value)


def _add(parser: argparse.ArgumentParser) -> None:
    from testbed.cli.basic import add_devices_argument

    parser.add_argument("--plan", help="plan YAML file or bundled plan name (with --topology T1 T2...: one plan "
                                       "on several topologies)")
    parser.add_argument("--plans", nargs="+", metavar="P", help="two or more plans side by side")
    parser.add_argument("--vary", action="append", default=[], metavar="FIELD=V1,V2",
                        help="a plan field and its values (zero=1,3; remat=none,full; mesh.tensor=4,8; a value may "
                             "be YAML: 'schedule=1f1b,{name: interleaved, virtual_stages: 8}'); repeat for every "
                             "combination")
    parser.add_argument("--topology", nargs="+", metavar="T",
                        help="topologies (bundled names or YAML paths, NAME@DEVICES resizes; default: each "
                             "plan's `topology:`)")
    add_devices_argument(parser)
    parser.add_argument("--png", help="write the time and memory breakdowns as stacked bars")
    parser.add_argument("--scale", choices=("data",),
                        help="scale the plan's data degree (and global batch) to each topology's device count")


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside ``{}`` and ``[]`` (a value may be a YAML flow mapping or list)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "{[") - (ch in "}]")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def _vary_values(text: str) -> tuple[str, list[Any]]:
    import yaml

    field, sep, values = text.partition("=")
    field = field.strip().removeprefix("plan.")
    items = [v.strip() for v in _split_top(values) if v.strip()]
    if not sep or not field or not items:
        raise InputError(f"expected FIELD=V1,V2 (e.g. zero=1,3 or remat=none,full), got {quote(text)}", field="--vary")
    parsed = []
    for item in items:
        try:
            parsed.append(yaml.safe_load(item))
        except yaml.YAMLError:
            parsed.append(item)
    return field, parsed


def plan_variants(plans: list[tuple[Plan, str]], vary: list[str]) -> list[Variant]:
    """Every plan with every combination of the ``--vary`` values (plan fields by their YAML path)."""
    from testbed.explore.sweep_spec import apply_plan
    from testbed.plan.io import plan_from_dict, plan_to_dict

    axes = [_vary_values(v) for v in vary]
    out = []
    for plan, source in plans:
        for combo in itertools.product(*(values for _, values in axes)):
            varied = tuple((field, value) for (field, _), value in zip(axes, combo))
            data = plan_to_dict(plan)
            try:
                data = apply_plan(data, {f"plan.{f}": v for f, v in varied}, Path("."))
                changed = plan_from_dict(data, default_name=plan.name)
            except InputError as exc:
                setting = " ".join(f"{f}={v}" for f, v in varied)
                raise InputError(f"{setting}: {exc.message} (plan `{plan.name}`)", field="--vary") from None
            out.append(Variant(plan=changed, source=source, varied=varied))
    return out


def _row(variant: Variant, topology: Topology, scale: str | None, named: bool = True) -> dict[str, Any]:
    from testbed.cli.simulate import simulate_file_plan
    from testbed.plan.scale import scale_data
    from testbed.sim.report.exposed import exposed_by_kind

    plan = variant.plan
    if scale == "data":
        plan = scale_data(plan, topology.num_devices, f"topology `{topology.name}`")
    sim = simulate_file_plan(plan, topology, variant.source)
    return {"label": variant.label(named), "plan": plan.name, "varied": dict(variant.varied), "topology": topology.name,
            "devices": topology.num_devices, "data": plan.mesh.data, "global_batch": plan.batch.global_batch,
            **breakdown_row(sim.report, exposed_by_kind(sim.timeline))}


def breakdown_row(r: Report, exposed: dict[str, float]) -> dict[str, Any]:
    """A simulated step's time and memory breakdowns as a compared row holds them (``exposed``: by kind)."""
    memory = {k: r.memory.get(k) for k in ("params", "grads", "optimizer", "activations", "workspace", "total",
                                            "capacity")}
    return {"step_time_s": r.step_time_s, "compute_s": r.compute_s, "exposed_comm_s": r.exposed_comm_s,
            "exposed_by_kind": exposed, "idle_s": max(0.0, r.step_time_s - r.compute_s - r.exposed_comm_s),
            "bubble_fraction": r.bubble_fraction, "mfu": r.mfu, "fits": bool(r.memory.get("fits")),
            "memory_total": r.memory.get("total"), "memory": memory}


def compare_rows(plan: Plan, topologies: list[Topology], plan_file: str, scale: str | None = None) -> list[dict]:
    """One summary row per topology (the plan scaled along ``scale`` first, if given)."""
    return [_row(Variant(plan=plan, source=plan_file), t, scale) for t in topologies]


def _execute(args: argparse.Namespace) -> CommandResult:
    from testbed.cli.basic import plan_topology
    from testbed.cli.compare_render import render_rows
    from testbed.plan.io import load_plan
    from testbed.topology.io import load_topology

    names = ([args.plan] if args.plan else []) + list(args.plans or [])
    if not names:
        raise InputError("give --plans A.yaml B.yaml ... (or --plan P with --topology T1 T2 ... or --vary)",
                         field="--plans")
    variants = plan_variants([(load_plan(n), n) for n in names], args.vary)
    if len(variants) < 2 and len(args.topology or []) < 2:
        raise InputError("nothing to compare: give two or more plans (--plans), a --vary with two or more values, or "
                         "two or more topologies (--topology)", field="--plans")
    if args.topology:
        topologies = [load_topology(name, args.devices) for name in args.topology]
        pairs = [(v, t) for v in variants for t in topologies]
    else:
        pairs = [(v, plan_topology(v.plan, None, v.source, args.devices)) for v in variants]
    named = len({v.source for v in variants}) > 1 or not args.vary
    rows = [_row(v, t, args.scale, named) for v, t in pairs]
    title = ", ".join(dict.fromkeys(v.plan.name for v in variants)) + (" (data degree scaled)" if args.scale else "")
    data: dict[str, Any] = {"plan": variants[0].plan.name, "plans": [v.label() for v in variants],
                            "scale": args.scale, "rows": rows}
    files = []
    if args.png:
        files.append(str(draw_breakdown(rows, args.png, title=f"{title}: one training step")))
        data["png"] = args.png

    def render(console) -> None:
        render_rows(console, rows, title, files)

    return CommandResult(data, render, files=files)


compare = SimpleNamespace(add_arguments=_add, execute=_execute)

