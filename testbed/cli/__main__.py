"""``python -m testbed.cli``: the ``testbed`` command."""

import sys

from testbed.cli.main import main

sys.exit(main())
