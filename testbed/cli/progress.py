"""The commands' one progress bar: rich, on stderr, so that stdout stays clean for ``--json``."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["progress_bar", "progress_lines"]


def progress_bar(verb: str = "measuring", eta: bool = False) -> Any:
    """A transient rich progress bar on stderr: ``VERB description  bar  done/total  elapsed``.

    With ``eta`` a last column estimates the time remaining (``testbed sweep``).
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns: list[Any] = [TextColumn(f"[bold]{verb}[/] {{task.description}}"), BarColumn(),
                          TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn()]
    if eta:
        columns += [TextColumn("ETA"), TimeRemainingColumn()]
    return Progress(*columns, console=Console(stderr=True), transient=True)


def progress_lines(verb: str, every_s: float = 5.0, stream: TextIO | None = None,
                   clock: Callable[[], float] = time.monotonic) -> Callable[[str, int, int], None]:
    """A ``(label, done, total)`` callback that writes a plain line to ``stream`` (stderr) at most every
    ``every_s`` seconds, and on each label's last item, when ``stream`` is not a terminal.

    A rich bar draws nothing when stderr is a pipe or a file, so a long command in CI or over ssh would be
    silent; these lines (``searching: analytic 1,234/65,610 (12 s)``) say it is alive and how far it is.
    On a terminal the callback does nothing: the bar shows the same.
    """
    out = sys.stderr if stream is None else stream
    quiet = hasattr(out, "isatty") and out.isatty()
    start = clock()
    last = [start - every_s]

    def report(label: str, done: int, total: int) -> None:
        now = clock()
        if quiet or (now - last[0] < every_s and done < total):
            return
        last[0] = now
        out.write(f"{verb}: {label} {done:,}/{total:,} ({now - start:.0f} s)\n")
        out.flush()

    return report
