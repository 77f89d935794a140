"""Running a user's own code (``--program module:function``): a time limit, every exception one paragraph.

:func:`user_code` is the scope the user's module is imported and called
in: its folder on ``sys.path`` for the scope only (``sys.path`` is restored
after, so a stray ``./matplotlib.py`` is not imported later by testbed's own
``--gantt``), what it prints sent to stderr (stdout is testbed's report or
its ``--json``), and a time limit: SIGALRM raises :class:`ProgramTimedOut` in
the main thread after ``timeout_s``, and where that cannot land (a call that
blocks in C, or code that catches BaseException) a watchdog thread ends the
process with exit status 2 and the same paragraph ``GRACE_S`` later.

:func:`reported` turns whatever the user's code raises into an InputError
(exit 2, one paragraph naming the function): ``SystemExit(N)``,
``GeneratorExit``, a ``KeyboardInterrupt`` raised by the code itself, an
exception whose ``__str__`` raises. A real Ctrl-C (SIGINT) still stops the
command as everywhere else (status 130).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
from collections.abc import Iterator

from testbed.errors import InputError, quote

__all__ = ["DEFAULT_TIMEOUT_S", "GRACE_S", "ProgramTimedOut", "user_code", "reported", "describe", "check_timeout"]

#: ``--timeout``'s default: seconds for importing, calling and tracing a user's program.
DEFAULT_TIMEOUT_S = 600.0
#: Seconds after the limit before the watchdog ends a process whose code did not stop at the SIGALRM.
GRACE_S = 10.0


class ProgramTimedOut(BaseException):
    """The user's code ran past its time limit (a BaseException, so ``except Exception`` in it does not stop it)."""


class _Interrupted:
    """Whether a real SIGINT arrived inside the scope (set by its handler)."""

    seen = False


def check_timeout(value: float) -> float:
    """``--timeout`` if it is a finite number of seconds > 0, else InputError."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise InputError(f"must be a finite number of seconds > 0, got {value}", field="--timeout")
    return float(value)


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, even one whose ``__str__`` raises or returns a non-string."""
    name = type(exc).__name__
    try:
        text = str(exc)
    except BaseException:  # noqa: BLE001 - a user's __str__ may raise anything
        text = "(its message could not be made: its __str__ raised)"
    if isinstance(exc, SystemExit):
        text = f"exit status {exc.code!r}" if not isinstance(exc.code, str) else exc.code
    head, marker, trace = text.partition("Traceback (most recent call last):")
    if marker:  # a message carrying a traceback (JAX's error from a host callback): its last line, what was raised
        lines = [line for line in trace.splitlines() if line.strip()]
        text = f"{head.strip()} {lines[-1].strip() if lines else ''}"
    text = " ".join(text.split())
    return f"{name}: {text}" if text else name


@contextlib.contextmanager
def reported(spec: str, what: str) -> Iterator[None]:
    """Whatever the user's code raises in the block, as one InputError naming ``spec`` and ``what`` it was doing
    (a real Ctrl-C passes)."""
    try:
        yield
    except InputError:
        raise
    except ProgramTimedOut as exc:
        raise InputError(str(exc.args[0]), field="--program") from None
    except BaseException as exc:  # noqa: BLE001 - SystemExit, GeneratorExit, KeyboardInterrupt: the user's code
        if isinstance(exc, KeyboardInterrupt) and _Interrupted.seen:
            raise
        raise InputError(f"{quote(spec)} raised {describe(exc)} (while {what})", field="--program") from None


def _timed_out_message(spec: str, timeout_s: float) -> str:
    return (f"{quote(spec)} ran past its time limit of {timeout_s:g} s (importing, calling and tracing it); give "
            "--timeout SECONDS for more")


@contextlib.contextmanager
def user_code(spec: str, folder: str | None, timeout_s: float) -> Iterator[None]:
    """The scope the user's code runs in: ``folder`` first on ``sys.path`` and the time limit, both undone after."""
    saved_path = list(sys.path)
    if folder is not None:
        sys.path.insert(0, folder)
    message = _timed_out_message(spec, timeout_s)
    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(timeout_s + GRACE_S):
            sys.stderr.write(f"error: field `--program`: {message}\n")
            sys.stderr.flush()
            os._exit(2)

    threading.Thread(target=watchdog, daemon=True, name="testbed-program-watchdog").start()
    main = threading.current_thread() is threading.main_thread()
    if main:
        previous = {signal.SIGALRM: signal.getsignal(signal.SIGALRM), signal.SIGINT: signal.getsignal(signal.SIGINT)}

        def alarm(_signum: int, _frame: object) -> None:
            raise ProgramTimedOut(message)

        def interrupt(_signum: int, _frame: object) -> None:
            _Interrupted.seen = True
            raise KeyboardInterrupt

        _Interrupted.seen = False
        hook = sys.unraisablehook  # an alarm landing in a callback Python cannot raise from (JAX's gc callback)
        sys.unraisablehook = lambda u: None if isinstance(u.exc_value, ProgramTimedOut) else hook(u)
        signal.signal(signal.SIGALRM, alarm)
        signal.signal(signal.SIGINT, interrupt)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the user's prints: testbed's stdout (its --json) stays its own
            yield
    except ProgramTimedOut as exc:  # the alarm landed in testbed's own code between the user's calls
        raise InputError(str(exc.args[0]), field="--program") from None
    finally:
        done.set()
        if main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for s, handler in previous.items():
                signal.signal(s, handler)
            sys.unraisablehook = hook
        sys.path[:] = saved_path
