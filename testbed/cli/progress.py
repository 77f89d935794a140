"""The commands' one progress display, on stderr so that stdout stays clean for ``--json``.

On a terminal it is a transient rich progress bar (with ``eta``, the time
left). When stderr is not a terminal (a CI log, ``2> log``, a pipe) a bar
would print nothing until the end, so long commands (``search``, ``sweep``,
``calibrate``, ``validate``, ``run``, ``verify``) write plain progress lines
instead: ``VERB description: done/total (NN%), elapsed[, about N s left]``
at most once every :data:`LINE_INTERVAL_S` seconds, plus a last line when a
task completes; with ``heartbeat`` a line also comes every interval while
one long call (a compile) gives no updates. The time left is the task's
elapsed time over its done share, times what is left of it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from testbed.text import shown

__all__ = ["progress_bar", "phase_progress", "LineProgress", "LINE_INTERVAL_S"]

#: Seconds between two progress lines when stderr is not a terminal.
LINE_INTERVAL_S = 5.0


def progress_bar(verb: str = "measuring", eta: bool = False, heartbeat: bool = False) -> Any:
    """A progress display on stderr: a rich bar on a terminal, else :class:`LineProgress` lines.

    With ``eta`` the bar's last column (and each line) estimates the time remaining; with ``heartbeat`` lines
    come every :data:`LINE_INTERVAL_S` even while no update arrives (the bar's elapsed column ticks anyway).
    """
    if not sys.stderr.isatty():
        return LineProgress(verb, sys.stderr, eta=eta, heartbeat=heartbeat)
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

    def __init__(self, verb: str, stream: TextIO, interval_s: float = LINE_INTERVAL_S, clock=time.monotonic,
                 eta: bool = False, heartbeat: bool = False):
        self._verb, self._stream, self._interval, self._clock = verb, stream, interval_s, clock
        self._eta, self._heartbeat = eta, heartbeat
        self._tasks: list[dict[str, Any]] = []
        self._started = self._last = clock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "LineProgress":
        if self._heartbeat:
            self._thread = threading.Thread(target=self._beat, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return None

    def _beat(self) -> None:
        """Write the unfinished task updated last whenever an interval passes without a line."""
        while not self._stop.wait(self._interval / 5):
            with self._lock:
                now = self._clock()
                open_tasks = [t for t in self._tasks if not t["finished"]]
                if open_tasks and now - self._last >= self._interval:
                    self._last = now
                    self._write(max(open_tasks, key=lambda t: t["touched"]), now)

    def add_task(self, description: str, total: float | None = None, **_: Any) -> int:
        with self._lock:
            self._tasks.append({"description": description, "total": total, "completed": 0, "finished": False,
                                "started": self._clock(), "touched": self._clock()})
            return len(self._tasks) - 1

    def update(self, task: int, *, description: str | None = None, completed: float | None = None,
               total: float | None = None, advance: float | None = None, **_: Any) -> None:
        with self._lock:
            self._update(self._tasks[task], description, completed, total, advance)

    def _update(self, t: dict[str, Any], description: str | None, completed: float | None, total: float | None,
                advance: float | None) -> None:
        if description is not None:
            t["description"] = description
        if total is not None:
            t["total"] = total
        if completed is not None:
            t["completed"] = completed
        if advance is not None:
            t["completed"] += advance
        now = self._clock()
        t["touched"] = now
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
        left = ""
        if self._eta and t["total"] and 0 < t["completed"] < t["total"]:
            spent = now - t["started"]
            left = f", about {spent * (t['total'] - t['completed']) / t['completed']:.0f} s left"
        self._stream.write(f"{self._verb}{label}: {count}, {now - self._started:.0f} s{left}\n")
        self._stream.flush()


def phase_progress(bar: Any, labels: Mapping[str, str]) -> Callable[..., None]:
    """A ``progress(phase, done, total, left_s=None)`` callback (the search's, the runner's) showing each phase as a
    task of ``bar``, described by ``labels[phase]`` (else the phase's own name) and, where the caller estimates it
    (the search: testbed.explore.eta), the time left."""
    from testbed.units import format_time

    tasks: dict[str, Any] = {}

    def progress(phase: str, done: int, total: int, left_s: float | None = None) -> None:
        label = labels.get(phase, phase)
        if left_s is not None and done < total:
            label += f", about {format_time(left_s)} left"
        if phase not in tasks:
            tasks[phase] = bar.add_task(label, total=total)
        bar.update(tasks[phase], completed=done, total=total, description=label)

    return progress
