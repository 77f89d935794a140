"""Bad bytes at the boundary: every file a user can hand over ends in exit 2 and a short message naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cli import main
from testbed.errors import MAX_MESSAGE, InputError, quote
from testbed.fields import MAX_DEPTH, load_yaml

DEMO = (Path(__file__).resolve().parent.parent / "plans" / "demo.yaml").read_text()
BOMB = "a: &a [1,1,1,1,1,1,1,1,1]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi")) + "name: *i\n"

CASES = {
    "utf16": ("\ufeffname: x\n".encode("utf-16"), "UTF-16"),
    "binary": (bytes(range(128, 256)) * 4, "not UTF-8"),
    "gzip": (b"\x1f\x8b\x08\x00" + bytes(64), "not UTF-8"),
    "alias-bomb": (BOMB.encode(), "expands to more than"),
    "deep": (("a: " + "[" * 1000 + "]" * 1000 + "\n").encode(), f"nested more than {MAX_DEPTH}"),
    "deep-mapping": (("a: " + "{b: " * 500 + "1" + "}" * 500 + "\n").encode(), f"nested more than {MAX_DEPTH}"),
    "duplicate-key": (DEMO.replace("name: demo", "name: demo\nname: again").encode(), "duplicate key"),
    "nan-learning-rate": (DEMO.replace("learning_rate: 1.0e-3", "learning_rate: .nan").encode(), "finite"),
    "inf-learning-rate": (DEMO.replace("learning_rate: 1.0e-3", "learning_rate: .inf").encode(), "finite"),
    "huge-layers": (DEMO.replace("layers: 4", "layers: 1000000000000000000000000000000").encode(), "layers"),
    "unhashable-key": (b"? [a, b]\n: 1\n", "cannot be a key"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_plan_files_exit_2_with_a_short_message(case: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    data, expected = CASES[case]
    path = tmp_path / "plan.yaml"
    path.write_bytes(data)
    assert main(["plan", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(path) in err and expected in err
    assert len(err) < 2 * MAX_MESSAGE


def test_folders_and_over_long_names_are_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "check", str(tmp_path)]) == 2
    assert "is not a file" in capsys.readouterr().err
    long = tmp_path / ("x" * 5000 + ".yaml")
    assert main(["plan", "check", str(long)]) == 2
    err = capsys.readouterr().err
    assert "too long" in err and len(err) < 2 * MAX_MESSAGE


def test_an_alias_bomb_is_refused_before_it_is_expanded(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    with pytest.raises(InputError, match="expands to more than"):
        load_yaml(path)


def test_quote_keeps_values_short() -> None:
    nested: list = [1] * 9
    for _ in range(9):
        nested = [nested] * 9  # 9**10 values when printed whole
    assert len(quote(nested)) < 100 and len(quote("x" * 100_000)) < 100
    assert len(InputError("y" * 100_000, field="f" * 10_000, file="g" * 10_000).render()) < 2 * MAX_MESSAGE
