"""`testbed compare`'s tables and picture: each row's time and memory breakdown, each column in a legend.

The rows are testbed.cli.compare's. Time and memory are two tables of the
same rows (one would not fit 80 columns); each is followed by a legend line
naming its columns. The picture stacks the same parts as horizontal bars on
linear axes: a step's milliseconds, a device's GiB against its capacity.
"""

from __future__ import annotations

from typing import Any

from testbed.text import markup, plot_label, shown
from testbed.units import format_bytes, format_time

__all__ = ["render_rows", "draw_breakdown", "comm_kinds", "MEMORY_PARTS"]

#: (row key, table header, legend) of the memory columns, in the order they stack.
MEMORY_PARTS: tuple[tuple[str, str, str], ...] = (
    ("params", "params", "parameters"), ("grads", "grads", "gradients live at the peak"),
    ("optimizer", "optim", "optimizer state (Adam moments, fp32 master)"),
    ("activations", "acts", "activations kept for the backward"),
    ("workspace", "work", "transient buffers of one phase (`testbed memory` names them)"))

_GIB = 1024 ** 3
#: Colours of the stacked parts (the compute and idle ones shared with the topology comparison).
_COMPUTE, _IDLE = "#4e79a7", "#bab0ac"
_KIND_COLOURS = ("#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f")
_MEMORY_COLOURS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f")


def comm_kinds(rows: list[dict]) -> list[str]:
    """The communication kinds exposed in any row, the largest total first."""
    totals: dict[str, float] = {}
    for r in rows:
        for kind, seconds in r["exposed_by_kind"].items():
            totals[kind] = totals.get(kind, 0.0) + seconds
    return sorted(totals, key=lambda k: -totals[k])


def _keys(rows: list[dict]) -> list[tuple[str, str]]:
    """(row field, header) of the identifying columns: the plan, the topology, whichever differ."""
    keys = [("label", "plan")] if len({r["label"] for r in rows}) > 1 else []
    if len({r["topology"] for r in rows}) > 1 or not keys:
        keys.append(("topology", "topology"))
    return keys


def render_rows(console: Any, rows: list[dict], title: str, files: list[str]) -> None:
    """Two tables of the rows (time per step, memory per device), each with its legend line."""
    from rich.text import Text

    from testbed.cli.tables import Col, compact, fitted_table
    from testbed.sim.report.exposed import KIND_LEGEND

    keys, kinds = _keys(rows), comm_kinds(rows)
    scaled = len({r["data"] for r in rows}) > 1
    key_cols = [Col(header=h, key=True, justify="left") for _, h in keys]
    devices = [Col(header="devices", drop=4)] if any(k == "topology" for k, _ in keys) else []
    columns = [*key_cols, *devices, *([Col(header="data")] if scaled else []), Col(header="step"),
               Col(header="compute"), *(Col(header=k, drop=1) for k in kinds), Col(header="idle"),
               Col(header="bubble", drop=3), Col(header="MFU", drop=2)]
    cells = []
    for r in rows:
        row = [shown(r[k]) for k, _ in keys] + ([str(r["devices"])] if devices else [])
        row += ([str(r["data"])] if scaled else []) + [format_time(r["step_time_s"]), format_time(r["compute_s"])]
        row += [format_time(r["exposed_by_kind"].get(k, 0.0)) for k in kinds]
        row += [format_time(r["idle_s"]), f"{r['bubble_fraction']:.1%}", f"{r['mfu']:.1%}"]
        cells.append(row)
    console.print(fitted_table(console, columns, cells, title=f"{markup(title)}: time per step", **compact()))
    legend = ["step = compute + communication not hidden by compute, by kind ("
              + ", ".join(f"{k}: {KIND_LEGEND.get(k, k)}" for k in kinds) + ") + idle (bubble, waits), "
              "on the busiest device", "bubble: the stages' idle share of the pipeline phase",
              "MFU: model FLOP/s over peak"]
    console.print(Text("; ".join(legend), style="dim"))
    columns = [*key_cols, *(Col(header=h) for _, h, _ in MEMORY_PARTS), Col(header="total"),
               Col(header="of", drop=1), Col(header="fits")]
    cells = []
    for r in rows:
        m = r["memory"]
        row = [shown(r[k]) for k, _ in keys] + [_gib(m[p]) for p, _, _ in MEMORY_PARTS]
        row += [_gib(m["total"]), _gib(m["capacity"]), "yes" if r["fits"] else Text("OOM", style="red")]
        cells.append(row)
    console.print(fitted_table(console, columns, cells, title="memory of the fullest device (GiB)", **compact()))
    console.print(Text("; ".join(f"{h}: {text}" for _, h, text in MEMORY_PARTS) + "; of: the device's memory",
                       style="dim"))
    for f in files:
        console.print(f"wrote {markup(f)}")


def _gib(value: int | None) -> str:
    """Bytes as GiB with two decimals (a column of numbers under one unit reads better than mixed units)."""
    return f"{(value or 0) / _GIB:.2f}"


def draw_breakdown(rows: list[dict], path: str, title: str = ""):
    """Two panels, one bar per row: the step's milliseconds (compute, each exposed kind, idle) and the fullest
    device's GiB (parameters ... workspace) against its capacity. Linear axes; each bar's total is written."""
    from testbed.viz.plots import pyplot, save_figure

    plt = pyplot()
    keys, kinds = _keys(rows), comm_kinds(rows)
    labels = [plot_label(" / ".join(str(r[k]) for k, _ in keys), 40) for r in rows]
    height = max(3.4, 0.55 * len(rows) + 2.3)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11.0, height), sharey=True)
    y = list(range(len(rows)))[::-1]
    parts = [("compute", _COMPUTE, [r["compute_s"] for r in rows])]
    parts += [(f"exposed {k}", _KIND_COLOURS[i % len(_KIND_COLOURS)], [r["exposed_by_kind"].get(k, 0.0) for r in rows])
              for i, k in enumerate(kinds)]
    parts += [("idle (bubble, waits)", _IDLE, [r["idle_s"] for r in rows])]
    longest = max(r["step_time_s"] for r in rows)
    unit, scale = ("s", 1.0) if longest >= 10 else ("ms", 1e3)
    _stack(left, y, parts, scale=scale)
    for yi, r in zip(y, rows):
        left.text(r["step_time_s"] * scale, yi, f" {format_time(r['step_time_s'])}, MFU {r['mfu']:.0%}",
                  va="center", fontsize=8)
    left.set_xlabel(f"time per step ({unit})")
    left.set_yticks(y, labels)
    left.set_xlim(0, longest * scale * 1.35)
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8, frameon=False)
    mem = [(p, c, [(r["memory"][p] or 0) for r in rows]) for (p, _, _), c in zip(MEMORY_PARTS, _MEMORY_COLOURS)]
    _stack(right, y, mem, scale=1 / _GIB)
    capacity = max((r["memory"]["capacity"] or 0) for r in rows) / _GIB
    for i, (yi, r) in enumerate(zip(y, rows)):  # each row's own device: topologies differ in memory
        right.plot([(r["memory"]["capacity"] or 0) / _GIB] * 2, [yi - 0.42, yi + 0.42], color="black", linestyle="--",
                   linewidth=1.2, label="device memory" if i == 0 else None)
    for yi, r in zip(y, rows):
        right.text((r["memory"]["total"] or 0) / _GIB, yi, f" {format_bytes(r['memory']['total'] or 0)}"
                   + ("" if r["fits"] else " OOM"), va="center", fontsize=8,
                   bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    right.set_xlabel("memory of the fullest device (GiB)")
    right.set_xlim(0, max(capacity, *((r["memory"]["total"] or 0) / _GIB for r in rows)) * 1.3)
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8, frameon=False)
    for ax in (left, right):
        ax.ticklabel_format(axis="x", style="plain")
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(plot_label(title, 90))
    fig.tight_layout()
    return save_figure(fig, path)


def _stack(ax: Any, y: list[int], parts: list[tuple[str, str, list[float]]], scale: float) -> None:
    """Horizontal bars of ``parts`` stacked left to right (values times ``scale``)."""
    left = [0.0] * len(y)
    for label, colour, values in parts:
        widths = [v * scale for v in values]
        ax.barh(y, widths, left=left, color=colour, label=label, height=0.6)
        left = [a + b for a, b in zip(left, widths)]
