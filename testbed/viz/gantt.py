"""A generic Gantt chart: rows (stages, devices, links) x time, bars with labels and categories.

Used for pipeline schedules (``testbed schedule --gantt``) and for the
simulator's timelines. Bars are coloured by category with a fixed colour map
(F/B/W like the pipeline-parallelism literature: forward blue, input-gradient
backward green, weight-gradient purple) and a legend; idle time inside each
row's extent is hatched so bubbles stand out. The PNG is written atomically.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.errors import InputError
from testbed.text import plot_label
from testbed.viz.plots import pyplot, save_figure

__all__ = ["Bar", "CATEGORY_COLOURS", "draw_gantt", "idle_gaps"]

#: Fixed colours, so one category looks the same in every picture.
CATEGORY_COLOURS: dict[str, str] = {
    "F": "#4e79a7",
    "B": "#59a14f",
    "W": "#b07aa1",
    "compute": "#76b7b2",
    "comm": "#f28e2b",
    "send": "#e15759",
    "bubble": "#d9d9d9",
    "optimizer": "#edc948",
    "host": "#9c755f",
}

_LEGEND_NAMES = {"F": "forward (F + microbatch)", "B": "backward (B + microbatch)",
                 "W": "weight gradient (W + microbatch)", "bubble": "idle (bubble)", "host": "controller dispatch",
                 "compute": "other compute (accumulate, optimizer)", "comm": "collectives", "send": "pipeline sends"}

#: The widest and the least wide a chart is drawn (inches at 120 dpi: 1,920 and 960 pixels), so that it reads at
#: the size it is written; bars too narrow for their label at that width go unlabelled (their colour says F/B/W).
MAX_WIDTH_IN, MIN_WIDTH_IN = 16.0, 8.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Bar:
    """One interval on ``row`` from ``start`` to ``end`` (time units of the chart)."""

    row: int
    start: float
    end: float
    label: str = ""
    category: str = "compute"

    def __post_init__(self) -> None:
        if self.category not in CATEGORY_COLOURS:
            raise InputError(f"unknown category `{self.category}`; valid: {', '.join(CATEGORY_COLOURS)}",
                             field="category")
        if not self.end >= self.start:
            raise InputError(f"bar ends ({self.end}) before it starts ({self.start})", field="end")


def idle_gaps(bars: Sequence[Bar], rows: int, until: float | None = None) -> list[Bar]:
    """``bubble`` bars for the idle time of each row between 0 and ``until`` (default: the last end)."""
    busy = [b for b in bars if b.category != "bubble"]
    horizon = max((b.end for b in busy), default=0.0) if until is None else until
    gaps: list[Bar] = []
    tolerance = 1e-9 * max(horizon, 1e-30)
    by_row: dict[int, list[Bar]] = {r: [] for r in range(rows)}
    for b in busy:
        by_row[b.row].append(b)
    for r in range(rows):
        t = 0.0
        for b in sorted(by_row[r], key=lambda b: b.start):
            if b.start > t + tolerance:
                gaps.append(Bar(row=r, start=t, end=b.start, category="bubble"))
            t = max(t, b.end)
        if horizon > t + tolerance:
            gaps.append(Bar(row=r, start=t, end=horizon, category="bubble"))
    return gaps


def draw_gantt(rows: Sequence[str], bars: Sequence[Bar], path: str | Path, *, title: str = "",
               time_unit: str = "", show_idle: bool = True, note: str = "") -> Path:
    """Draw ``bars`` on ``rows`` (top to bottom) and write a PNG atomically to ``path``.

    Args:
        rows: row names, e.g. ``["stage 0", "stage 1"]``; ``Bar.row`` indexes them.
        bars: the intervals; labels are printed inside bars wide enough to hold them.
        title: figure title.
        time_unit: x-axis unit, e.g. ``"s"`` or ``"ms"`` (empty: arbitrary units).
        show_idle: hatch idle gaps of every row (pipeline bubbles).
        note: a line under the time axis (what a row stands for).
    """
    for b in bars:
        if not 0 <= b.row < len(rows):
            raise InputError(f"bar row {b.row} is outside the {len(rows)} rows", field="row")
    plt = pyplot()
    horizon = max((b.end for b in bars), default=1.0) or 1.0
    all_bars = list(bars) + (idle_gaps(bars, len(rows), horizon) if show_idle else [])
    # Wide enough that the shortest bar holds its label (~0.1 inch per character at font size 7).
    shortest = min((b.end - b.start for b in bars if b.end > b.start and b.category != "bubble"), default=horizon)
    longest_label = max((len(b.label) for b in bars), default=1)
    width = min(MAX_WIDTH_IN, max(MIN_WIDTH_IN, 2.5 + horizon / shortest * 0.1 * (longest_label + 1.5)))
    fig, ax = plt.subplots(figsize=(width, 0.5 * len(rows) + 1.8))
    # Character budget: a label fits if its bar is wider than ~0.7 em of the axes at this size.
    char_width = horizon / (width * 72 / 7.0)
    used = _draw_bars(ax, all_bars, len(rows))
    _draw_labels(ax, bars, len(rows), char_width)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([plot_label(row, 40) for row in reversed(list(rows))])
    ax.set_xlim(0, horizon)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel(f"time ({time_unit})" if time_unit else "time (units of --costs)")
    ax.ticklabel_format(axis="x", style="plain", useOffset=False)
    ax.grid(axis="x", alpha=0.25)
    if note:
        ax.annotate(plot_label(note, 200), xy=(0, 0), xycoords="axes fraction", xytext=(0, -34),
                    textcoords="offset points", fontsize=8, color="#555555", va="top")
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)
    _draw_legend(ax, used)
    if title:
        ax.set_title(plot_label(title, 160))
    return save_figure(fig, path)


def _draw_bars(ax: Any, bars: Sequence[Bar], rows: int) -> list[str]:
    """Draw ``bars`` (idle gaps hatched), one ``broken_barh`` call per (row, category): drawing bar by bar is far
    too slow for simulator timelines with thousands of spans. The categories drawn, in first-seen order."""
    used: list[str] = []
    groups: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for b in bars:
        groups.setdefault((b.row, b.category), []).append((b.start, b.end - b.start))
        if b.category not in used:
            used.append(b.category)
    for (row, category), spans in groups.items():
        colour = CATEGORY_COLOURS[category]
        y = rows - 1 - row
        if category == "bubble":
            ax.broken_barh(spans, (y - 0.4, 0.8), facecolors="white", edgecolors=colour, hatch="///", linewidth=0.0)
        else:
            ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=colour, edgecolors="white", linewidth=0.6)
    return used


def _draw_labels(ax: Any, bars: Sequence[Bar], rows: int, char_width: float) -> None:
    """At most 2,000 labels: along a bar where it fits, else across it when the bar is a character wide and the
    label short (rows are 0.5 inch: 0.4 of bar holds about 6 characters)."""
    shown = 0
    for b in bars:
        if not b.label or shown >= 2000:
            continue
        span, across = b.end - b.start, len(b.label) <= 6
        if span > char_width * (len(b.label) + 0.5) or (across and span > char_width * 1.3):
            rotation = 0 if span > char_width * (len(b.label) + 0.5) else 90
            ax.text((b.start + b.end) / 2, rows - 1 - b.row, plot_label(b.label), ha="center", va="center",
                    fontsize=7 if rotation == 0 else 6, color="white", rotation=rotation)
            shown += 1


def _draw_legend(ax: Any, used: Sequence[str]) -> None:
    """The legend of the ``used`` categories, in :data:`CATEGORY_COLOURS`' order, right of the axes."""
    from matplotlib.patches import Patch

    handles = []
    order = list(CATEGORY_COLOURS)
    for category in sorted(used, key=order.index):
        colour = CATEGORY_COLOURS[category]
        name = _LEGEND_NAMES.get(category, category)
        if category == "bubble":
            handles.append(Patch(facecolor="white", edgecolor=colour, hatch="///", label=name))
        else:
            handles.append(Patch(facecolor=colour, label=name))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
