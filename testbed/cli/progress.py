"""The commands' one progress display, on stderr so that stdout stays clean for ``--json``.

On a terminal it is a transient rich progress bar. When stderr is not a
terminal (a CI log, ``2> log``, a pipe) a bar would print nothing until the
end, so long commands (``search``, ``sweep``, ``calibrate``, ``validate``)
write plain progress lines instead: ``VERB description: done/total (NN%),
elapsed`` at most once every :data:`LINE_INTERVAL_S` seconds, plus a last
line when a task completes.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from testbed.text import shown

__all__ = ["progress_bar", "LineProgress", "LINE_INTERVAL_S"]

#: Seconds between two progress lines when stderr is not a terminal.
LINE_INTERVAL_S = 5.0


def progress_bar(verb: str = "measuring", eta: bool = False) -> Any:
    """A progress display on stderr: a rich bar on a terminal, else :class:`LineProgress` lines.

    With ``eta`` the bar's last column estimates the time remaining (``testbed sweep``).
    """
    if not sys.stderr.isatty():
        return LineProgress(verb, sys.stderr)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns: list[Any] = [TextColumn(f"[bold]{verb}[/] {{task.description}}"), BarColumn(),
                          TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn()]
    if eta:
        columns += [TextColumn("ETA"), TimeRemainingColumn()]
    return Progress(*columns, console=Console(stderr=True), transient=True)


class LineProgress:
    """The part of ``rich.progress.Progress`` the commands use, written as occasional plain lines.

    Descriptions are the commands' own (they use rich markup for the bar), shown here as text: markup
    is not interpreted, control characters are escaped.
    """

    def __init__(self, verb: str, stream: TextIO, interval_s: float = LINE_INTERVAL_S, clock=time.monotonic):
        self._verb, self._stream, self._interval, self._clock = verb, stream, interval_s, clock
        self._tasks: list[dict[str, Any]] = []
        self._started = self._last = clock()

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, **_: Any) -> int:
        self._tasks.append({"description": description, "total": total, "completed": 0, "finished": False})
        return len(self._tasks) - 1

    def update(self, task: int, *, description: str | None = None, completed: float | None = None,
               total: float | None = None, advance: float | None = None, **_: Any) -> None:
        t = self._tasks[task]
        if description is not None:
            t["description"] = description
        if total is not None:
            t["total"] = total
        if completed is not None:
            t["completed"] = completed
        if advance is not None:
            t["completed"] += advance
        now = self._clock()
        done = t["total"] is not None and t["completed"] >= t["total"] > 0
        if (done and not t["finished"]) or now - self._last >= self._interval:
            t["finished"] = done
            self._last = now
            self._write(t, now)

    def _write(self, t: dict[str, Any], now: float) -> None:
        from rich.errors import MarkupError
        from rich.text import Text

        description = t["description"]
        try:
            description = Text.from_markup(description).plain
        except MarkupError:  # not markup after all: shown as it is
            pass
        count = f"{t['completed']:g}"
        if t["total"]:
            count += f"/{t['total']:g} ({100 * t['completed'] / t['total']:.0f}%)"
        label = f" {shown(description, 80)}" if description else ""
        self._stream.write(f"{self._verb}{label}: {count}, {now - self._started:.0f} s\n")
        self._stream.flush()
