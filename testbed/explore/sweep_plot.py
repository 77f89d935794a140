"""Pictures of a sweep database: curves over the device count and Pareto fronts (PNG, written atomically).

- ``step_time_vs_devices.png``: step time against devices, one curve per
  series (a series is one assignment of the grid keys that do not set the
  device count: ``topology.levels.cluster.bandwidth = 800Gb/s``), log-log;
- ``step_time_vs_memory.png``: step time against memory per device, every
  valid point and the Pareto front;
- ``step_time_vs_cost.png`` (when priced): step time against dollars per
  step, every point and the Pareto front;
- ``tokens_per_dollar_vs_devices.png`` (when priced);
- ``step_time_by_field.png``: step time against each swept field, one panel
  per field (small multiples), every point and the fastest fitting one per
  value joined; numbers on a linear axis in order, other values (bandwidths,
  names) in the grid's order.

Axes on a log scale carry plain tick labels (``0.5``, ``2``), not powers of ten.

Points over device memory (``fits`` false) are drawn hollow and kept off
the fronts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testbed.explore.sweep import pareto_front
from testbed.output import output_folder
from testbed.text import plot_label
from testbed.viz.plots import pyplot, save_figure

__all__ = ["plot_sweep", "series_label", "DEVICE_KEYS"]

#: Grid keys that set the device count (the x axis, not a series).
DEVICE_KEYS = ("topology.nodes", "topology.devices", "topology.node_size")


def series_label(row: dict[str, Any]) -> str:
    """The row's sweep and its grid assignment without the device-count keys (``400Gb/s``)."""
    params = {k: v for k, v in json.loads(row["params"]).items() if k not in DEVICE_KEYS}
    body = ", ".join(f"{k.split('.')[-1] if k.count('.') > 1 else k}={v}" for k, v in params.items())
    return body or row["sweep"]


def _group(rows: list[dict]) -> dict[str, list[dict]]:
    sweeps = {r["sweep"] for r in rows}
    out: dict[str, list[dict]] = {}
    for r in rows:
        label = series_label(r)
        if len(sweeps) > 1:
            label = f"{r['sweep']}: {label}"
        out.setdefault(label, []).append(r)
    return out


def _front(ax, rows: list[dict], x: str, scale: float, label: str = "Pareto front") -> None:
    front = pareto_front([r for r in rows if r.get("fits")], x)
    if front:
        ax.step([r[x] * scale for r in front], [r["step_time_s"] for r in front], where="post", color="black",
                linewidth=1.2, zorder=3, label=label)


def _scatter(ax, groups: dict[str, list[dict]], x: str, scale: float) -> None:
    for i, (label, rows) in enumerate(groups.items()):
        colour = f"C{i % 10}"
        fit = [r for r in rows if r.get("fits")]
        over = [r for r in rows if not r.get("fits")]
        ax.scatter([r[x] * scale for r in fit], [r["step_time_s"] for r in fit], color=colour, s=22, label=label)
        if over:
            ax.scatter([r[x] * scale for r in over], [r["step_time_s"] for r in over], facecolors="none",
                       edgecolors=colour, s=22)


def plot_sweep(rows: list[dict[str, Any]], folder: str | Path, title: str = "") -> list[Path]:
    """Draw the sweep's PNGs into ``folder`` (created if missing); returns the files written."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("step_time_s")]
    out_dir = output_folder(folder, "--plot")
    plt = pyplot()
    groups = _group(ok)
    written: list[Path] = []
    sweeps = sorted({r["sweep"] for r in rows})
    title = title or (sweeps[0] if len(sweeps) == 1 else "")
    suffix = f" ({len(ok)} points)" + (f": {title}" if title else "")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, rs) in enumerate(groups.items()):
        best: dict[int, dict] = {}
        for r in rs:  # the fastest fitting point per device count is the curve
            if r.get("fits") and (r["devices"] not in best or r["step_time_s"] < best[r["devices"]]["step_time_s"]):
                best[r["devices"]] = r
        xs = sorted(best)
        ax.plot(xs, [best[d]["step_time_s"] for d in xs], marker="o", color=f"C{i % 10}", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    written.append(_finish(fig, ax, "devices", "step time (s)", "step time vs devices" + suffix, "both", out_dir / "step_time_vs_devices.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    _scatter(ax, groups, "memory_bytes", 1 / 2**30)
    _front(ax, ok, "memory_bytes", 1 / 2**30)
    ax.set_yscale("log")
    written.append(_finish(fig, ax, "memory per device (GiB)", "step time (s)", "step time vs memory" + suffix, "major", out_dir / "step_time_vs_memory.png"))

    priced = [r for r in ok if r.get("dollars_per_step")]
    if priced:
        pgroups = _group(priced)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _scatter(ax, pgroups, "dollars_per_step", 1.0)
        _front(ax, priced, "dollars_per_step", 1.0)
        for r in priced:
            ax.annotate(str(r["devices"]), (r["dollars_per_step"], r["step_time_s"]), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_yscale("log")
        written.append(_finish(fig, ax, "dollars per step (labels: devices)", "step time (s)", "step time vs cost" + suffix, "both", out_dir / "step_time_vs_cost.png"))

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, (label, rs) in enumerate(pgroups.items()):
            rs = sorted((r for r in rs if r.get("fits")), key=lambda r: r["devices"])
            ax.plot([r["devices"] for r in rs], [r["tokens_per_dollar"] for r in rs], marker="o",
                    color=f"C{i % 10}", label=label)
        ax.set_xscale("log", base=2)
        written.append(_finish(fig, ax, "devices", "tokens per dollar", "tokens per dollar vs devices" + suffix, "both", out_dir / "tokens_per_dollar_vs_devices.png"))
    fields = list(dict.fromkeys(k for r in ok for k in json.loads(r["params"])))
    if fields:
        written.append(_by_field(ok, fields, "step time by swept field" + suffix, out_dir / "step_time_by_field.png"))
    return written


def _by_field(rows: list[dict], fields: list[str], title: str, path: Path) -> Path:
    """One panel per swept field: every point's step time at its value, the fastest fitting one per value joined."""
    plt = pyplot()
    cols = min(3, len(fields))
    nrows = -(-len(fields) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows + 0.6), squeeze=False)
    for ax, field in zip(axes.flat, fields):
        values = [json.loads(r["params"]).get(field) for r in rows]
        order = list(dict.fromkeys(v for v in values if v is not None))
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in order)
        if numeric:
            order = sorted(order)
        where = {v: (v if numeric else i) for i, v in enumerate(order)}
        xs = [where[v] for v in values if v is not None]
        ys = [r["step_time_s"] for r, v in zip(rows, values) if v is not None]
        fits = [bool(r.get("fits")) for r, v in zip(rows, values) if v is not None]
        ax.scatter([x for x, f in zip(xs, fits) if f], [y for y, f in zip(ys, fits) if f], s=14, color="C0",
                   alpha=0.6, label="points")
        ax.scatter([x for x, f in zip(xs, fits) if not f], [y for y, f in zip(ys, fits) if not f], s=14,
                   facecolors="none", edgecolors="C3", label="over memory")
        best = {}
        for x, y, f in zip(xs, ys, fits):
            if f and (x not in best or y < best[x]):
                best[x] = y
        ax.plot(sorted(best), [best[x] for x in sorted(best)], color="black", marker="o", markersize=4,
                label="fastest")
        if not numeric:
            ax.set_xticks(range(len(order)), [plot_label(str(v), 14) for v in order], rotation=20, ha="right")
        ax.set_xlabel(plot_label(field, 40))
        ax.set_ylabel("step time (s)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(fields):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(plot_label(title, 120), fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def _finish(fig, ax, xlabel: str, ylabel: str, title: str, grid: str, path: Path) -> Path:
    """Label, grid and legend one chart, and write it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(plot_label(title, 120), fontsize=10)
    ax.grid(True, which=grid, alpha=0.3)
    from matplotlib.ticker import FuncFormatter, NullFormatter

    for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
        if scale == "log":  # plain numbers (0.5, 2, 1024), not 5x10^-1
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(NullFormatter())
    handles, labels = ax.get_legend_handles_labels()  # series labels hold the SPEC's names and grid values
    if labels:  # an empty database draws no series (and needs no legend)
        ax.legend(handles, [plot_label(label, 80) for label in labels], fontsize=8)
    return save_figure(fig, path)
