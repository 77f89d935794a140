"""Bad-input fuzzing: mutated plans and topologies, raw bytes and argument lists through every command.

The generators are hypothesis strategies (``cases()``): a case is one command
line plus the files it reads, written into a fresh folder. The bundled plans
and topologies are mutated (a random field's value replaced by a wrong type,
NaN, infinity, a huge or negative number, a long string, a nested list or a
boolean; keys deleted, duplicated or renamed; a float infinity as a key), or
replaced by raw bytes, and the command-line values are drawn from the same
kind of pool (``nan``, ``1e309``, ``70000``, ``99``, ...).

Every case runs in-process through ``testbed.cli.main`` and must end with exit
status 0, 1 or 2 (never an exception escaping main), no "Traceback" on stderr,
under 2 KB of stderr, and with exit 2 a message naming a field or a file.
``run`` is only given a plan or an argument it must refuse; the functions that
would start JAX are replaced by a trap, so a case that reaches them counts as
``jax_started``.

``python benchmarks/fuzz_inputs.py --cases 1000`` prints ONE JSON object:
cases, per command, exit codes, tracebacks, wrong exit codes, max stderr
bytes, seconds (and the first failures, if any). tests/test_fuzz_inputs.py
runs the same generators under the hypothesis profile of tests/conftest.py.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
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

import yaml
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Seed documents: the bundled plans and topologies (read once), and a small graph-form topology.
PLAN_FILES = sorted((ROOT / "plans").glob("*.yaml")) + sorted((ROOT / "plans" / "validation").glob("*.yaml"))[:3]
TOPOLOGY_FILES = sorted((ROOT / "topologies").glob("*.yaml"))
PLANS = {p.stem: yaml.safe_load(p.read_text()) for p in PLAN_FILES}
TOPOLOGIES = {p.stem: yaml.safe_load(p.read_text()) for p in TOPOLOGY_FILES}
TOPOLOGIES["graph-4"] = {
    "name": "graph-4",
    "device": {"name": "dev", "flops": {"fp32": "10TFLOP/s"}, "memory": "16GiB", "memory_bandwidth": "500GB/s"},
    "graph": {"devices": 4, "switches": ["sw"],
              "links": [{"a": i, "b": "sw", "bandwidth": "25GB/s", "latency": "2us", "kind": "pcie"} for i in range(4)],
              "levels": [{"name": "pair", "size": 2}]},
}
#: Small seeds for the commands that simulate (the big ones are covered by plan check and memory).
SMALL_TOPOLOGIES = ("host-cpu-8", "a100-pcie-8", "eth-100g-8", "tpu-v5e-4x4", "graph-4")

#: The placeholder for the case's folder in file texts and arguments.
TMP = "@TMP@"
#: The commands a case can run (``run`` only with something it must refuse).
COMMANDS = ("plan", "memory", "simulate", "compare", "topology", "collective", "schedule", "topologies", "run")

# -- values -------------------------------------------------------------------------

_HUGE = [10**30, 2**50, 2**53, 2**53 + 1, 2**63, 10**400, -(10**30), 1_048_577, 100_001, 65_536, 10**6]
BAD_VALUES = st.one_of(
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -1e-320, 0.0, -0.5]),
    st.sampled_from(_HUGE), st.integers(-3, 3), st.integers(), st.floats(),
    st.booleans(), st.none(),
    st.text(max_size=12), st.sampled_from(["x" * 10_000, "x" * 100_000, "1e309GB", "nanGB/s", "-1us", ".inf",
                                           "xy", "10**30", "\x00", "\u202e", "../../etc/passwd"]),
    st.lists(st.integers(-2, 5), max_size=4), st.just([[1, [2, [3, [4]]]]]), st.just([]), st.just({}),
    st.dictionaries(st.text(max_size=4), st.integers(-2, 5), max_size=3), st.just({float("inf"): 1}),
).map(copy.deepcopy)  # a fresh copy: later mutations must not change the strategy's own constants

TOPOLOGY_REFS = st.sampled_from([f"{TMP}/topology.yaml", f"{TMP}/missing.yaml", f"{TMP}/" + "t" * 5000 + ".yaml",
                                 "t" * 300, TMP, "/dev/null", "host-cpu-8", "dgx-h100", "no-such-topology", ""])

# -- mutating documents ------------------------------------------------------------------


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) into ``doc``, containers included, the root excluded."""
    out = []
    if isinstance(doc, dict):
        items = list(doc.items())
    elif isinstance(doc, list):
        items = list(enumerate(doc))
    else:
        return out
    for key, value in items:
        out.append((*prefix, key))
        out.extend(_paths(value, (*prefix, key)))
    return out


def _parent(doc: Any, path: tuple) -> Any:
    for key in path[:-1]:
        doc = doc[key]
    return doc


@st.composite
def mutated(draw: Any, doc: Any, topology_key: bool = False) -> Any:
    """``doc`` with one to three random mutations (values, keys, structure)."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        if not paths or not isinstance(doc, (dict, list)):
            return draw(BAD_VALUES)
        path = draw(st.sampled_from(paths))
        parent, key = _parent(doc, path), path[-1]
        op = draw(st.sampled_from(["replace", "replace", "replace", "delete", "rename", "inf-key", "wrap", "root"]))
        if op == "replace":
            parent[key] = draw(TOPOLOGY_REFS) if topology_key and key == "topology" and draw(st.booleans()) \
                else draw(BAD_VALUES)
        elif op == "delete":
            if isinstance(parent, dict):
                del parent[key]
            else:
                parent.pop(key)
        elif op in ("rename", "inf-key") and isinstance(parent, dict):
            value = parent.pop(key)
            new = float("inf") if op == "inf-key" else draw(st.sampled_from(
                [str(key).upper(), f"{key}s", str(key)[:-1] or "k", "x" * 300, 7, True]))
            parent[new] = value
        elif op == "wrap":
            parent[key] = [parent[key]]
        elif op == "root":
            return draw(st.sampled_from([[doc], "text", 3, None]))
    if topology_key and isinstance(doc, dict) and draw(st.integers(0, 3)) == 0:
        doc["topology"] = draw(TOPOLOGY_REFS)
    return doc


def _dump(doc: Any) -> str:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


@st.composite
def file_text(draw: Any, seeds: dict[str, Any], topology_key: bool = False) -> bytes:
    """A mutated seed as YAML bytes, or text-level damage (duplicated line, cut, flipped byte, raw bytes)."""
    seed = seeds[draw(st.sampled_from(sorted(seeds)))]
    how = draw(st.sampled_from(["mutate"] * 6 + ["duplicate-line", "cut", "flip", "bytes", "bom", "utf16"]))
    if how == "mutate":
        return _dump(draw(mutated(seed, topology_key))).encode()
    text = _dump(seed)
    if how == "duplicate-line":
        lines = text.splitlines(keepends=True)
        i = draw(st.integers(0, len(lines) - 1))
        return "".join(lines[: i + 1] + [lines[i]] + lines[i + 1:]).encode()
    if how == "cut":
        return text[: draw(st.integers(0, len(text)))].encode()
    if how == "flip":
        raw = bytearray(text.encode())
        i = draw(st.integers(0, len(raw) - 1))
        raw[i] = draw(st.integers(0, 255))
        return bytes(raw)
    if how == "bom":
        return b"\xef\xbb\xbf" + text.encode()
    if how == "utf16":
        return text.encode("utf-16")
    return draw(st.binary(max_size=300))


# -- argument values ----------------------------------------------------------------------

BAD_NUMBERS = st.sampled_from(["nan", "inf", "-inf", "1e309", "-1", "0", "1", "2", "3", "70000", "99", "-99",
                               "1000", "100000", "1" + "0" * 30, "abc", "", "1.5", "0x10", "4,4", "x" * 5000])
BAD_BYTES = st.sampled_from(["1GiB", "4MB", "0", "-1", "nan", "inf", "1e309", "1e400GB", "nanB", "1" + "0" * 400,
                             "12 parsecs", "", "x" * 3000])
BAD_COSTS = st.sampled_from(["1,1,1", "1,2,0", "nan,1,1", "inf,1,1", "1,-inf,1", "1,1", "1;2;3", "1,1,1;1,1,1",
                             "-1,1,1", "1e309,1,1", "1,1,1e308", "", ";;", "a,b,c", "1," * 5000])


@dataclass
class Case:
    """One command line (``TMP`` marks the case's folder) and the files to write there first."""

    command: str
    argv: list[str]
    files: dict[str, bytes] = field(default_factory=dict)
    #: ``run`` only: the plan file may be a valid one (its damage can be harmless); then starting JAX is right.
    plan_may_be_valid: bool = False


def _maybe(draw: Any, flag: str, values: st.SearchStrategy) -> list[str]:
    return [flag, draw(values)] if draw(st.booleans()) else []


@st.composite
def plan_case(draw: Any, command: str) -> Case:
    files: dict[str, bytes] = {}
    plan_ref = draw(st.sampled_from(["file"] * 4 + ["bundled", "missing", "folder", "long"]))
    if plan_ref == "file":
        files["plan.yaml"] = draw(file_text(PLANS, topology_key=True))
        plan = f"{TMP}/plan.yaml"
    else:
        plan = {"bundled": draw(st.sampled_from(sorted(p.stem for p in PLAN_FILES if p.parent.name == "plans"))),
                "missing": f"{TMP}/nope.yaml", "folder": TMP, "long": f"{TMP}/" + "p" * 5000}[plan_ref]
    if draw(st.integers(0, 2)) == 0:
        files["topology.yaml"] = draw(file_text(TOPOLOGIES))
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
    files = {"topology.yaml": draw(file_text(TOPOLOGIES))}
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
        files["plan.yaml"] = draw(file_text(PLANS, topology_key=True))
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
    command = argv[0] if argv and argv[0] in COMMANDS else "arguments"
    if command in ("run",):  # would start JAX with a valid plan
        argv = ["run", "--steps", "0", *argv[1:]]
    return Case(command, argv)


def cases() -> st.SearchStrategy[Case]:
    """Every kind of case, with ``--json`` added at random."""
    base = st.one_of(
        plan_case("plan"), plan_case("memory"), plan_case("simulate"), plan_case("compare"), topology_case(),
        collective_case(), schedule_case(), run_case(), arguments_case(),
        st.just(Case("topologies", ["topologies"])),
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
    """`run` reached the point where JAX starts (the plan and arguments were accepted)."""


def _trap(*_args: Any, **_kwargs: Any) -> None:
    raise JaxWouldStart()


@contextlib.contextmanager
def jax_trapped():
    """Replace the functions of ``runners`` that start JAX or workers with a trap."""
    from runners import devices, launch, train

    saved = []
    for module, names in ((devices, ("prepare", "initialize_distributed", "select_devices")),
                          (launch, ("launch",)), (train, ("run_plan", "verify_plan"))):
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
    started_valid_run: bool = False  # `run` of a plan that turned out valid reached JAX (as it should)

    def problems(self) -> list[str]:
        """What this outcome breaks of the rules (empty: it passed)."""
        out = []
        if self.escaped:
            out.append(f"escaped {self.escaped}")
        if "Traceback" in self.stderr:
            out.append("traceback on stderr")
        if self.exit_code not in (0, 1, 2):
            out.append(f"exit {self.exit_code}")
        if len(self.stderr.encode()) >= 2048:
            out.append(f"stderr {len(self.stderr.encode())} bytes")
        if self.exit_code == 2 and not _names_something(self.stderr):
            out.append("exit 2 without naming a field or file")
        if self.command == "run" and self.exit_code == 0 and not self.started_valid_run:
            out.append("run accepted a bad plan or argument")
        return out


def _names_something(stderr: str) -> bool:
    """An exit-2 message names a field (`field `x``), an option, a file path or an argparse usage error."""
    return bool(re.search(r"field `|--[a-z]|\.ya?ml|\.json|usage:|error: argument|/", stderr))


def run_case_in_process(case: Case, folder: Path, time_limit: float = 30.0) -> Outcome:
    """Write the case's files into ``folder`` and run ``main(argv)`` there, capturing output."""
    from testbed.cli.main import main

    for name, content in case.files.items():
        (folder / name).write_bytes(content.replace(TMP.encode(), str(folder).encode()))
    argv = [a.replace(TMP, str(folder)) for a in case.argv]
    out, err = io.StringIO(), io.StringIO()
    escaped, code = None, None
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, time_limit)
    # A case stuck inside one C call never sees the alarm: print where it is, to stderr, after twice the limit.
    faulthandler.dump_traceback_later(2 * time_limit, file=sys.__stderr__)
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), jax_trapped():
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse: usage errors (2) and --help (0)
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except CaseTimeout:
        escaped = "CaseTimeout"
    except JaxWouldStart:
        escaped = "JaxWouldStart"
        if case.plan_may_be_valid and _plan_loads(argv[argv.index("--plan") + 1]):
            escaped, code = None, 0
    except BaseException as exc:  # noqa: BLE001 - the point is to see what escapes
        if isinstance(exc, KeyboardInterrupt):
            raise
        escaped = type(exc).__name__
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)
    return Outcome(case.command, argv, code, err.getvalue(), time.perf_counter() - start, escaped,
                   started_valid_run=case.plan_may_be_valid and code == 0)


def _plan_loads(path: str) -> bool:
    from testbed.errors import InputError
    from testbed.plan.io import load_plan

    try:
        load_plan(path)
    except InputError:
        return False
    return True


def _alarm(*_: Any) -> None:
    raise CaseTimeout()


# -- the benchmark ----------------------------------------------------------------------------


def fuzz(n: int, time_limit: float = 30.0, seed: int = 0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run ``n`` generated cases: the JSON summary, and up to 200 failing cases."""
    from hypothesis import HealthCheck, given, settings, seed as hseed

    per_command: dict[str, int] = {}
    exit_codes: dict[str, int] = {}
    failures: list[dict[str, Any]] = []
    counts = {"tracebacks": 0, "escaped": 0, "wrong_exit_codes": 0, "stderr_over_2kb": 0, "unnamed_exit_2": 0,
              "jax_started": 0, "timeouts": 0, "cases_with_problems": 0}
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
            o = run_case_in_process(case, Path(tmp), time_limit)
        done += 1
        per_command[o.command] = per_command.get(o.command, 0) + 1
        exit_codes[str(o.exit_code)] = exit_codes.get(str(o.exit_code), 0) + 1
        max_stderr = max(max_stderr, len(o.stderr.encode()))
        slowest = max(slowest, o.seconds)
        problems = o.problems()
        counts["tracebacks"] += "Traceback" in o.stderr
        counts["escaped"] += o.escaped not in (None, "CaseTimeout", "JaxWouldStart")
        counts["timeouts"] += o.escaped == "CaseTimeout"
        counts["jax_started"] += o.escaped == "JaxWouldStart"
        counts["wrong_exit_codes"] += o.exit_code not in (0, 1, 2)
        counts["stderr_over_2kb"] += len(o.stderr.encode()) >= 2048
        counts["unnamed_exit_2"] += o.exit_code == 2 and not _names_something(o.stderr)
        counts["cases_with_problems"] += bool(problems)
        if problems and len(failures) < 200:
            failures.append({"command": o.command, "argv": [a[:120] for a in o.argv], "problems": problems,
                             "stderr": o.stderr[-400:]})

    one()
    return {"cases": done, "per_command": dict(sorted(per_command.items())),
            "exit_codes": dict(sorted(exit_codes.items())), **counts,
            "max_stderr_bytes": max_stderr, "slowest_case_s": round(slowest, 3),
            "seconds": round(time.perf_counter() - start, 2), "first_failures": failures[:5]}, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000, help="generated cases (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds one case may take (default 30)")
    parser.add_argument("--memory-limit-gib", type=float, default=8.0,
                        help="address space of this process at most, GiB (0: no limit; default 8)")
    parser.add_argument("--failures", default=None, help="write every failing case (up to 200) to this JSON file")
    args = parser.parse_args()
    if args.memory_limit_gib > 0:
        import resource

        limit = int(args.memory_limit_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    summary, failures = fuzz(args.cases, args.time_limit, args.seed)
    if args.failures:
        Path(args.failures).write_text(json.dumps(failures, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
