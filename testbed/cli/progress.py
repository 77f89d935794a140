"""The commands' one progress bar: rich, on stderr, so that stdout stays clean for ``--json``."""

from __future__ import annotations

from typing import Any

__all__ = ["progress_bar"]


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
