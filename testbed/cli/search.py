"""`testbed search`: the best layout of a model on a topology (testbed.explore).

The model comes from a plan file (its model, global batch, precision and
optimizer are kept) or a preset (``gpt-1.3b``); the search chooses the
mesh, schedule, microbatches, ZeRO and remat, ranks every candidate that
fits with the analytic tier and replays the best with the discrete-event
simulator. ``--out`` writes the best as a plan `testbed run` and `verify`
read unchanged.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from testbed.errors import InputError
from testbed.output import CommandResult, output_target, write_atomic
from testbed.plan.runtime import runner_refusal
from testbed.plan.spec import Plan
from testbed.text import markup, shown
from testbed.units import format_bytes, format_time

if TYPE_CHECKING:
    from pathlib import Path

    from testbed.topology import Topology

__all__ = ["search", "base_plan"]


def _csv(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(x.strip() for x in text.split(",") if x.strip())


def _on_off(value: str, flag: str = "--sequence-parallel") -> bool:
    choices = {"on": True, "true": True, "off": False, "false": False}
    if value.lower() not in choices:
        raise InputError(f"expected on or off (comma-separated), got `{value}`", field=flag)
    return choices[value.lower()]


def _add(parser: argparse.ArgumentParser) -> None:
    from testbed.cli.basic import add_devices_argument
    from testbed.explore.search import OBJECTIVES
    from testbed.plan.presets import preset_names

    parser.add_argument("--model", required=True,
                        help=f"plan file or bundled plan (its model, batch, precision, optimizer are kept) or a "
                             f"model preset: {', '.join(preset_names())}")
    parser.add_argument("--topology", help="bundled name or YAML path, NAME@DEVICES resizes it (default: the plan's `topology:`)")
    add_devices_argument(parser)
    parser.add_argument("--global-batch", type=int, help="sequences per step (default: the plan's or preset's)")
    parser.add_argument("--seq", type=int, help="sequence length (default: the plan's or preset's)")
    parser.add_argument("--objective", default="step_time", choices=list(OBJECTIVES))
    parser.add_argument("--price", type=float, help="price per device-hour in dollars (for --objective cost; default: the topology's price_per_device_hour)")
    parser.add_argument("--memory-cap", type=float, default=1.0, help="fraction of device memory a plan may use")
    parser.add_argument("--top", type=int, default=5, help="how many plans to show (default 5)")
    parser.add_argument("--replay", type=int, default=16, help="best estimates replayed with the DES (default 16)")
    parser.add_argument("--schedules", help="comma-separated schedules to consider (default: all)")
    parser.add_argument("--microbatches", help="comma-separated microbatch counts (default: every divisor of the batch per replica)")
    parser.add_argument("--virtual-stages", help="comma-separated virtual-stage counts of the interleaved schedule "
                                                 "(default: every count dividing the fullest stage's layers)")
    parser.add_argument("--remat", help="comma-separated remat modes (default: none,selective,full,save-dots; save-dots where the runtime is XLA's)")
    parser.add_argument("--zero", help="comma-separated ZeRO stages (default: 0,1,2,3)")
    parser.add_argument("--precision", help="comma-separated precisions (default: keep the plan's)")
    parser.add_argument("--contexts", help="comma-separated context-parallel degrees (default: 1, and for sequences "
                                           "of 16K tokens or more every degree that fits)")
    parser.add_argument("--experts", help="comma-separated expert-parallel degrees of an MoE model (default: every "
                                          "degree dividing the experts and the devices)")
    parser.add_argument("--sequence-parallel", help="comma-separated on/off: Megatron sequence parallelism on the "
                                                    "candidates with a tensor axis (default: the plan's; on for a preset)")
    parser.add_argument("--fold-experts", help="comma-separated on/off: MoE parallel folding (mesh.expert_tensor 1: "
                                               "each expert whole, the experts over expert x tensor) on the MoE "
                                               "candidates with a tensor axis (default: both)")
    parser.add_argument("--runtime", help="the training stack the plans run under: a runtime profile "
                        "(testbed, xla, megatron, nemo, deepspeed, fsdp, torchtitan, llm-foundry, meta; default: the "
                        "plan's, testbed's runner for a preset); it decides what a microbatch keeps and how work overlaps")
    parser.add_argument("--out", help="write the best plan as YAML")
    parser.add_argument("--png", help="write the ranked plans' time and memory breakdowns as stacked bars")


#: What a search from a model preset starts from beyond the preset's shape, context and batch: FlashAttention
#: (Dao et al. 2022, arXiv:2205.14135: the same attention, exactly, without the ``seq x seq`` scores in memory;
#: the kernel Megatron-LM, NeMo, torchtitan and MaxText run by default) and, on the candidates with a tensor
#: axis, Megatron sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198: the tensor group's
#: all-reduces become reduce-scatters and all-gathers of the same bytes, and the activations between them are
#: split over the group). A plan file keeps its own choices; ``--sequence-parallel on,off`` tries both.
PRESET_START = "flash attention; sequence parallelism where there is a tensor axis (--sequence-parallel on,off: both)"


def base_plan(model: str, global_batch: int | None = None, seq: int | None = None) -> Plan:
    """The plan a search starts from: a preset's (with flash attention: :data:`PRESET_START`), or a plan file's
    with the batch and sequence overridden."""
    from testbed.explore.base_plan import preset_plan
    from testbed.plan.spec import Attention
    from testbed.plan.presets import PRESETS
    from testbed.plan.io import load_plan

    for name, value in (("--global-batch", global_batch), ("--seq", seq)):
        if value is not None and value < 1:
            raise InputError(f"must be a positive whole number, got {value}", field=name)
    if model in PRESETS:  # the attention kernel is a choice of the program's, as remat is (PRESET_START)
        plan = preset_plan(model, global_batch, seq)
        return replace(plan, model=replace(plan.model, attention=Attention.FLASH))
    try:
        plan = load_plan(model)
    except InputError as exc:
        if model.strip() and os.path.exists(model):  # os.path: False (not OSError) for an over-long name
            raise
        raise InputError(f"`{model}` is neither a plan file, a bundled plan nor a preset "
                         f"({', '.join(sorted(PRESETS))}); {exc.message}", field="--model") from None
    if global_batch is not None:
        plan = replace(plan, batch=replace(plan.batch, global_batch=global_batch, microbatches=1),
                       mesh=replace(plan.mesh, data=1, fsdp=1))
    if seq is not None:
        plan = replace(plan, model=replace(plan.model, seq_len=seq))
    return plan


def _space(args: argparse.Namespace, preset: bool = False):
    """The search space of the command's flags (``preset``: the model is a preset, :data:`PRESET_START`)."""
    from testbed.explore.choices import SearchSpace

    fields: dict[str, Any] = {}
    if args.schedules:
        fields["schedules"] = _csv(args.schedules)
    if args.microbatches:
        fields["microbatches"] = _csv(args.microbatches)
    if args.remat:
        fields["remat"] = _csv(args.remat)
    if getattr(args, "virtual_stages", None):
        fields["virtual_stages"] = _csv(args.virtual_stages)
    if args.zero:
        fields["zero"] = _csv(args.zero)
    if args.precision:
        fields["precisions"] = _csv(args.precision)
    if args.contexts:
        fields["contexts"] = _csv(args.contexts)
    if args.experts:
        fields["experts"] = _csv(args.experts)
    if args.sequence_parallel:
        fields["sequence_parallel"] = tuple(_on_off(v) for v in _csv(args.sequence_parallel) or ())
    elif preset:  # PRESET_START
        fields["sequence_parallel"] = (True,)
    if args.fold_experts:
        fields["fold_experts"] = tuple(_on_off(v, "--fold-experts") for v in _csv(args.fold_experts) or ())
    try:
        return SearchSpace(**fields)
    except InputError as exc:
        raise InputError(exc.message, field="--" + (exc.field or "").removeprefix("space.").replace("_", "-")
                         .replace("precisions", "precision")) from None


def _execute(args: argparse.Namespace) -> CommandResult:
    from testbed.cli.progress import phase_progress, progress_bar
    from testbed.explore.search import search as run_search
    from testbed.topology.resize import sized_name
    from testbed.plan.io import dump_plan, plan_to_dict
    from testbed.plan.presets import PRESETS

    plan, topology = _plan_and_topology(args)
    space = _space(args, preset=args.model in PRESETS)
    # The time left is the search's own (testbed.explore.eta, in each phase's label): a best-first search skips
    # most plans at once, so the bar's share-done extrapolation would overstate it many times over.
    with progress_bar("searching", heartbeat=True) as bar:
        progress = phase_progress(bar, {"bounds": "plans (memory and step floors)",
                                        "analytic": "plans (analytic tier)", "replay": "best plans (DES replay)"})
        result = run_search(plan, topology, space, objective=args.objective, memory_cap=args.memory_cap,
                            replay=args.replay, top=args.top, price_per_device_hour=args.price, progress=progress)
    best = result.best
    baseline = _baseline(plan, topology)
    name = f"{plan.name}-searched"
    # The plan names the topology it was searched on, resized as it was (NAME@DEVICES), so that it runs as is.
    written = replace(best.plan, name=name, topology=sized_name(args.topology or plan.topology, args.devices))
    files = []
    if args.out:
        header = (f"# Found by `testbed search` ({args.objective}) on {shown(topology.name)}: "
                  f"{format_time(best.step_time_s)} per step (DES).\n")
        files.append(str(write_atomic(args.out, header + dump_plan(written), "--out")))
    rows = [c.summary() for c in result.ranked[:args.top]]
    if args.png:
        files.append(str(draw_ranked(result.ranked[:args.top], topology, args.png,
                                     f"{plan.name} on {topology.name}: the best plans found")))
    start = PRESET_START if args.model in PRESETS else None
    data = {"model": plan.name, "preset_start": start, "topology": topology.name, "devices": topology.num_devices,
            "objective": args.objective, "enumerated": result.enumerated, "pruned_memory": result.pruned_memory,
            "pruned_bound": result.pruned_bound, "estimated": result.estimated, "replayed": result.replayed,
            "replays_stopped": result.replays_stopped, "analytic_s": result.analytic_s,
            "replay_s": result.replay_s, "plans_per_minute": result.plans_per_minute,
            "baseline_step_time_s": baseline, "ranked": rows, "best_plan": plan_to_dict(written), "out": args.out,
            "runner_refuses": runner_refusal(best.plan)}

    def render(console) -> None:
        console.print(f"[bold]{markup(plan.name)}[/bold] on [bold]{markup(topology.name)}[/bold] "
                      f"({topology.num_devices} devices): {result.enumerated} plans, {result.pruned_memory} over "
                      f"memory, {result.pruned_bound} too slow to replay by their step floor, {result.estimated} estimated "
                      f"({result.plans_per_minute:,.0f}/min), {result.replayed} replayed"
                      + (f" ({result.replays_stopped} stopped once slower than the best {args.top})"
                         if result.replays_stopped else ""))
        if start:
            console.print(f"from the preset with {start}; runtime {markup(plan.runtime.profile)}")
        _render_ranked(console, rows)
        if baseline:
            console.print(f"the plan as written: {format_time(baseline)} per step; best: "
                          f"{format_time(best.step_time_s)} ({baseline / best.step_time_s:.2f}x faster)")
        if data["runner_refuses"]:
            console.print(f"note: `testbed run` refuses the best plan: {markup(data['runner_refuses'])}")
        for f in files:
            console.print(f"wrote {markup(f)}")

    return CommandResult(data, render, files=files)


def draw_ranked(candidates: list, topology: Topology, path: str, title: str) -> Path:
    """``--png``: the ranked plans side by side as ``testbed compare`` draws plans (testbed.cli.compare_render), from
    their replays' breakdowns, each labelled by its rank and layout."""
    from testbed.cli.compare import breakdown_row
    from testbed.cli.compare_render import draw_breakdown

    rows = []
    for rank, candidate in enumerate(candidates, 1):
        row = breakdown_row(candidate.report, candidate.exposed_by_kind) | {"topology": topology.name}
        summary = candidate.summary()
        schedule = summary["schedule"] + (f"x{summary['virtual_stages']}" if summary["virtual_stages"] > 1 else "")
        rows.append(row | {"label": f"#{rank} {layout_label(summary)} {schedule} mb{summary['microbatches']} "
                                    f"Z{summary['zero']} {summary['remat']}"})
    return draw_breakdown(rows, path, title=title)


def layout_label(row: dict[str, Any]) -> str:
    """``d.f.t.s`` degrees (and expert, context, SP marks) with the schedule: how the ranked table names a plan."""
    mesh = f"{row['data']}.{row['fsdp']}.{row['tensor']}.{row['stage']}" + (
        f" ep{row['expert']}" if row.get("expert", 1) > 1 else "") + (  # MoE: the expert degree beside
        " etp1" if row.get("expert_tensor", row["tensor"]) != row["tensor"] else "") + (  # folded experts
        f" cp{row['context']}" if row.get("context", 1) > 1 else "") + (  # context parallelism likewise
        " sp" if row.get("sequence_parallel") else "")  # and sequence parallelism
    return mesh


def _plan_and_topology(args: argparse.Namespace) -> tuple[Plan, Topology]:
    """The plan the search starts from (``--model``, ``--runtime``) and the topology it searches on; ``--out``
    is checked before the search, not after it."""
    from testbed.cli.basic import plan_topology

    plan = base_plan(args.model, args.global_batch, args.seq)
    if args.runtime is not None:
        from testbed.plan.runtime import runtime_from_dict

        try:
            plan = replace(plan, runtime=runtime_from_dict({"profile": args.runtime}))
        except InputError as exc:
            raise InputError(exc.message, field="--runtime") from None
    if args.topology is None and plan.topology is None:
        raise InputError("give --topology (a preset model names none)", field="--topology")
    topology = plan_topology(plan, args.topology, devices=args.devices)
    for flag, path in (("--out", args.out), ("--png", args.png)):
        if path:
            output_target(path, flag)  # refused before the search, not after it
    return plan, topology


def _baseline(plan: Plan, topology: Topology) -> float | None:
    """The simulated step of the plan as written, when it names a topology of its own size (else None)."""
    from testbed.sim.graph.engine import simulate

    if plan.mesh.size == topology.num_devices and plan.topology:
        try:
            return simulate(plan, topology).report.step_time_s
        except InputError:
            return None
    return None


def _render_ranked(console, rows: list[dict[str, Any]]) -> None:
    """The ranked plans' table: the layout (mesh, schedule, microbatches, ZeRO, remat) identifies a candidate;
    comm, bubble and memory go first when the terminal is narrow."""
    from testbed.cli.tables import Col, compact, fitted_table

    columns = [Col(header="#"), Col(header="d.f.t.s", key=True, justify="left"),
               Col(header="schedule", key=True, justify="left"), Col(header="mb", key=True),
               Col(header="Z", key=True), Col(header="remat", key=True, justify="left"), Col(header="step"),
               Col(header="comm", drop=3), Col(header="bubble", drop=2), Col(header="MFU"),
               Col(header="memory", drop=1)]
    cells = []
    for i, r in enumerate(rows, 1):
        sched = r["schedule"] + (f"x{r['virtual_stages']}" if r["virtual_stages"] > 1 else "")
        cells.append([str(i), layout_label(r), sched, str(r["microbatches"]), str(r["zero"]), r["remat"],
                      format_time(r["step_time_s"]), format_time(r.get("exposed_comm_s", 0.0)),
                      f"{r.get('bubble_fraction', 0.0):.0%}", f"{r.get('mfu', 0.0):.0%}",
                      format_bytes(r["memory_bytes"])])
    console.print(fitted_table(console, columns, cells, **compact()))
    console.print("d.f.t.s: data.fsdp.tensor.stage degrees (ep expert, etp1 experts whole, cp context, sp "
                  "sequence parallel); mb: microbatches; Z: ZeRO stage; step: simulated step; comm: exposed "
                  "communication; bubble: idle pipeline share; memory: the fullest device")


search = SimpleNamespace(add_arguments=_add, execute=_execute)
