"""Names users give are shown as text: escapes, markup and long names, in tables, messages, plots and JSON."""

from __future__ import annotations

import io
import json
import time

import pytest
import yaml
from rich.console import Console

from testbed.cli import main
from testbed.errors import InputError
from testbed.text import NAME_LIMIT, elide, escape_controls, markup, plot_label, shown

ESC = "\x1b"
#: A name with an escape sequence, rich markup, an emoji code, matplotlib mathematics and a bidi override.
HOSTILE = f"x{ESC}[31m[/bold][red]:cat:$\\alpha$\u202e\u0007"
LONG = "L" * 15_000 + "middle" + "R" * 15_000
NAME = HOSTILE + "L" * 100 + "middle" + "R" * 100  # plan names are at most 256 characters

TOPO = {"name": f"topo{ESC}]0;title{ESC}\\[/]", "description": f"desc {ESC}[2J [bold]",
        "device": {"name": f"dev{ESC}[5m", "flops": {"fp32": "1TFLOP/s"}, "memory": "16GB",
                   "memory_bandwidth": "1TB/s"},
        "levels": [{"name": f"node[/i]{ESC}c", "size": 8, "bandwidth": "100GB/s", "latency": "1us",
                    "kind": "nvswitch"}]}


def _plan(name: str) -> dict:
    return {"name": name, "model": {"layers": 2, "d_model": 64, "heads": 4, "d_ff": 256, "seq_len": 32, "vocab": 256},
            "batch": {"global_batch": 16, "microbatches": 2}, "mesh": {"data": 2, "tensor": 2, "stage": 2}}


def test_escape_controls_covers_c0_c1_bidi_and_surrogates():
    text = f"a{ESC}b\nc\td\x85e\u202ef\udcffg\x7f"
    out = escape_controls(text)
    assert out == "a\\x1bb\\nc\\td\\x85e\\u202ef\\udcffg\\x7f"
    assert all(c.isprintable() for c in out)
    assert escape_controls(out) == out  # escaped text is left alone
    assert escape_controls("naïve ünïcode → ok") == "naïve ünïcode → ok"


def test_elide_keeps_both_ends_within_the_limit():
    assert elide("short") == "short"
    out = elide("abcdefghijklmnopqrstuvwxyz", 9)
    assert len(out) == 9 and out.startswith("abcd") and out.endswith("wxyz") and "…" in out
    assert shown(LONG).startswith("L") and shown(LONG).endswith("R") and len(shown(LONG)) == NAME_LIMIT
    with pytest.raises(ValueError):
        elide("abc", 2)


def test_shown_is_linear_in_the_name_length():
    """A 30,000-character name and one 100 times longer cost about the same (both are cut before the work)."""
    def cost(name: str) -> float:
        start = time.perf_counter()
        for _ in range(20):
            markup(name)
            plot_label(name)
        return time.perf_counter() - start

    small, large = ("[a\\" * 10_000), ("[a\\" * 1_000_000)
    cost(small)
    assert cost(large) < 50 * cost(small) + 0.5  # quadratic work would be 10,000x


def test_markup_prints_literally_and_plot_label_escapes_dollars():
    console = Console(file=io.StringIO(), width=200, color_system=None, emoji=False)
    for name in ("[/bold]", "[bold]x[/]", "a\\", "x\\[b]", HOSTILE, "[/]" * 50):
        console.print(f"[bold]{markup(name)}[/bold]")
    out = console.file.getvalue().splitlines()
    assert out[0] == "[/bold]" and out[1] == "[bold]x[/]" and out[2] == "a\\" and out[3] == "x\\[b]"
    assert ESC not in console.file.getvalue() and "[/bold][red]" in out[4]
    assert plot_label("a$b$c") == "a\\$b\\$c"


def test_input_error_escapes_control_characters():
    err = InputError(f"unknown topology `{ESC}[31mred`", field=f"f{ESC}", file=f"p{ESC}.yaml")
    assert ESC not in err.render() and "\\x1b[31mred" in err.render()
    assert len(InputError("x" * 1_000_000).render()) <= 600


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


@pytest.fixture
def hostile_files(tmp_path):
    plan = tmp_path / "plan.yaml"
    topo = tmp_path / "topo.yaml"
    plan.write_text(yaml.safe_dump(_plan(NAME)))
    topo.write_text(yaml.safe_dump(TOPO))
    return str(plan), str(topo)


@pytest.mark.parametrize("argv", [
    ["simulate", "--plan", "{plan}", "--topology", "{topo}"],
    ["compare", "--plan", "{plan}", "--topology", "{topo}", "{topo}"],
    ["plan", "check", "{plan}", "--topology", "{topo}"],
    ["memory", "--plan", "{plan}", "--topology", "{topo}"],
    ["topology", "show", "{topo}"],
    ["collective", "all_reduce", "--topology", "{topo}", "--bytes", "1MiB"],
])
def test_hostile_names_in_tables_messages_and_json(argv, hostile_files, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    plan, topo = hostile_files
    argv = [a.format(plan=plan, topo=topo) for a in argv]
    assert main(argv) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert ESC not in text and "\u202e" not in text and "\x07" not in text
    assert "🐱" not in text  # `:cat:` stays text
    assert "L" * 100 not in text and "middle" not in text  # the long name is elided in the middle
    if argv[0] in ("simulate", "plan", "memory", "compare"):
        assert "[/bold][red]:cat:" in text  # markup printed literally
    if argv[0] == "topology":
        assert "node[/i]\\x1bc" in text and "dev\\x1b[5m" in text
    assert main([*argv, "--json"]) == 0
    raw = capsys.readouterr().out
    assert ESC not in raw
    data = json.loads(raw)  # JSON keeps names whole, escaped by JSON itself
    strings = set(_strings(data))
    assert TOPO["name"] in strings and (argv[0] in ("topology", "collective") or NAME in strings)


def test_hostile_names_in_errors(tmp_path, capsys):
    missing = str(tmp_path / f"no{ESC}[31m[/bold].yaml")
    assert main(["simulate", "--plan", missing]) == 2
    err = capsys.readouterr().err
    assert ESC not in err and "\\x1b[31m[/bold]" in err
    assert main([f"sim{ESC}late"]) == 2
    assert ESC not in capsys.readouterr().err


def test_hostile_names_in_plots(hostile_files, tmp_path, capsys):
    """Titles, legends, tick labels: matplotlib neither reads `$...$` as mathematics nor warns of missing glyphs."""
    plan, topo = hostile_files
    assert main(["compare", "--plan", plan, "--topology", topo, topo, "--png", str(tmp_path / "c.png")]) == 0
    assert main(["simulate", "--plan", plan, "--topology", topo, "--gantt", str(tmp_path / "g.png")]) == 0
    assert main(["topology", "show", topo, "--png", str(tmp_path / "t.png")]) == 0
    assert all((tmp_path / f).stat().st_size > 1000 for f in ("c.png", "g.png", "t.png"))
    assert ESC not in capsys.readouterr().out
