"""Outputs never destroy files: inputs, symlinks, devices, folders; modes kept; folders checked."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from testbed.cli import main
from testbed.errors import InputError
from testbed.output import atomic_path, command_inputs, note_input, write_atomic

DEMO = Path(__file__).resolve().parent.parent / "plans" / "demo.yaml"


@pytest.fixture
def plan(tmp_path: Path) -> Path:
    path = tmp_path / "mine.yaml"
    path.write_text(DEMO.read_text())
    return path


def test_a_plan_used_as_its_own_trace_survives(plan: Path, capsys: pytest.CaptureFixture) -> None:
    before = plan.read_bytes()
    assert main(["simulate", "--plan", str(plan), "--trace", str(plan)]) == 2
    assert plan.read_bytes() == before
    err = capsys.readouterr().err
    assert "is an input of this command" in err and "mine.yaml" in err and "Traceback" not in err


def test_an_input_reached_through_a_symlink_is_protected_too(plan: Path) -> None:
    link = plan.parent / "alias.json"
    link.symlink_to(plan)
    before = plan.read_bytes()
    assert main(["simulate", "--plan", str(plan), "--gantt", str(link)]) == 2
    assert plan.read_bytes() == before and link.is_symlink()


def test_a_symlinked_output_is_written_through(plan: Path) -> None:
    target = plan.parent / "real.json"
    link = plan.parent / "link.json"
    link.symlink_to(target.name)
    assert main(["simulate", "--plan", str(plan), "--trace", str(link)]) == 0
    assert link.is_symlink() and os.readlink(link) == target.name
    assert target.stat().st_size > 0 and target.read_text().startswith("{")


def test_non_regular_files_and_folders_are_refused(plan: Path, capsys: pytest.CaptureFixture) -> None:
    fifo = plan.parent / "pipe"
    os.mkfifo(fifo)
    assert main(["simulate", "--plan", str(plan), "--trace", str(fifo)]) == 2
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert "named pipe" in capsys.readouterr().err
    assert main(["simulate", "--plan", str(plan), "--trace", "/dev/null"]) == 2
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert main(["simulate", "--plan", str(plan), "--trace", str(plan.parent)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_a_missing_folder_is_named(plan: Path, capsys: pytest.CaptureFixture) -> None:
    missing = plan.parent / "nowhere" / "trace.json"
    assert main(["simulate", "--plan", str(plan), "--trace", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "nowhere" in err and "does not exist" in err
    assert not missing.parent.exists()


def test_an_existing_file_is_replaced_keeping_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "out.txt"
    path.write_text("old")
    path.chmod(0o640)
    write_atomic(path, "new")
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]  # no temporary file left behind


def test_a_failed_write_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("interrupted")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_inputs_are_protected_only_inside_a_command(tmp_path: Path) -> None:
    path = tmp_path / "in.yaml"
    path.write_text("x")
    note_input(path)  # outside a command: nothing is recorded
    write_atomic(path, "y")
    with command_inputs():
        note_input(path)
        with pytest.raises(InputError, match="input of this command"):
            write_atomic(path, "z")
    assert path.read_text() == "y"
