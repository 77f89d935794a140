"""A user's `--program`: every exception it raises is one paragraph naming it (exit 2), it runs within
`--timeout`, and the working directory leaves sys.path when it is done."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from testbed.cli.main import main
from testbed.cli.user_code import describe
from testbed.interpreter import python_argv, python_env

USER = textwrap.dedent("""\
    import time

    class Odd(Exception):
        def __str__(self):
            raise RuntimeError("no text for you")

    def exits(mesh):
        raise SystemExit(3)

    def exits_text(mesh):
        raise SystemExit("bye")

    def interrupts(mesh):
        raise KeyboardInterrupt

    def generator_exit(mesh):
        raise GeneratorExit

    def odd(mesh):
        raise Odd()

    def spins(mesh):
        while True:
            pass

    def sleeps(mesh):
        time.sleep(1000)

    def stubborn(mesh):
        while True:
            try:
                time.sleep(1000)
            except BaseException:
                pass
    """)


def _bad(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.fixture
def module(tmp_path: Path) -> Path:
    path = tmp_path / "user_prog.py"
    path.write_text(USER)
    return path


@pytest.mark.parametrize("function, words", [("exits", "SystemExit: exit status 3"), ("exits_text", "SystemExit: bye"),
                                             ("interrupts", "KeyboardInterrupt"),
                                             ("generator_exit", "GeneratorExit"),
                                             ("odd", "Odd: (its message could not be made")])
def test_every_kind_of_exception_is_one_paragraph(module: Path, function: str, words: str,
                                                  capsys: pytest.CaptureFixture) -> None:
    err = _bad(["simulate", "--program", f"{module}:{function}", "--topology", "dgx-h100"], capsys)
    assert f"{function}' raised {words}" in err and "(while being called with the mesh" in err


def test_an_import_that_exits_is_one_paragraph(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "exits_on_import.py").write_text("raise SystemExit(5)\n")
    err = _bad(["simulate", "--program", f"{tmp_path / 'exits_on_import.py'}:f", "--topology", "dgx-h100"], capsys)
    assert "raised SystemExit: exit status 5 (while being imported)" in err


@pytest.mark.parametrize("function", ["spins", "sleeps"])
def test_a_hanging_program_stops_at_its_time_limit(module: Path, function: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    err = _bad(["simulate", "--program", f"{module}:{function}", "--topology", "dgx-h100", "--timeout", "0.5"],
               capsys)
    assert "ran past its time limit of 0.5 s" in err and "--timeout" in err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_bad_timeout_is_refused(module: Path, value: str, capsys: pytest.CaptureFixture) -> None:
    assert "--timeout" in _bad(["simulate", "--program", f"{module}:spins", "--topology", "dgx-h100",
                                "--timeout", value], capsys)


@pytest.mark.slow  # the watchdog's grace period (10 s) passes
def test_a_program_that_swallows_the_alarm_is_ended_by_the_watchdog(module: Path) -> None:
    out = subprocess.run(python_argv("-m", "testbed.cli", "simulate", "--program", f"{module}:stubborn",
                                     "--topology", "dgx-h100", "--timeout", "0.5"), capture_output=True, text=True,
                         timeout=120, env=python_env())
    assert out.returncode == 2 and "ran past its time limit" in out.stderr and "Traceback" not in out.stderr


def test_the_working_directory_leaves_sys_path_after_a_dotted_program(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dotted_user.py").write_text("def f(mesh):\n    return 42\n")
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    _bad(["simulate", "--program", "dotted_user:f", "--topology", "dgx-h100"], capsys)
    assert sys.path == before  # neither the working directory nor "" stays


def test_describe_survives_any_exception() -> None:
    class Loud(Exception):
        def __str__(self):
            raise SystemExit(9)

    assert describe(Loud()).startswith("Loud: (its message could not be made")
    assert describe(SystemExit(None)) == "SystemExit: exit status None"
