"""Run one fuzz case in a forked child held to a time and a memory limit (issue 40: 60 s, 4 GB per case).

The child's address space may grow by ``memory_gib`` over what it inherits
from the fuzzer (``resource.setrlimit(RLIMIT_AS)``; an allocation past it is
a MemoryError inside the case); the parent kills a child still running at
twice the time limit plus ten seconds (the case's own alarm fires at the
limit). The result comes back pickled through a pipe. Where ``os.fork`` is
missing, the call runs in this process.
"""

from __future__ import annotations

import os
import pickle
import resource
import select
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["isolated"]

T = TypeVar("T")


def _address_space() -> int:
    """Bytes of address space this process maps now (Linux VmSize; 0 where unknown)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def isolated(call: Callable[[], T], time_limit: float, memory_gib: float) -> T | str:
    """``call()`` in a forked child within the limits: its (picklable) result, or why there is none."""
    if not hasattr(os, "fork"):
        return call()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: limits, the call, its result down the pipe, and out without any cleanup
        try:
            os.close(read)
            limit = _address_space() + int(memory_gib * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            result = call()
            with os.fdopen(write, "wb") as pipe:
                pickle.dump(result, pipe)
        finally:
            os._exit(0)
    os.close(write)
    data = _read_until(read, 2 * time_limit + 10)
    if data is None:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if data is None:
        return f"over time: still running after {2 * time_limit + 10:.0f} s"
    if not data:
        if os.WIFSIGNALED(status):
            return f"the case's process died of signal {os.WTERMSIG(status)}"
        return f"the case's process exited with status {os.WEXITSTATUS(status)} and no result"
    try:
        return pickle.loads(data)
    except (pickle.UnpicklingError, EOFError):
        return "the case's result was cut off"


def _read_until(fd: int, seconds: float) -> bytes | None:
    """Everything written to ``fd`` until its writer closes it, or None past ``seconds``."""
    chunks, end = [], time.monotonic() + seconds
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)
