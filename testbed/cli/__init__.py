"""The command layer: every ``testbed`` subcommand, and the only code that may import ``testbed.runner``.

Library code (the rest of ``testbed``, the runner included) never imports
this package; commands import ``testbed.runner`` lazily, inside functions, so that
``testbed`` stays fast and JAX starts only after the device count is set.
Importing this package loads little (``testbed`` itself is lazy), so Ctrl-C
at any moment of a command, its first imports included, lands in
:func:`main`'s handler: ``interrupted`` on stderr, exit 130, no traceback.
"""

from testbed.cli.main import COMMANDS, command, main

__all__ = ["main", "command", "COMMANDS"]
