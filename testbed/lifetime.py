"""Processes that do not outlive the process that started them, and temporary files a kill left behind.

A launcher or a sweep that is SIGKILLed cannot stop its children, so each
child stops itself: :func:`die_with_parent` asks Linux for a parent-death
signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)`` through ctypes) and, as a
fallback where that is unavailable or the parent died before the request,
starts a watchdog thread that exits the process when its parent's pid is no
longer its parent. :func:`stale_temporary_files` finds the hidden files of
atomic writes (:func:`testbed.output.atomic_path`) whose writer is gone;
:func:`remove_stale_folders` the scratch folders of a killed launcher.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

__all__ = ["die_with_parent", "TEMP_SUFFIX", "temporary_prefix", "stale_temporary_files", "remove_stale_folders"]

_PR_SET_PDEATHSIG = 1
#: Suffix of every temporary file an atomic write creates: ``.NAME.PID.RANDOM.testbed-tmp``.
TEMP_SUFFIX = ".testbed-tmp"
_TEMP = re.compile(r"^\..+\.(\d+)\.[^.]+" + re.escape(TEMP_SUFFIX) + "$")


def _parent_death_signal() -> bool:
    """Ask the kernel to SIGKILL this process when its parent thread exits (Linux only); True if set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int, direct: bool, period: float) -> None:
    while True:
        if (os.getppid() != parent) if direct else not _alive(parent):
            os._exit(137)
        time.sleep(period)


def die_with_parent(parent: int, period: float = 0.5) -> None:
    """Make this process exit when process ``parent`` (its parent, or an ancestor) dies, however it dies.

    Both guards are installed: where ``parent`` is the direct parent, the
    parent-death signal (immediate); and a daemon thread polling every
    ``period`` seconds, which exits when the direct parent's pid changes (an
    orphan is re-parented) or, with a wrapper in between (``ip netns exec``
    that forks), when ``parent`` no longer runs. A parent already gone before
    the call exits this process at once.
    """
    direct = os.getppid() == parent
    if direct:
        _parent_death_signal()
    if (os.getppid() != parent) if direct else not _alive(parent):
        os._exit(137)
    threading.Thread(target=_watch, args=(parent, direct, period), daemon=True, name="testbed-parent-watch").start()


def temporary_prefix(target_name: str) -> str:
    """The name prefix of an atomic write's temporary file for ``target_name`` (hidden, names the writer)."""
    return f".{target_name}.{os.getpid()}."


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def stale_temporary_files(folder: Path) -> list[Path]:
    """Temporary files of atomic writes in ``folder`` whose writing process no longer runs (a kill left them)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    stale = []
    for name in names:
        match = _TEMP.match(name)
        if match and not _alive(int(match.group(1))):
            path = folder / name
            if path.is_file() and not path.is_symlink():
                stale.append(path)
    return stale


def remove_stale_folders(parent: Path, prefix: str) -> int:
    """Remove the folders ``PREFIX<pid>-*`` in ``parent`` whose process no longer runs; how many were removed.

    A SIGKILLed launcher cannot remove its scratch folder (``testbed-launch-<pid>-...``); the next one does.
    """
    import shutil

    removed = 0
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return 0
    for entry in entries:
        pid, _, rest = entry.name.removeprefix(prefix).partition("-")
        if (entry.name.startswith(prefix) and pid.isdigit() and rest and not _alive(int(pid))
                and entry.is_dir(follow_symlinks=False)):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
    return removed
