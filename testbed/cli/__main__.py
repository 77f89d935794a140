"""``python -m testbed.cli``: the ``testbed`` command."""

import sys

from testbed.cli import main

sys.exit(main())
