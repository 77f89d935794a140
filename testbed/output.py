"""Safe file output, the inputs it protects, and the result type every command returns.

Files are written to a temporary sibling and renamed into place, so an
interrupted or failed command never leaves a half-written trace, plot or
topology behind. An existing regular file at the path is replaced (keeping
its mode), a symlink is written through, and anything else is refused:
folders, devices, pipes, and the files the command itself read as input.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.errors import InputError
from testbed.fields import read_text
from testbed.lifetime import TEMP_SUFFIX, stale_temporary_files, temporary_prefix

__all__ = ["write_atomic", "atomic_path", "output_target", "output_folder", "command_inputs", "note_input", "read_input", "CommandResult",
           "to_jsonable"]


#: Real paths of the files the running command has read as input (None outside a command).
_INPUTS: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar("testbed_inputs", default=None)


@contextlib.contextmanager
def command_inputs() -> Iterator[None]:
    """Within this block, files read with :func:`read_input` are protected from :func:`atomic_path`."""
    token = _INPUTS.set(frozenset())
    try:
        yield
    finally:
        _INPUTS.reset(token)


def note_input(path: str | Path) -> None:
    """Record ``path`` as an input of the running command (no-op outside :func:`command_inputs`)."""
    inputs = _INPUTS.get()
    if inputs is not None:
        _INPUTS.set(inputs | {os.path.realpath(path)})


def read_input(path: str | Path, what: str = "file") -> str:
    """Read a UTF-8 text input file (:func:`testbed.fields.read_text`: InputError naming it) and record it."""
    text = read_text(path, what)
    note_input(path)
    return text


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _bundled_root(target: Path) -> str | None:
    """What of the installed package ``target`` lies in (its bundled plans, topologies or code), or None."""
    from importlib import resources

    for package, what in (("testbed.plans", "bundled plans"), ("testbed.topologies", "bundled topologies"),
                          ("testbed", "package")):
        try:
            root = os.path.realpath(str(resources.files(package)))
        except (ModuleNotFoundError, TypeError, ValueError):
            continue
        if os.path.isdir(root) and (str(target) == root or str(target).startswith(root + os.sep)):
            return what
    return None


def output_target(path: str | Path, field_name: str = "output") -> Path:
    """The file an output to ``path`` replaces, after the checks that keep outputs from destroying things.

    A symlink is written through (its target is replaced, the link stays);
    an existing folder, device, pipe or socket is refused, as is any file the
    running command read as input (``simulate --plan p.yaml --trace p.yaml``),
    and a missing or non-folder parent. Raises InputError naming the path.
    """
    shown = str(path)
    target = Path(os.path.realpath(path))
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise InputError(f"cannot write `{shown}` ({exc.strerror})", field=field_name) from None
    if mode is not None:
        if stat.S_ISDIR(mode):
            raise InputError(f"`{shown}` is a folder; give a file path", field=field_name)
        if not stat.S_ISREG(mode):
            raise InputError(f"`{shown}` is {_kind(mode)}; outputs are written only to regular files (they would be "
                             f"replaced), give a file path", field=field_name)
        if str(target) in (_INPUTS.get() or ()):
            raise InputError(f"`{shown}` is an input of this command; writing the output there would destroy it, "
                             f"give another path", field=field_name)
    bundled = _bundled_root(target)
    if bundled is not None:
        raise InputError(f"`{shown}` is inside testbed's own {bundled}; outputs never replace the package's "
                         f"files, give a path outside it", field=field_name)
    parent = target.parent
    if not parent.exists():
        raise InputError(f"the folder `{parent}` of `{shown}` does not exist; create it first", field=field_name)
    if not parent.is_dir():
        raise InputError(f"`{parent}` (in `{shown}`) is not a folder", field=field_name)
    return target


def output_folder(path: str | Path, field_name: str = "output") -> Path:
    """A folder a command writes its files into (``demo --out``): created if missing, refused if not a folder."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise InputError(f"`{path}` exists and is not a folder; give a folder path", field=field_name) from None
    except OSError as exc:
        raise InputError(f"cannot create the folder `{path}` ({exc.strerror})", field=field_name) from None
    return folder


@contextlib.contextmanager
def atomic_path(path: str | Path, field_name: str = "output") -> Iterator[Path]:
    """Yield a temporary path beside ``path``'s target; rename it onto the target on success.

    The target is :func:`output_target`'s (symlinks written through; inputs,
    folders and devices refused). An existing file keeps its mode; a new one
    gets the mode a plain ``open()`` would give it. On any error the
    temporary file is removed and the target is untouched.
    """
    target = output_target(path, field_name)
    for stale in stale_temporary_files(target.parent):  # left by a killed write (of any testbed output here)
        with contextlib.suppress(OSError):
            stale.unlink()
    try:
        fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(target.name), suffix=TEMP_SUFFIX, dir=target.parent)
    except OSError as exc:
        raise InputError(f"cannot write in the folder `{target.parent}` ({exc.strerror})", field=field_name) from None
    os.close(fd)
    try:
        if target.exists():
            mode = stat.S_IMODE(target.stat().st_mode)
        else:  # mkstemp creates 0600
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        yield Path(tmp)
        os.replace(tmp, target)
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
