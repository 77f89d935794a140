"""Atomic file output and the result type every command returns.

Files are written to a temporary sibling and renamed into place, so an
interrupted or failed command never leaves a half-written trace, plot or
topology behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.errors import InputError

__all__ = ["write_atomic", "atomic_path", "CommandResult", "to_jsonable"]


@contextlib.contextmanager
def atomic_path(path: str | Path, field_name: str = "output") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` on success."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create the folder {parent} ({exc.strerror})", field=field_name) from None
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix or ".tmp", dir=parent)
    os.close(fd)
    # mkstemp creates 0600; give the file the mode a plain open() would have.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_atomic(path: str | Path, content: str | bytes, field_name: str = "output") -> Path:
    """Write ``content`` to ``path`` atomically; returns the path."""
    with atomic_path(path, field_name) as tmp:
        if isinstance(content, bytes):
            tmp.write_bytes(content)
        else:
            tmp.write_text(content)
    return Path(path)


def to_jsonable(value: Any) -> Any:
    """Plain JSON types from dataclasses, enums, numpy scalars and paths."""
    import dataclasses
    import enum

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value) if not f.name.startswith("_")}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


@dataclass
class CommandResult:
    """What a command produced: the JSON object, a rich rendering, the exit status."""

    data: dict[str, Any]
    render: Callable[[Any], None] | None = None
    exit_code: int = 0
    files: list[str] = field(default_factory=list)

    def json_text(self) -> str:
        return json.dumps(to_jsonable(self.data), indent=None, sort_keys=False, allow_nan=False, default=str)
