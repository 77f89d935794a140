"""The command line and environment of every Python process testbed starts: nothing from the working directory.

Python puts the working directory (``-m``, ``-c``) first on ``sys.path``, so a
``json.py`` in the directory a command is started from would run inside every
worker and probe, as root under ``testbed cluster``. Children are started
instead with ``-P`` (``sys.flags.safe_path``: no working directory, no
script directory; Python 3.11+, the project's minimum) and
``PYTHONSAFEPATH=1`` (so their own Python children keep it), and with an
explicit ``PYTHONPATH``: the folder this ``testbed`` package was imported
from, then the absolute folders of the caller's ``PYTHONPATH`` (its empty
and relative entries would name the working directory again, so they are
dropped), then ``extra`` folders a caller adds on purpose (a user's program's
own folder, where the user named that program). ``-P`` rather than ``-I``:
isolated mode ignores ``PYTHONPATH``, the variable that carries the
project's location to a child.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["project_root", "python_argv", "python_env", "safe_pythonpath"]


def project_root() -> Path:
    """The folder the ``testbed`` package was imported from (a checkout, or site-packages)."""
    import testbed

    return Path(testbed.__file__).resolve().parent.parent


def safe_pythonpath(current: str | None, extra: Sequence[str | os.PathLike] = ()) -> str:
    """``PYTHONPATH`` for a child: the project's folder, ``current``'s absolute entries, then ``extra``."""
    entries = [str(project_root())]
    for entry in (current or "").split(os.pathsep):
        if entry and os.path.isabs(entry) and entry not in entries:
            entries.append(entry)
    for entry in extra:
        text = str(Path(entry).resolve())
        if text not in entries:
            entries.append(text)
    return os.pathsep.join(entries)


def python_argv(*args: str) -> list[str]:
    """``[python, -P, *args]``: this interpreter, without the working directory on ``sys.path``."""
    return [sys.executable, "-P", *args]


def python_env(base: Mapping[str, str] | None = None, extra: Sequence[str | os.PathLike] = ()) -> dict[str, str]:
    """``base`` (default ``os.environ``) with ``PYTHONSAFEPATH=1`` and :func:`safe_pythonpath`."""
    env = dict(os.environ if base is None else base)
    env["PYTHONSAFEPATH"] = "1"
    env["PYTHONPATH"] = safe_pythonpath(env.get("PYTHONPATH"), extra)
    return env
