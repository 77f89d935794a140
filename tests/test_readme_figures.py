"""The figures README.md quotes from commands are the code's current output.

Every ``$ testbed ...`` line in README's code blocks is either run here and its quoted output lines
compared with what the command prints now, or listed in UNCHECKED with the reason (a measurement of a
host, a user's own file, minutes of search). The comparison is exact on the text, ignoring table borders
and spacing: the simulator and the models are deterministic, so no tolerance is needed. README marks what
it adds to an output line with three spaces then ``(`` or ``#`` (``   (worst of 2 stages)``), and lines of
its own with a leading ``… ``; both are left out of the comparison.
"""

from __future__ import annotations

import re
import shlex

import pytest

from testbed.cli import main
from test_readme import README, fenced_blocks  # noqa: E402 (tests/ is on the path)

#: Commands README shows without their output being checked here, and why.
UNCHECKED = {
    "plan check bad.yaml": "a user's broken file, not in the repository (tests/test_cli.py checks such errors)",
    "search --model gpt-1b-cluster": "minutes of search on 2 cores: test_search_figures (slow) checks it",
    "sweep": "writes a database and plots; its figures live in docs/explore.md",
    "run": "a measurement of this host (step times vary with its load)",
    "verify": "a measurement of this host",
    "calibrate": "a measurement of this host",
    "validate": "a measurement of this host",
}

#: Options that only write files: left out when a command is run here.
_OUTPUT_OPTIONS = ("--png", "--gantt", "--trace", "--out", "--plot")

_ANNOTATION = re.compile(r"\s{3,}[(#].*$")
_BORDERS = re.compile(r"[\u2500-\u257f]")


def _normal(text: str) -> str:
    return " ".join(_BORDERS.sub(" ", text).split())


def readme_commands() -> list[tuple[str, list[str]]]:
    """(command after ``$ testbed``, the output lines README quotes under it) for every command shown."""
    out: list[tuple[str, list[str]]] = []
    for _, _, body in fenced_blocks(README.read_text()):
        for line in body.splitlines():
            if line.startswith("$ testbed "):
                out.append((line[len("$ testbed "):], []))
            elif out and not line.startswith("$ "):
                out[-1][1].append(line)
            elif line.startswith("$ "):
                out.append(("", []))  # another program's command: its lines are not testbed's
    return [c for c in out if c[0]]


def _argv(command: str) -> list[str]:
    command = re.sub(r"\s+#.*$", "", command)  # a comment
    command = re.sub(r"\[[^\]]*\]", "", command)  # optional arguments shown in brackets
    words, argv = shlex.split(command), []
    while words:
        word = words.pop(0)
        if word in _OUTPUT_OPTIONS:
            if words and not words[0].startswith("-"):
                words.pop(0)
            continue
        argv.append(word)
    return argv


def _unchecked(command: str) -> str | None:
    return next((why for prefix, why in UNCHECKED.items() if command.startswith(prefix)), None)


def _checked() -> list[tuple[str, list[str]]]:
    return [(c, lines) for c, lines in readme_commands() if _unchecked(c) is None]


def test_every_readme_command_is_checked_or_says_why_not():
    commands = readme_commands()
    assert len(commands) >= 12
    assert len(_checked()) >= 9
    shown = {prefix for prefix in UNCHECKED if any(c.startswith(prefix) for c, _ in commands)}
    assert shown == set(UNCHECKED), f"UNCHECKED names commands README no longer shows: {set(UNCHECKED) - shown}"


@pytest.mark.parametrize("command,quoted", _checked(), ids=[c.split(" --")[0] for c, _ in _checked()])
def test_quoted_output_is_the_current_output(command, quoted, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # tables whole, as README quotes them
    assert main(_argv(command)) == 0
    actual = _normal(capsys.readouterr().out)
    for line in quoted:
        if line.lstrip().startswith("…") or not line.strip():
            continue
        expected = _normal(_ANNOTATION.sub("", line))
        assert expected in actual, f"README quotes `{line.strip()}` under `testbed {command}`; now:\n{actual}"


def test_bundled_topology_count():
    from testbed.topology.io import bundled_names

    counts = re.findall(r"… (\d+) bundled in all", README.read_text())
    assert counts == [str(len(bundled_names()))]


def test_demo_block_predictions_are_the_simulator_s():
    """The demo block is a dated run (its measured figures are that host's); its predictions are checked."""
    from testbed.plan.io import load_plan
    from testbed.sim.graph.engine import simulate
    from testbed.topology.io import load_topology
    from testbed.units import format_time

    block = next(body for heading, _, body in fenced_blocks(README.read_text()) if "Demo" in heading)
    report = simulate(load_plan("demo"), load_topology("host-cpu-8")).report
    assert f"predicted step {format_time(report.step_time_s)}, MFU {report.mfu:.1%}" in block
    step_row = next(line for line in block.splitlines() if _normal(line).startswith("step time "))
    assert _normal(step_row).split()[2:4] == format_time(report.step_time_s).split()


@pytest.mark.slow
def test_search_figures():
    """The search block: its counts, its best plan and the plan as written."""
    command, quoted = next((c, lines) for c, lines in readme_commands() if c.startswith("search --model"))
    from testbed.cli.main import build_parser

    args = build_parser(only="search").parse_args(_argv(command))
    data = args._command.execute(args).data
    text = _normal("\n".join(quoted))
    assert f"{data['enumerated']} plans, {data['pruned_memory']} over memory, " in text
    assert f"{data['pruned_bound']} too slow to replay by their step floor, {data['estimated']} estimated" in text
    assert f", {data['replayed']} replayed" in text  # the rate per minute between them is this host's
    assert f"{data['replayed']} replayed ({data['replays_stopped']} stopped once slower than the best 3)" in text
    from testbed.units import format_time

    assert f"the plan as written: {format_time(data['baseline_step_time_s'])} per step" in text
    best = data["ranked"][0]
    assert _normal(f"1 {best['data']}.{best['fsdp']}.{best['tensor']}.{best['stage']} {best['schedule']} "
                   f"{best['microbatches']} {best['zero']} {best['remat']} {format_time(best['step_time_s'])} "
                   f"{format_time(best['exposed_comm_s'])}") in text
