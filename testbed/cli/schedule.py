"""`testbed schedule NAME --stages P --microbatches M`: a pipeline table, its bubble and Gantt chart."""

from __future__ import annotations

import argparse
import math

from testbed.errors import InputError, quote
from testbed.viz.gantt import draw_gantt
from testbed.output import CommandResult
from testbed.pipeline.timing import ActionCosts, gantt_bars, play
from testbed.pipeline.schedules import build_schedule, peak_deferred_weight_grads, peak_inflight, schedule_names, validate
from testbed.text import markup

__all__ = ["add_arguments", "execute", "parse_costs"]

#: Stages the table on the terminal shows at most (the JSON has every stage).
_SHOWN_STAGES = 64
#: Actions a --gantt chart draws at most (one bar each).
_MAX_GANTT_ACTIONS = 20_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `testbed schedule`."""
    parser.add_argument("name", help=f"schedule: {', '.join(schedule_names())}")
    parser.add_argument("--stages", type=int, required=True, help="pipeline stages P")
    parser.add_argument("--microbatches", type=int, required=True, help="microbatches M per step")
    parser.add_argument("--virtual", type=int, default=1, help="virtual chunks per stage (interleaved only)")
    parser.add_argument("--costs", default="1,1,1",
                        help="F,B,W times per microbatch per stage (B = input gradient, W = weight gradient; "
                             "unsplit schedules run B+W as one backward); per stage: 'F,B,W;F,B,W;...'")
    parser.add_argument("--send", type=float, default=0.0, help="time of one activation/gradient send per hop")
    parser.add_argument("--gantt", help="write a Gantt chart PNG (stages x time)")


def parse_costs(text: str, stages: int, send: float = 0.0) -> ActionCosts:
    """``"F,B,W"`` (every stage) or ``"F,B,W;F,B,W;..."`` (one triple per stage) -> :class:`ActionCosts`."""
    triples = []
    if not math.isfinite(send) or send < 0:
        raise InputError(f"must be a finite time >= 0, got {send}", field="--send")
    for part in text.split(";"):
        try:
            values = [float(x) for x in part.split(",")]
        except ValueError:
            raise InputError(f"expected numbers F,B,W, got {quote(part)}", field="--costs") from None
        if len(values) != 3:
            raise InputError(f"expected three numbers F,B,W, got {quote(part)}", field="--costs")
        if not all(math.isfinite(x) and x >= 0 for x in values):
            raise InputError(f"times must be finite and >= 0, got {quote(part)}", field="--costs")
        triples.append(values)
    if len(triples) not in (1, stages):
        raise InputError(f"give one F,B,W triple or one per stage ({stages}), got {len(triples)}", field="--costs")
    try:
        if len(triples) == 1:
            f, b, w = triples[0]
            return ActionCosts(forward=f, backward=b, weight=w, send=send)
        return ActionCosts(forward=tuple(t[0] for t in triples), backward=tuple(t[1] for t in triples),
                           weight=tuple(t[2] for t in triples), send=send)
    except InputError as exc:
        raise exc.within("--costs") if exc.field != "send" else InputError(exc.message, field="--send") from None


def execute(args: argparse.Namespace) -> CommandResult:
    """Build, validate and play the schedule; optionally draw it."""
    try:
        schedule = build_schedule(args.name, args.stages, args.microbatches, args.virtual)
    except InputError as exc:
        raise InputError(exc.message, field=f"--{exc.field}" if exc.field != "schedule" else "NAME") from None
    actions = sum(len(row) for row in schedule.actions)
    if args.gantt and actions > _MAX_GANTT_ACTIONS:
        raise InputError(f"draws at most {_MAX_GANTT_ACTIONS:,} actions, this schedule has {actions:,}; "
                         "use fewer stages or microbatches", field="--gantt")
    validate(schedule)
    timing = play(schedule, parse_costs(args.costs, schedule.stages, args.send))
    data = {
        "schedule": schedule.name, "stages": schedule.stages, "microbatches": schedule.microbatches,
        "virtual": schedule.virtual, "split_backward": schedule.split_backward, "valid": True,
        "steps": schedule.steps(),
        "bubble_fraction": timing.bubble_fraction,
        "steady_bubble_fraction": timing.steady_bubble_fraction,
        "step_time": timing.step_time,
        "idle": list(timing.idle),
        "peak_inflight": list(peak_inflight(schedule)),
        "peak_deferred_weight_grads": list(peak_deferred_weight_grads(schedule)),
        "timeline": [[[i.start, i.end, i.action.label(schedule.virtual)] for i in row] for row in timing.intervals],
    }
    files = []
    if args.gantt:
        title = (f"{schedule.name}: {schedule.stages} stages, {schedule.microbatches} microbatches"
                 + (f", {schedule.virtual} virtual" if schedule.virtual > 1 else "")
                 + f" - bubble {timing.bubble_fraction:.1%}")
        draw_gantt([f"stage {s}" for s in range(schedule.stages)], gantt_bars(timing), args.gantt, title=title)
        files.append(args.gantt)
        data["gantt"] = args.gantt

    def render(console) -> None:
        from rich.table import Table

        table = Table(title=f"{schedule.name}  P={schedule.stages} M={schedule.microbatches} V={schedule.virtual}")
        for column in ("stage", "actions", "peak in-flight", "idle"):
            table.add_column(column)
        for s, row in enumerate(data["steps"][:_SHOWN_STAGES]):
            shown = " ".join(row) if len(row) <= 48 else " ".join(row[:48]) + " ..."
            table.add_row(str(s), shown, str(data["peak_inflight"][s]), f"{timing.idle[s]:g}")
        console.print(table)
        if schedule.stages > _SHOWN_STAGES:
            console.print(f"(first {_SHOWN_STAGES} of {schedule.stages} stages shown; --json has all)")
        console.print(f"step time {timing.step_time:g} time units (--costs: F,B,W of one microbatch-chunk = "
                      f"{args.costs}), bubble fraction {timing.bubble_fraction:.4f}"
                      f" (steady-state {timing.steady_bubble_fraction:.4f})")
        console.print("F/B/W: forward, backward (input gradients; with W apart) and weight-gradient actions, "
                      "microbatch number after the letter (.chunk with virtual stages); peak in-flight: activation "
                      "sets a stage holds at once; idle: its time units with nothing to run")
        for f in files:
            console.print(f"wrote {markup(f)}")

    return CommandResult(data, render, files=files)
