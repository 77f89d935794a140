"""The command layer: every ``testbed`` subcommand, and the only code that may import ``testbed.runner``.

Library code (the rest of ``testbed``, the runner included) never imports
this package; commands import ``testbed.runner`` lazily, inside functions, so that
``testbed`` stays fast and JAX starts only after the device count is set.

:func:`main` is the console entry point. Importing this package (and the
``testbed`` package above it) loads nothing else, so Ctrl-C at any moment of
a command, its first imports included, lands inside :func:`main`'s handler:
``interrupted`` on stderr and exit status 130, never a traceback.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

__all__ = ["main", "COMMANDS"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``testbed`` command (:func:`testbed.cli.main.main`); Ctrl-C anywhere in it is exit 130."""
    try:
        from testbed.cli.main import main as run

        return run(argv)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while reporting the first is ignored
        sys.stderr.write("interrupted\n")
        sys.stderr.flush()
        return 130


def __getattr__(name: str):
    if name == "COMMANDS":
        from testbed.cli.main import COMMANDS

        return COMMANDS
    raise AttributeError(f"module 'testbed.cli' has no attribute {name!r}")
