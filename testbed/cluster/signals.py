"""Leaving cleanly on signals: every signal that ends a process by default becomes an exception, so ``finally``
blocks (removing an emulated cluster) run; critical sections hold them until they end.

:func:`leaving_on_signals` turns SIGINT into KeyboardInterrupt and each of :data:`LEAVING_SIGNALS` into
``SystemExit(128 + N)``; :func:`signals_held` blocks them at the OS for a block (no child inherits a half-done
step) and acts on the first that arrived when the outermost block ends.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

__all__ = ["LEAVING_SIGNALS", "leaving_on_signals", "signals_held"]

#: The signals that end a process by default and that it can catch, other than SIGINT (KeyboardInterrupt) and
#: the faults a program raises itself (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP, SIGSYS).
LEAVING_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM",
                                                     "SIGVTALRM", "SIGPROF", "SIGXCPU", "SIGXFSZ", "SIGPWR", "SIGIO",
                                                     "SIGSTKFLT") if hasattr(signal, n))


class _Held:
    """Critical sections open now (:func:`signals_held`) and the first signal that arrived during them."""

    depth = 0
    pending: int | None = None


def _leave(signum: int) -> None:
    """End the process's current work for signal ``signum``: KeyboardInterrupt for SIGINT, else SystemExit."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and :data:`LEAVING_SIGNALS` held for the block and acted on when it ends.

    Blocked at the OS (so no child inherits a half-done step), and, for a signal Python's C handler caught just
    before, deferred by the handlers of :func:`leaving_on_signals` (Python runs handlers between bytecodes,
    which may fall inside the block).
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, *LEAVING_SIGNALS})
    _Held.depth += 1
    try:
        yield
    finally:
        _Held.depth -= 1
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        if _Held.depth == 0 and _Held.pending is not None:
            signum, _Held.pending = _Held.pending, None
            _leave(signum)


@contextlib.contextmanager
def leaving_on_signals() -> Iterator[None]:
    """Each of :data:`LEAVING_SIGNALS` raises SystemExit(128 + N) here and SIGINT KeyboardInterrupt, so
    ``finally`` blocks run; inside :func:`signals_held` they wait for its end. Outside the main thread, where
    handlers cannot be set, nothing changes."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, *LEAVING_SIGNALS)}

    def leave(signum: int, _frame: object) -> None:
        if _Held.depth:
            _Held.pending = _Held.pending or signum
            return
        _leave(signum)

    for s in previous:
        signal.signal(s, leave)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
