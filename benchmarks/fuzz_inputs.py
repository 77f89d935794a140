"""Bad-input fuzzing: mutated plans and topologies, raw bytes and argument lists through every command.

The generators are hypothesis strategies (``cases()``): a case is one command
line plus the files it reads, written into a fresh folder. The seed documents
(the bundled plans and topologies, fuzzer-only ones with every newer key, two
sweep SPECs) and how they are damaged live in benchmarks/fuzz_docs.py; the
cases of check-sharding, collective --execute, search and sweep in
benchmarks/fuzz_commands.py. Command-line values are drawn from pools of the
same kind (``nan``, ``1e309``, ``70000``, ``99``, ...).

Every case runs through ``testbed.cli.main`` in a forked child (at most 60 s and 4 GiB more memory, by
``resource.setrlimit``) and must end with exit
status 0, 1 or 2 (never an exception escaping main), no "Traceback" on stderr,
under 2 KB of stderr, and with exit 2 a message naming a field or a file.
The functions that would start JAX are replaced by a trap: ``run``,
``check-sharding`` and ``collective --execute`` must refuse bad input before
reaching it (a case that does counts as ``jax_started``), and reaching it is
right only when :func:`may_start_jax`, the fuzzer's own check, finds the
input valid (counted as ``valid_reached_jax``, exit 0).

``python benchmarks/fuzz_inputs.py --cases 1000`` prints ONE JSON object:
cases, per command, exit codes (in all and per command), tracebacks, wrong exit codes, max stderr
bytes, seconds (and the first failures, if any). tests/test_fuzz_inputs.py
runs the same generators under the hypothesis profile of tests/conftest.py.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import json
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.fuzz_docs import (BAD_VALUES, OPTION_PLANS, PLAN_FILES, PLAN_OPTIONS, PLANS,  # noqa: E402,F401
                                  SMALL_PLANS, SMALL_TOPOLOGIES, SWEEPS, TMP, TOPOLOGIES, TOPOLOGY_OPTIONS,
                                  TOPOLOGY_REFS, file_text, mutated, options_mutated)
from benchmarks.fuzz_docs import BAD_BYTES, BAD_COSTS, BAD_NUMBERS, Case, _maybe  # noqa: E402
from benchmarks.fuzz_commands import (check_sharding_case, execute_case, search_case,  # noqa: E402,F401
                                      sweep_case)
from benchmarks.fuzz_isolation import isolated  # noqa: E402
from benchmarks.fuzz_sweeps import (apply_setup, named_plan_case, spec_name_case, sweep_db_case,  # noqa: E402,F401
                                    undo_setup)

#: The commands a case can run (``run``, ``check-sharding`` and ``collective --execute`` reach JAX only with input
#: they must accept: the functions that would start it are trapped).
COMMANDS = ("plan", "memory", "simulate", "compare", "topology", "collective", "schedule", "topologies", "run",
            "check-sharding", "search", "sweep")

@st.composite
def plan_case(draw: Any, command: str) -> Case:
    files: dict[str, bytes] = {}
    plan_ref = draw(st.sampled_from(["file"] * 4 + ["bundled", "missing", "folder", "long"]))
    if plan_ref == "file":
        files["plan.yaml"] = draw(file_text(PLANS, topology_key=True, options=PLAN_OPTIONS))
        plan = f"{TMP}/plan.yaml"
    else:
        plan = {"bundled": draw(st.sampled_from(sorted(p.stem for p in PLAN_FILES if p.parent.name == "plans"))),
                "missing": f"{TMP}/nope.yaml", "folder": TMP, "long": f"{TMP}/" + "p" * 5000}[plan_ref]
    if draw(st.integers(0, 2)) == 0:
        files["topology.yaml"] = draw(file_text(TOPOLOGIES, options=TOPOLOGY_OPTIONS))
    topo = []
    if draw(st.booleans()):
        topo = ["--topology", draw(st.sampled_from([f"{TMP}/topology.yaml", *SMALL_TOPOLOGIES, "nope", f"{TMP}/x.yaml"]))]
    if command == "plan":
        return Case("plan", ["plan", "check", plan, *topo], files)
    if command == "memory":
        return Case("memory", ["memory", "--plan", plan, *topo, *(["--fail-if-oom"] if draw(st.booleans()) else [])],
                    files)
    if command == "simulate":
        extra = ["--trace", f"{TMP}/trace.json"] if draw(st.integers(0, 3)) == 0 else []
        return Case("simulate", ["simulate", "--plan", plan, *topo, *extra], files)
    names = draw(st.lists(st.sampled_from([f"{TMP}/topology.yaml", *SMALL_TOPOLOGIES, "nope"]), min_size=1,
                          max_size=3))
    scale = ["--scale", "data"] if draw(st.booleans()) else []
    return Case("compare", ["compare", "--plan", plan, "--topology", *names, *scale], files)


@st.composite
def topology_case(draw: Any) -> Case:
    files = {"topology.yaml": draw(file_text(TOPOLOGIES, options=TOPOLOGY_OPTIONS))}
    return Case("topology", ["topology", "show", f"{TMP}/topology.yaml"], files)


@st.composite
def collective_case(draw: Any) -> Case:
    files: dict[str, bytes] = {}
    if draw(st.booleans()):
        files["topology.yaml"] = draw(file_text({k: TOPOLOGIES[k] for k in SMALL_TOPOLOGIES}))
        topo = f"{TMP}/topology.yaml"
    else:
        topo = draw(st.sampled_from(SMALL_TOPOLOGIES))
    op = draw(st.sampled_from(["all-reduce", "all-gather", "reduce-scatter", "broadcast", "all-to-all", "send",
                               "allreduce", "nope", ""]))
    argv = ["collective", op, "--topology", topo]
    argv += _maybe(draw, "--over", st.sampled_from(["all", "x", "y", "x,y", "node", "pcie-switch", "nope", ",", ""]))
    argv += _maybe(draw, "--bytes", BAD_BYTES)
    argv += _maybe(draw, "--root", BAD_NUMBERS)
    argv += _maybe(draw, "--peer", BAD_NUMBERS)
    argv += _maybe(draw, "--algorithm", st.sampled_from(["auto", "ring", "tree", "nope", ""]))
    return Case("collective", argv, files)


@st.composite
def schedule_case(draw: Any) -> Case:
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "ZB-H1", "nope", ""]))
    argv = ["schedule", name, "--stages", draw(BAD_NUMBERS), "--microbatches", draw(BAD_NUMBERS)]
    argv += _maybe(draw, "--virtual", BAD_NUMBERS)
    argv += _maybe(draw, "--costs", BAD_COSTS)
    argv += _maybe(draw, "--send", BAD_NUMBERS)
    return Case("schedule", argv)


@st.composite
def run_case(draw: Any) -> Case:
    """`run` with a damaged plan or a bad argument: it must be refused before JAX starts."""
    files: dict[str, bytes] = {}
    bad = draw(st.sampled_from(["--port", "--steps", "--processes", "--timeout", "none"]))
    if bad == "none" or draw(st.booleans()):
        files["plan.yaml"] = draw(file_text(PLANS, topology_key=True, options=PLAN_OPTIONS))
        plan = f"{TMP}/plan.yaml"
    else:
        plan = draw(st.sampled_from(["demo", f"{TMP}/nope.yaml"]))
    argv = ["run", "--plan", plan]
    if bad == "--port":
        argv += ["--processes", "2", "--devices", "emulated:8", "--port",
                 draw(st.sampled_from(["70000", "-1", "65536", "99999999999"]))]
    elif bad == "--steps":
        argv += ["--steps", draw(st.sampled_from(["0", "-1", "abc", "nan"]))]
    elif bad == "--processes":
        argv += ["--processes", draw(st.sampled_from(["0", "-2", "3", "nan"]))]
    elif bad == "--timeout":
        argv += ["--processes", "2", "--devices", "emulated:8", "--timeout",
                 draw(st.sampled_from(["nan", "inf", "-1", "0", "-inf"]))]
    return Case("run", argv, files, plan_may_be_valid=bad == "none")


@st.composite
def arguments_case(draw: Any) -> Case:
    """Raw argument lists: random words, flags and values in random order."""
    words = st.one_of(st.sampled_from([*COMMANDS, "check", "show", "--json", "--plan", "--topology", "--help",
                                       "demo", "host-cpu-8", "--stages", "--over", "-", "--", ""]), BAD_NUMBERS,
                      st.text(max_size=8))
    argv = draw(st.lists(words, max_size=6))
    command = argv[0] if argv and argv[0] in (*COMMANDS, "demo") else "arguments"
    if command in ("run", "demo"):  # would start JAX with a valid plan
        argv = [command, "--steps", "0", *argv[1:]]
    return Case(command, argv, plan_may_be_valid=command == "check-sharding")


def cases() -> st.SearchStrategy[Case]:
    """Every kind of case, with ``--json`` added at random."""
    base = st.one_of(
        plan_case("plan"), plan_case("memory"), plan_case("simulate"), plan_case("compare"), topology_case(),
        collective_case(), schedule_case(), run_case(), arguments_case(),
        st.just(Case("topologies", ["topologies"])),
        check_sharding_case(), execute_case(), search_case(), sweep_case(),
        spec_name_case(), sweep_db_case(), named_plan_case(),
    )

    @st.composite
    def with_json(draw: Any) -> Case:
        case = draw(base)
        if case.argv and case.command != "arguments" and draw(st.booleans()):
            case.argv = [*case.argv, "--json"]
        return case

    return with_json()


# -- running a case --------------------------------------------------------------------------


class CaseTimeout(BaseException):
    """A case ran past its time limit (raised by an alarm inside the command)."""


class JaxWouldStart(BaseException):
    """`run`, `check-sharding` or `collective --execute` reached the point where JAX starts (input accepted)."""


def _trap(*_args: Any, **_kwargs: Any) -> None:
    raise JaxWouldStart()


@contextlib.contextmanager
def jax_trapped():
    """Replace the functions of ``testbed.runner`` that start JAX or workers, or run on devices, with a trap.

    ``check-sharding`` starts JAX by ``devices.prepare`` (skipped once JAX is imported, as it is here) and
    lowers by ``check_sharding.check_sharding``; ``collective --execute`` by ``devices.prepare`` and
    ``collectives.execute_and_check``. Importing those two modules imports JAX but starts no backend.
    """
    from testbed.runner import check_sharding, collectives, devices, launch, train

    saved = []
    for module, names in ((devices, ("prepare", "initialize_distributed", "select_devices")),
                          (launch, ("launch",)), (train, ("run_plan", "verify_plan")),
                          (check_sharding, ("check_sharding",)), (collectives, ("execute_and_check",))):
        for name in names:
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, _trap)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@dataclass
class Outcome:
    command: str
    argv: list[str]
    exit_code: int | None
    stderr: str
    seconds: float
    escaped: str | None = None  # the exception that escaped main, by type
    started_valid_run: bool = False  # valid input reached JAX (as it should): `run`, check-sharding, --execute
    raw_esc: bool = False  # stdout or stderr holds a raw ESC byte (a user's name echoed unescaped)
    killed: str | None = None  # an isolated case's process ended by a signal or ran past its limit

    def problems(self) -> list[str]:
        """What this outcome breaks of the rules (empty: it passed)."""
        out = []
        if self.escaped:
            out.append(f"escaped {self.escaped}")
        if self.killed:
            out.append(self.killed)
        if "Traceback" in self.stderr:
            out.append("traceback on stderr")
        if self.exit_code not in (0, 1, 2):
            out.append(f"exit {self.exit_code}")
        if len(self.stderr.encode()) >= 2048:
            out.append(f"stderr {len(self.stderr.encode())} bytes")
        if self.exit_code == 2 and not _names_something(self.stderr, self.argv):
            out.append("exit 2 without naming a field or file")
        if (self.command in ("run", "check-sharding") or "--execute" in self.argv) and self.exit_code == 0 \
                and not self.started_valid_run and not {"--help", "-h"} & set(self.argv):
            out.append(f"{self.command} accepted a bad plan or argument")
        return out


def _names_something(stderr: str, argv: list[str] = ()) -> bool:
    """An exit-2 message names a field (`field `x``), an option, a file path, the file as given in ``argv``
    (``error: nope: plan file not found``; a long name clipped) or is an argparse usage error."""
    from testbed.text import escape_controls

    for a in (escape_controls(a) for a in argv):  # names are shown with control characters escaped
        if a and stderr.startswith(f"error: {a}:" if len(a) < 40 else f"error: {a[:40]}"):
            return True
    return bool(re.search(r"field `|--[a-z]|\.ya?ml|\.json|usage:|error: argument|/", stderr))


def run_case_in_process(case: Case, folder: Path, time_limit: float = 30.0) -> Outcome:
    """Write the case's files into ``folder`` and run ``main(argv)`` there, capturing output."""
    from testbed.cli.main import main

    for name, content in case.files.items():
        (folder / name).write_bytes(content.replace(TMP.encode(), str(folder).encode()))
    argv = [a.replace(TMP, str(folder)) for a in case.argv]
    keep = apply_setup(case.setup, folder)
    out, err = io.StringIO(), io.StringIO()
    escaped, code, reached = None, None, False
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, time_limit)
    # A case stuck inside one C call never sees the alarm: print where it is, to stderr, after twice the limit.
    faulthandler.dump_traceback_later(2 * time_limit, file=sys.__stderr__)
    start = time.perf_counter()
    try:
        # In the case's folder: outputs a command writes by default (demo's testbed-out/, a sweep's NAME.duckdb)
        # must not land in the caller's folder.
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), jax_trapped(), \
                contextlib.chdir(folder):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse: usage errors (2) and --help (0)
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except CaseTimeout:
        escaped = "CaseTimeout"
    except JaxWouldStart:
        escaped = "JaxWouldStart"
        if case.plan_may_be_valid and may_start_jax(case.command, argv):
            escaped, code, reached = None, 0, True
    except BaseException as exc:  # noqa: BLE001 - the point is to see what escapes
        if isinstance(exc, KeyboardInterrupt):
            raise
        escaped = type(exc).__name__
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)
        undo_setup(keep)
    return Outcome(case.command, argv, code, err.getvalue(), time.perf_counter() - start, escaped,
                   started_valid_run=reached, raw_esc="\x1b" in out.getvalue() or "\x1b" in err.getvalue())


_WARM: list[bool] = []


def warm_imports() -> None:
    """Import what cases use (every command, the trapped runner modules, DuckDB, rich, pyplot) once, in the
    parent, so that each forked case starts with them loaded (importing JAX starts no backend)."""
    if _WARM:
        return
    _WARM.append(True)
    from testbed.cli.main import build_parser

    build_parser()
    with jax_trapped():
        pass
    import duckdb  # noqa: F401
    import rich.console  # noqa: F401
    import rich.table  # noqa: F401

    import testbed.explore.sweep  # noqa: F401
    import testbed.sim.graph.engine  # noqa: F401
    from testbed.viz.plots import pyplot

    pyplot()


def run_case_isolated(case: Case, folder: Path, time_limit: float = 60.0, memory_gib: float = 4.0) -> Outcome:
    """:func:`run_case_in_process` in a forked child held to ``time_limit`` s and ``memory_gib`` GiB more memory
    (benchmarks/fuzz_isolation.py); a child that dies or overruns is an Outcome with ``killed`` set."""
    warm_imports()
    start = time.perf_counter()
    result = isolated(lambda: run_case_in_process(case, folder, time_limit), time_limit, memory_gib)
    if isinstance(result, Outcome):
        return result
    return Outcome(case.command, case.argv, None, "", time.perf_counter() - start, killed=result)


def _option(argv: list[str], flag: str, default: str | None = None) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else default


def may_start_jax(command: str, argv: list[str]) -> bool:
    """The fuzzer's own check that a case's input is valid, so reaching JAX is right.

    ``run``: its plan loads. ``check-sharding``: its plan loads and is placed on its topology. ``collective
    --execute``: the op has a JAX collective, ``--repeats`` is at least 1 and the devices are ``local`` or
    ``emulated:N`` with N the group size (the group read from the topology and ``--over`` independently).
    """
    from testbed.errors import InputError
    from testbed.plan.io import load_plan

    try:
        if command == "collective":
            return _execute_valid(argv)
        plan = load_plan(_option(argv, "--plan"))
        if command == "check-sharding":
            from testbed.cli.basic import plan_topology
            from testbed.plan.placement import place

            place(plan, plan_topology(plan, _option(argv, "--topology"), _option(argv, "--plan")))
    except InputError:
        return False
    return True


def _execute_valid(argv: list[str]) -> bool:
    from testbed.collectives.ops import Op, parse_op
    from testbed.topology.io import load_topology

    if parse_op(argv[1]) not in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL):
        return False
    try:
        if int(_option(argv, "--repeats", "10")) < 1:
            return False
    except ValueError:
        return False
    devices = _option(argv, "--execute").strip()
    n = len(load_topology(_option(argv, "--topology")).groups(_option(argv, "--over", "all"))[0])
    return devices == "local" or re.fullmatch(r"emulated:[0-9]+", devices) is not None and int(devices[9:]) == n


def _alarm(*_: Any) -> None:
    raise CaseTimeout()


# -- the benchmark ----------------------------------------------------------------------------


def fuzz(n: int, time_limit: float = 60.0, seed: int = 0,
         memory_gib: float = 4.0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run ``n`` generated cases, each in a forked child within ``time_limit`` s and ``memory_gib`` GiB: the JSON
    summary, and up to 200 failing cases."""
    from hypothesis import HealthCheck, given, settings, seed as hseed

    per_command: dict[str, int] = {}
    exit_codes: dict[str, int] = {}
    failures: list[dict[str, Any]] = []
    counts = {"tracebacks": 0, "escaped": 0, "wrong_exit_codes": 0, "stderr_over_2kb": 0, "unnamed_exit_2": 0,
              "jax_started": 0, "timeouts": 0, "over_memory": 0, "killed": 0, "raw_esc_outputs": 0,
              "cases_with_problems": 0, "valid_reached_jax": 0}
    command_exits: dict[str, dict[str, int]] = {}
    max_stderr, slowest = 0, 0.0
    done = 0
    start = time.perf_counter()

    @hseed(seed)
    @settings(max_examples=n, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), phases=("generate",))
    @given(case=cases())
    def one(case: Case) -> None:
        nonlocal max_stderr, slowest, done
        with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
            o = run_case_isolated(case, Path(tmp), time_limit, memory_gib)
        done += 1
        per_command[o.command] = per_command.get(o.command, 0) + 1
        exit_codes[str(o.exit_code)] = exit_codes.get(str(o.exit_code), 0) + 1
        mine = command_exits.setdefault(o.command, {})
        mine[str(o.exit_code)] = mine.get(str(o.exit_code), 0) + 1
        counts["valid_reached_jax"] += o.started_valid_run
        max_stderr = max(max_stderr, len(o.stderr.encode()))
        slowest = max(slowest, o.seconds)
        problems = o.problems()
        counts["tracebacks"] += "Traceback" in o.stderr
        counts["escaped"] += o.escaped not in (None, "CaseTimeout", "JaxWouldStart")
        counts["timeouts"] += o.escaped == "CaseTimeout" or bool(o.killed and o.killed.startswith("over time"))
        counts["over_memory"] += o.escaped == "MemoryError"
        counts["killed"] += bool(o.killed)
        counts["raw_esc_outputs"] += o.raw_esc
        counts["jax_started"] += o.escaped == "JaxWouldStart"
        counts["wrong_exit_codes"] += o.exit_code not in (0, 1, 2)
        counts["stderr_over_2kb"] += len(o.stderr.encode()) >= 2048
        counts["unnamed_exit_2"] += o.exit_code == 2 and not _names_something(o.stderr, o.argv)
        counts["cases_with_problems"] += bool(problems)
        if problems and len(failures) < 200:
            failures.append({"command": o.command, "argv": [a[:120] for a in o.argv], "problems": problems,
                             "stderr": o.stderr[-400:],
                             "files": {k: v[:4000].decode("utf-8", "replace") for k, v in case.files.items()}})

    warm_imports()
    one()
    return {"cases": done, "per_command": dict(sorted(per_command.items())),
            "exit_codes": dict(sorted(exit_codes.items())),
            "exit_codes_per_command": {k: dict(sorted(v.items())) for k, v in sorted(command_exits.items())}, **counts,
            "max_stderr_bytes": max_stderr, "slowest_case_s": round(slowest, 3),
            "seconds": round(time.perf_counter() - start, 2),
            "first_failures": [{k: v for k, v in f.items() if k != "files"} for f in failures[:5]]}, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000, help="generated cases (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds one case may take (default 60)")
    parser.add_argument("--memory-limit-gib", type=float, default=4.0,
                        help="memory one case may add to its process, GiB (default 4)")
    parser.add_argument("--failures", default=None, help="write every failing case (up to 200) to this JSON file")
    args = parser.parse_args()
    summary, failures = fuzz(args.cases, args.time_limit, args.seed, args.memory_limit_gib)
    if args.failures:
        Path(args.failures).write_text(json.dumps(failures, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
