"""The testbed command: simulate, search and run distributed training plans.

``testbed`` alone prints the command list (exit 0); ``testbed --version`` the
version. Each subcommand lives in a module that exposes ``add_arguments(parser)`` and
``execute(args) -> CommandResult``; this file only wires them to argparse,
prints the result (a rich rendering, or one JSON object with ``--json``) and
maps errors to exit statuses: 0 success, 1 a check failed, 2 bad input.
Commands that execute plans live in ``testbed.runner`` and are imported lazily so
``testbed`` stays fast and JAX starts only after the device count is set.
"""

from __future__ import annotations

import argparse
import importlib
import re
import signal
import sys
from collections.abc import Sequence

# Nothing of testbed is imported here at module level: `testbed` starts, and its Ctrl-C handler is in
# place, before any heavy import (main() imports the rest).

__all__ = ["main", "COMMANDS"]

#: name -> (module, help). Modules under ``testbed.runner`` are imported only when used.
COMMANDS: dict[str, tuple[str, str]] = {
    "topologies": ("testbed.cli.basic:topologies", "list the bundled topologies"),
    "topology": ("testbed.cli.basic:topology", "show one topology (summary, links, drawing)"),
    "presets": ("testbed.cli.presets:presets", "list the model presets: full configuration, default batch, source"),
    "plan": ("testbed.cli.basic:plan", "check a plan against a topology and show its placement"),
    "memory": ("testbed.cli.memory", "per-device memory breakdown of a plan"),
    "collective": ("testbed.cli.collective", "time a collective on a topology"),
    "cluster": ("testbed.cli.cluster", "build, remove or list an emulated cluster (network namespaces, shaped links)"),
    "schedule": ("testbed.cli.schedule", "build a pipeline schedule, its bubble and Gantt chart"),
    "simulate": ("testbed.cli.simulate:simulate", "simulate one training step of a plan on a topology"),
    "compare": ("testbed.cli.compare:compare", "plans side by side (--plans, --vary) or a plan on several topologies: time and memory breakdowns"),
    "search": ("testbed.cli.search:search", "search the best layout of a model on a topology (analytic + DES)"),
    "sweep": ("testbed.cli.sweep:sweep", "a grid over plan and topology fields into a DuckDB database, with Pareto plots"),
    "run": ("testbed.cli.run:run", "execute a plan with JAX and time its steps"),
    "verify": ("testbed.cli.run:verify", "check a plan's parallel step against a single-device reference"),
    "calibrate": ("testbed.cli.calibrate:calibrate", "measure this machine and fit a topology's calibration"),
    "validate": ("testbed.cli.validate:validate", "predicted vs measured step time and memory for plans"),
    "check-sharding": ("testbed.cli.check_sharding", "lower a plan's step on its full mesh with abstract devices: shardings, collectives per axis"),
    "demo": ("testbed.cli.demo", "run the default job end to end: check, predict, run, verify, compare"),
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad usage as exit 2 with a closest-match hint, no traceback."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if "invalid choice:" in message:
            bad = message.split("invalid choice:")[1].split("(")[0].strip().strip("'\"")
            from testbed.errors import closest

            hint = closest(bad, COMMANDS)
            if hint:
                message += f"; did you mean `{hint}`?"
        self.print_usage(sys.stderr)
        sys.stderr.write(f"error: {_clip_usage(message)}\n")
        raise SystemExit(2)


def _clip_usage(message: str) -> str:
    """argparse's message with each quoted value cut to 60 characters and the whole to MAX_MESSAGE."""
    from testbed.errors import MAX_MESSAGE
    from testbed.text import escape_controls

    message = escape_controls(message[: 4 * MAX_MESSAGE])
    message = re.sub(r"'([^']{60})[^']+'", r"'\1...'", message)
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "..."


def _load(spec: str):
    module_name, _, attr = spec.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with ``only`` set, import just that command's module."""
    from testbed import __version__

    parser = _Parser(prog="testbed", description=__doc__.splitlines()[0],
                     epilog="`testbed COMMAND --help` describes a command's options.")
    parser.add_argument("--version", action="version", version=f"testbed {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (spec, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        if only is None or only == name:
            try:
                command = _load(spec)
            except ModuleNotFoundError as exc:
                if exc.name and exc.name.startswith("testbed"):
                    p.set_defaults(_missing=exc.name)
                    continue
                raise
            command.add_arguments(p)
            p.set_defaults(_command=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``testbed ARGV``; returns the exit status. Ctrl-C anywhere in it is status 130, never a traceback."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while reporting the first is ignored
        sys.stderr.write("interrupted\n")
        sys.stderr.flush()
        return 130


def command() -> None:
    """The ``testbed`` command (console script, ``python -m testbed.cli``): :func:`main`'s status as the process's,
    with Ctrl-C ignored from main's return to the interpreter's exit, where a SIGINT in CPython's shutdown
    (``threading._shutdown``) prints "Exception ignored ... KeyboardInterrupt" with a traceback."""
    status = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise SystemExit(status)


def _main(argv: Sequence[str] | None) -> int:
    from testbed.errors import InputError
    from testbed.output import CommandResult, command_inputs
    from testbed.text import escape_controls

    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=first if first in COMMANDS else None)
    if not argv:  # `testbed` alone: the command list, as a request for help rather than a usage error
        parser.print_help(sys.stdout)
        return 0
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # bad usage (2) or --help (0): a status, in-process callers get it returned too
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 2
    if getattr(args, "_missing", None):
        sys.stderr.write(f"error: `testbed {args.command}` is not available in this build "
                         f"({escape_controls(args._missing)} missing)\n")
        return 2
    try:
        with command_inputs():  # files the command reads are never overwritten by its outputs
            result: CommandResult = args._command.execute(args)
    except InputError as exc:
        sys.stderr.write(f"error: {exc.render()}\n")
        return 2
    if args.json:
        sys.stdout.write(result.json_text() + "\n")
    elif result.render is not None:
        from rich.console import Console

        result.render(Console(emoji=False))  # `:name:` in a user's name stays text
    sys.stdout.flush()
    return result.exit_code

