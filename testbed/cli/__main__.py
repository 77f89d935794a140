"""``python -m testbed.cli``: the ``testbed`` command."""

from testbed.cli.main import command

command()
