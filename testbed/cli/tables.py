"""The commands' tables: identifying columns whole at any width, secondary columns dropped first.

A user types or compares the identifying column of a table (a topology's
name, a parameter's path, a sweep point's parameters); rich, left alone,
shrinks every column evenly when the terminal is narrow and cuts that very
column with ``…``. :func:`fitted_table` instead keeps identifying columns
whole (never wrapped, never cut) and, while the table is wider than the
console, drops the secondary columns in the order the command ranked them,
saying under the table which were hidden (``--json`` has them all). Cells
are plain text: a ``str`` cell is never read as rich markup, and control
characters in it are escaped (:mod:`testbed.text`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from testbed.text import escape_controls

__all__ = ["Col", "fitted_table", "compact"]

#: Width a table is measured at to learn its natural width (no column shrunk).
_UNBOUNDED = 100_000

#: Columns a wrapping key column keeps before secondary columns are dropped for it.
WRAPPED_KEY_WIDTH = 30


@dataclass(frozen=True, slots=True, kw_only=True)
class Col:
    """A table column: its header, whether it identifies the row, when it may be dropped.

    ``key`` columns are shown whole (no ellipsis) and never dropped; with
    ``wrap`` a key column (a list of ``k=v`` parameters) may wrap between
    words, given at least :data:`WRAPPED_KEY_WIDTH` columns, but no word is
    cut. ``drop`` > 0 marks a secondary column: at narrow widths the highest
    ``drop`` goes first. Other columns stay and wrap if they must.
    """

    header: str
    key: bool = False
    wrap: bool = False
    drop: int = 0
    justify: str = "right"

    def __post_init__(self) -> None:
        if self.key and self.drop:
            raise ValueError(f"column {self.header!r}: an identifying column is never dropped")
        if self.wrap and not self.key:
            raise ValueError(f"column {self.header!r}: wrap applies to identifying columns only")
        if self.justify not in ("left", "right", "center"):
            raise ValueError(f"column {self.header!r}: justify must be left, right or center, got {self.justify!r}")


def compact() -> dict[str, Any]:
    """``Table`` arguments for light borders (a rule under the header, no edges) that fit 80 columns."""
    from rich import box

    return {"box": box.SIMPLE_HEAD, "show_edge": False, "pad_edge": False, "padding": (0, 1, 0, 0)}


def _cell(value: Any) -> Any:
    from rich.text import Text

    if isinstance(value, str):
        return Text(escape_controls(value))
    return value  # a rich renderable the command styled itself (Text("OOM", style="red"))


def _width(text: str, words: bool) -> int:
    from rich.cells import cell_len

    return max((cell_len(w) for w in text.split()), default=0) if words else cell_len(text)


def _build(columns: Sequence[Col], rows: Sequence[Sequence[Any]], keep: Sequence[int], table_kwargs: dict,
           measuring: bool = False):
    """The table of the ``keep`` columns; ``measuring``: wrapping keys at the width they are granted."""
    from rich.table import Table

    table = Table(**table_kwargs)
    for i in keep:
        col = columns[i]
        if col.key:
            texts = [r[i] for r in rows if isinstance(r[i], str)]
            width = max([_width(col.header, col.wrap), *(_width(t, col.wrap) for t in texts)])
            if not col.wrap:
                table.add_column(col.header, justify=col.justify, no_wrap=True, min_width=width)
                continue
            natural = max([_width(col.header, False), *(_width(t, False) for t in texts)])
            granted = max(width, min(natural, WRAPPED_KEY_WIDTH))
            table.add_column(col.header, justify=col.justify, min_width=width, overflow="fold",
                             max_width=granted if measuring else None)
        else:
            table.add_column(col.header, justify=col.justify, overflow="fold")
    for r in rows:
        table.add_row(*(_cell(r[i]) for i in keep))
    return table


def _natural_width(console, table) -> int:
    return console.measure(table, options=console.options.update_width(_UNBOUNDED)).maximum


def fitted_table(console, columns: Sequence[Col], rows: Sequence[Sequence[Any]], **table_kwargs: Any):
    """A rich Table of ``rows`` that fits ``console.width`` by dropping secondary columns, keys kept whole.

    Returns the table; when columns were dropped, its caption names them.
    ``table_kwargs`` go to ``rich.table.Table`` (title, box, padding).
    """
    if any(len(r) != len(columns) for r in rows):
        raise ValueError(f"every row needs {len(columns)} cells")
    keep = list(range(len(columns)))
    droppable = sorted((i for i, c in enumerate(columns) if c.drop > 0), key=lambda i: (-columns[i].drop, -i))
    dropped: list[str] = []
    while droppable and _natural_width(console, _build(columns, rows, keep, table_kwargs, True)) > console.width:
        i = droppable.pop(0)
        keep.remove(i)
        dropped.append(columns[i].header)
    table = _build(columns, rows, keep, table_kwargs)
    if dropped:
        table.caption_justify = "left"
        table.caption = f"hidden at this width: {', '.join(dropped)} (a wider terminal or --json shows them)"
    return table
