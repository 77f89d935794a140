"""A user's `--program`: every exception it raises is one paragraph naming it (exit 2), it runs within
`--timeout`, and the working directory leaves sys.path when it is done."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from testbed.cli.main import main
from testbed.cli.user_code import describe
from testbed.interpreter import python_argv, python_env

from helpers import refused

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
    err = refused(["simulate", "--program", f"{module}:{function}", "--topology", "dgx-h100"], capsys)
    assert f"{function}' raised {words}" in err and "(while being called with the mesh" in err


def test_an_import_that_exits_is_one_paragraph(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "exits_on_import.py").write_text("raise SystemExit(5)\n")
    err = refused(["simulate", "--program", f"{tmp_path / 'exits_on_import.py'}:f", "--topology", "dgx-h100"], capsys)
    assert "raised SystemExit: exit status 5 (while being imported)" in err


@pytest.mark.parametrize("function", ["spins", "sleeps"])
def test_a_hanging_program_stops_at_its_time_limit(module: Path, function: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    err = refused(["simulate", "--program", f"{module}:{function}", "--topology", "dgx-h100", "--timeout", "0.5"],
                  capsys)
    assert "ran past its time limit of 0.5 s" in err and "--timeout" in err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_bad_timeout_is_refused(module: Path, value: str, capsys: pytest.CaptureFixture) -> None:
    assert "--timeout" in refused(["simulate", "--program", f"{module}:spins", "--topology", "dgx-h100",
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
    refused(["simulate", "--program", "dotted_user:f", "--topology", "dgx-h100"], capsys)
    assert sys.path == before  # neither the working directory nor "" stays


def test_describe_survives_any_exception() -> None:
    class Loud(Exception):
        def __str__(self):
            raise SystemExit(9)

    assert describe(Loud()).startswith("Loud: (its message could not be made")
    assert describe(SystemExit(None)) == "SystemExit: exit status None"


EDGES = textwrap.dedent("""\
    import sys
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback
    from jax.sharding import NamedSharding, PartitionSpec as P

    CALLS = []

    def _loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    def _args(mesh):
        return (jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P())),
                jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P("data"))))

    def raw_pmap(mesh):
        step = jax.pmap(lambda w, x: jax.lax.pmean(jax.grad(_loss)(w, x), "i"), axis_name="i")
        return step, (jax.ShapeDtypeStruct((8, 64, 64), jnp.float32), jax.ShapeDtypeStruct((8, 4, 64), jnp.float32))

    def echo(a):
        return a

    def pure(mesh):
        def step(w, x):
            y = jax.pure_callback(echo, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
            return jax.grad(_loss)(w, y)
        return jax.jit(step), _args(mesh)

    def log_it(a):
        return None

    def impure(mesh):
        def step(w, x):
            io_callback(log_it, None, x, ordered=True)
            return jax.grad(_loss)(w, x)
        return jax.jit(step), _args(mesh)

    def chatty(mesh):
        print("hello from the user's function")
        def step(w, x):
            print("tracing the user's step")
            return jax.grad(_loss)(w, x)
        return jax.jit(step), _args(mesh)

    def exits_while_traced(mesh):
        def step(w, x):
            sys.exit(4)
        return jax.jit(step), _args(mesh)

    def interrupted_while_traced(mesh):
        def step(w, x):
            raise KeyboardInterrupt
        return jax.jit(step), _args(mesh)

    def counted(mesh):
        CALLS.append(mesh)
        print(f"call {len(CALLS)} with {type(mesh).__name__}", file=sys.stderr)
        return jax.jit(jax.grad(_loss)), _args(mesh)
    """)


@pytest.fixture
def edges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The module above as a relative path (messages quote a spec in full up to 80 characters)."""
    (tmp_path / "user_edges.py").write_text(EDGES)
    monkeypatch.chdir(tmp_path)
    return Path("user_edges.py")


def _simulate(module: Path, function: str, topology: str, *extra: str) -> list[str]:
    return ["simulate", "--program", f"{module}:{function}", "--topology", topology, *extra]


def test_a_raw_pmap_is_refused_with_a_hint(edges: Path, capsys: pytest.CaptureFixture) -> None:
    err = refused(_simulate(edges, "raw_pmap", "dgx-h100"), capsys)
    assert "'user_edges.py:raw_pmap' returned a jax.pmap-ed function" in err
    assert "PmapStep(fn, axis_name)" in err and "jax.jit" in err and "jax.shard_map" in err


# dgx-h100: 8 devices, as many as this process has (a concrete mesh); dgx-h100@16: 16 (an abstract mesh)
@pytest.mark.parametrize("topology", ["dgx-h100", "dgx-h100@16"])
@pytest.mark.parametrize("function, named", [("pure", "jax.pure_callback(`echo`)"),
                                             ("impure", "jax.experimental.io_callback(`log_it`)")])
def test_a_host_callback_is_named_and_assumed_on_request(edges: Path, function: str, named: str, topology: str,
                                                         capsys: pytest.CaptureFixture) -> None:
    err = refused(_simulate(edges, function, topology), capsys)
    assert f"'user_edges.py:{function}': the step calls the host callback {named}" in err and "--unknown-ops assume" in err
    assert main(_simulate(edges, function, topology, "--unknown-ops", "assume", "--json")) == 0
    data = json.loads(capsys.readouterr().out)
    assert any(named in a for a in data["assumptions"]) and data["step_time_s"] > 0


def test_the_users_prints_stay_off_json(edges: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(_simulate(edges, "chatty", "dgx-h100", "--json")) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["step_time_s"] > 0
    assert "hello from the user's function" in out.err and "tracing the user's step" in out.err


@pytest.mark.parametrize("function, words", [("exits_while_traced", "SystemExit: exit status 4"),
                                             ("interrupted_while_traced", "KeyboardInterrupt")])
def test_an_exit_while_traced_is_one_paragraph(edges: Path, function: str, words: str,
                                               capsys: pytest.CaptureFixture) -> None:
    err = refused(_simulate(edges, function, "dgx-h100"), capsys)
    assert f"'user_edges.py:{function}' raised {words} (while being traced" in err


@pytest.mark.parametrize("topology, mesh", [("dgx-h100", "Mesh"), ("dgx-h100@16", "AbstractMesh")])
def test_the_function_is_called_once(edges: Path, topology: str, mesh: str, capsys: pytest.CaptureFixture) -> None:
    assert main(_simulate(edges, "counted", topology, "--json")) == 0
    out = capsys.readouterr()
    assert out.err.count("call ") == 1 and f"call 1 with {mesh}" in out.err
    method = json.loads(out.out)["memory"]["method"]
    assert ("XLA's memory analysis" in method) == (mesh == "Mesh")  # compiled where the devices are


def test_a_malformed_spec_cites_an_example_that_exists(capsys: pytest.CaptureFixture) -> None:
    err = refused(["simulate", "--program", "no_colon_here", "--topology", "dgx-h100"], capsys)
    cited = re.search(r"e\.g\. (\S+\.py):predict", err).group(1)
    assert (Path(__file__).resolve().parent.parent / cited).is_file(), cited


def test_describe_keeps_the_last_line_of_a_traceback_in_a_message() -> None:
    text = ("INTERNAL: CpuCallback error calling callback: Traceback (most recent call last):\n  File \"x.py\", "
            "line 1, in <lambda>\nZeroDivisionError: division by zero\n")
    assert describe(RuntimeError(text)) == ("RuntimeError: INTERNAL: CpuCallback error calling callback: "
                                            "ZeroDivisionError: division by zero")
