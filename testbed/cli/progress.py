"""The commands' one progress bar: rich, on stderr, so that stdout stays clean for ``--json``."""

from __future__ import annotations

from typing import Any

__all__ = ["progress_bar"]


def progress_bar(verb: str = "measuring") -> Any:
    """A transient rich progress bar on stderr: ``VERB description  bar  done/total  elapsed``."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn(f"[bold]{verb}[/] {{task.description}}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)
