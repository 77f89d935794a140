"""Bad-input fuzzing of the cluster commands, users' programs and measurement files (issue 57).

Cases (hypothesis strategies, run like benchmarks/fuzz_inputs.py's: ``main(argv)`` in a forked child held to
60 s and 4 GiB, JAX's starters trapped):

- ``cluster up|down|status NAME``: names from a pool of paths (``../victim``, ``/abs/victim``), bad characters
  and valid names; scales, MTUs and topologies from pools of bad and good values; a state folder holding a
  corrupt state file or a link out of it;
- ``collective --execute cluster:NAME``, ``verify``/``validate --cluster NAME``: the same names;
- ``calibrate --cluster t --from-measurements F``: a valid measurements document with one field replaced by a
  bad value, deleted, or the file's bytes damaged;
- ``simulate --program F.py:fn`` (and a dotted ``module:fn`` from the case's folder): functions that raise
  every kind of exception, exit, hang (``--timeout 1``), return odd values, or fail at import.

Besides fuzz_inputs' rules (exit 0/1/2, no traceback, one named paragraph), each case must leave nothing
behind: a ``victim.json`` next to the state folder is untouched, a foreign ``tbc-...`` namespace with a process
inside (made at the start, when this runs as root) survives, no namespace is new after the case (a cluster a
valid ``up`` built is taken down by the fuzzer and counted as ``clusters_built``), and no probe or worker process
is left at the end.

``python benchmarks/fuzz_cluster.py --cases 600`` prints ONE JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.fuzz_docs import TMP, Case  # noqa: E402
from benchmarks.fuzz_inputs import run_case_isolated, warm_imports  # noqa: E402

NAMES = st.sampled_from(["../victim", "/tmp/victim", f"{TMP}/victim", "victim/../../victim", "..", ".", "",
                         "a" * 13, "UP", "a-b", "a b", "tb\x00", "tb\n", "1abc", "-x", "fz1", "fz2", "victim"])
SCALES = st.sampled_from(["1e300", "1e-300", "nan", "inf", "-1", "0", "1e-9", "2", "0.01", "0.001", "1e309",
                          "1" + "0" * 400, "abc"])
MTUS = st.sampled_from(["1500", "0", "575", "65536", "99999999999999999999", "nan", "9000"])
TOPOLOGIES = st.sampled_from(["eth-4x2", "tpu-v5e-4x4", "dgx-h100", "nope", f"{TMP}/nope.yaml", f"{TMP}/fast.yaml"])
FAST = (b"name: fast\ndevice: {name: host-cpu, flops: {fp32: 100GFLOP/s}, memory: 2GiB, memory_bandwidth: 50GB/s}\n"
        b"levels:\n  - {name: cluster, size: 2, bandwidth: 200000GB/s, latency: 10us, kind: ethernet}\n")
STATE_SETUPS = st.sampled_from(["none", "corrupt", "link-out", "garbage-owner"])

GOOD_MEASUREMENTS: dict[str, Any] = {
    "cluster": "t", "topology": "eth-4x2", "scale": 0.001, "mtu": 1500, "link_rate_bps": 1e8,
    "probe": {"loopback_bandwidth": 2e9, "loopback_latency_s": 2e-5, "across_latency_s": 5e-5},
    "load_before": 1.0, "load_after": 1.5, "bucket_bytes": 3028,
    "rows": [{"op": op, "bytes": size, "measured_s": 1e-3 + size / 1e7, "ok": True, "calls_s": [1e-3]}
             for op in ("all_reduce", "all_gather") for size in (4096, 65536, 1 << 20)]}
BAD_VALUES = [None, 0, -1, 1.5, "x", "", [], {}, [1], "\x00", True, "all_to_all", 1e300, -1e-3, "NaN-text"]
#: Written as JSON text verbatim (json.dumps cannot make them).
RAW_VALUES = ["1" + "0" * 400, "NaN", "Infinity", "-Infinity", "1e999", "9" * 5000]

PROGRAMS = {
    "exit": "def f(mesh):\n    raise SystemExit(3)\n",
    "exit_text": "def f(mesh):\n    raise SystemExit('bye')\n",
    "exit_none": "import sys\ndef f(mesh):\n    sys.exit()\n",
    "interrupt": "def f(mesh):\n    raise KeyboardInterrupt\n",
    "generator_exit": "def f(mesh):\n    raise GeneratorExit\n",
    "odd_str": "class E(Exception):\n    def __str__(self):\n        raise RuntimeError('x')\n"
               "def f(mesh):\n    raise E()\n",
    "odd_str_base": "class E(Exception):\n    def __str__(self):\n        raise SystemExit(4)\n"
                    "def f(mesh):\n    raise E()\n",
    "odd_repr": "class R:\n    def __repr__(self):\n        raise ValueError('no')\ndef f(mesh):\n    return R()\n",
    "returns": "def f(mesh):\n    return 42\n",
    "returns_pair": "def f(mesh):\n    return (None, ())\n",
    "recursion": "def f(mesh):\n    return f(mesh)\n",
    "memory": "def f(mesh):\n    return [0] * (1 << 40)\n",
    "spins": "def f(mesh):\n    while True:\n        pass\n",
    "sleeps": "import time\ndef f(mesh):\n    time.sleep(1000)\n",
    "import_exit": "raise SystemExit(5)\ndef f(mesh):\n    pass\n",
    "import_syntax": "def f(mesh) pass\n",
    "import_interrupt": "raise KeyboardInterrupt\n",
    "not_callable": "f = 3\n",
    "base_exception": "def f(mesh):\n    raise BaseException('base')\n",
}


@st.composite
def cluster_case(draw: Any) -> Case:
    if draw(st.integers(0, 9)) == 0:  # a valid `up` (the fuzzer takes it down): builds while the state is damaged
        return Case("cluster", ["cluster", "up", "fz1", "--topology", "eth-4x2", "--scale", "0.001"],
                    setup=draw(STATE_SETUPS))
    action = draw(st.sampled_from(["up", "up", "down", "down", "status"]))
    argv = ["cluster", action]
    if action != "status":
        argv.append(draw(NAMES))
    if action == "up":
        argv += ["--topology", draw(TOPOLOGIES), "--scale", draw(SCALES)]
        if draw(st.booleans()):
            argv += ["--mtu", draw(MTUS)]
    if action == "down" and draw(st.integers(0, 4)) == 0:
        argv = ["cluster", "down", "--all"]
    return Case("cluster", argv, {"fast.yaml": FAST}, setup=draw(STATE_SETUPS))


@st.composite
def on_cluster_case(draw: Any) -> Case:
    name = draw(NAMES)
    kind = draw(st.sampled_from(["collective", "verify", "validate", "calibrate"]))
    argv = {"collective": ["collective", "all_reduce", "--topology", "eth-4x2", "--execute", f"cluster:{name}",
                           "--bytes", "1KiB"],
            "verify": ["verify", "--plan", "benchmarks/cluster_plans/dp8-small.yaml", "--cluster", name],
            "validate": ["validate", "benchmarks/cluster_plans/dp8-small.yaml", "--cluster", name, "--topology",
                         "eth-4x2"],
            "calibrate": ["calibrate", "--cluster", name, "--out", f"{TMP}/c.yaml"]}[kind]
    argv = [str(ROOT / a) if a.startswith("benchmarks/") else a for a in argv]
    return Case(kind, argv, setup=draw(STATE_SETUPS))


def _damaged(draw: Any) -> bytes:
    doc = json.loads(json.dumps(GOOD_MEASUREMENTS))
    paths = [(k,) for k in doc] + [("probe", k) for k in doc["probe"]] + [("rows",)] + [
        ("rows", i, k) for i in range(len(doc["rows"])) for k in doc["rows"][i]] + [("rows", 0)]
    path = draw(st.sampled_from(paths))
    where = doc
    for key in path[:-1]:
        where = where[key]
    how = draw(st.sampled_from(["value", "value", "delete", "raw"]))
    if how == "delete":
        del where[path[-1]]
        return json.dumps(doc).encode()
    if how == "raw":
        where[path[-1]] = "@RAW@"
        return json.dumps(doc).replace('"@RAW@"', draw(st.sampled_from(RAW_VALUES))).encode()
    where[path[-1]] = draw(st.sampled_from(BAD_VALUES))
    return json.dumps(doc).encode()


@st.composite
def measurement_case(draw: Any) -> Case:
    kind = draw(st.sampled_from(["field"] * 6 + ["bytes", "valid"]))
    if kind == "field":
        content = _damaged(draw)
    elif kind == "bytes":
        good = json.dumps(GOOD_MEASUREMENTS).encode()
        cut = draw(st.integers(0, len(good)))
        content = good[:cut] + draw(st.binary(max_size=8)) + good[cut + draw(st.integers(0, 4)):]
    else:
        content = json.dumps(GOOD_MEASUREMENTS).encode()
    argv = ["calibrate", "--cluster", "t", "--out", f"{TMP}/c.yaml", "--from-measurements", f"{TMP}/m.json"]
    return Case("measurements", argv, {"m.json": content})


@st.composite
def program_case(draw: Any) -> Case:
    name = draw(st.sampled_from(sorted(PROGRAMS)))
    dotted = draw(st.integers(0, 3)) == 0
    spec = "user_prog:f" if dotted else f"{TMP}/user_prog.py:f"
    spec = draw(st.sampled_from([spec] * 6 + ["sys:exit", "os:getcwd", "user_prog", ":f", "user_prog:1f",
                                              f"{TMP}/nope.py:f"]))
    argv = ["simulate", "--program", spec, "--topology", "eth-4x2", "--timeout",
            draw(st.sampled_from(["1", "1", "0.5", "0", "-1", "nan", "inf", "1e309"]))]
    if draw(st.integers(0, 3)) == 0:
        argv += ["--mesh", draw(st.sampled_from(["data=8", "data=4", "x", "data=2,tensor=4"]))]
    return Case("program", argv, {"user_prog.py": PROGRAMS[name].encode()})


def cases() -> st.SearchStrategy[Case]:
    return st.one_of(cluster_case(), on_cluster_case(), measurement_case(), program_case())


# -- what a case leaves behind -----------------------------------------------------------------------


#: The cluster names the cases can build (other namespaces on the machine belong to others' runs).
OURS = ("fz1", "fz2", "victim", "t")


def _namespaces() -> set[str]:
    """The namespaces of clusters the cases could have made."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = {line.split()[0] for line in out.splitlines() if line.strip()}
    return {n for n in names if n.startswith("tbc-") and n.split("-")[1] in OURS}


def _prepare(setup: str, folder: Path) -> None:
    """The victim file and the case's state folder (``setup``: one of :data:`STATE_SETUPS`)."""
    (folder / "victim.json").write_text("{}")
    state = folder / "state"
    state.mkdir()
    if setup == "corrupt":
        for name in ("fz1", "fz2", "victim", "t"):
            (state / f"{name}.json").write_bytes(b"\x00{not json")
    elif setup == "link-out":
        for name in ("fz1", "victim", "t"):
            (state / f"{name}.json").symlink_to(folder / "victim.json")
    elif setup == "garbage-owner":
        (state / "owners").mkdir()
        (state / "owners" / f"{FOREIGN}.json").write_text(json.dumps({"namespace": FOREIGN, "inode": 1}))


FOREIGN = "tbc-fuzzforeign-tool-x"


def _processes() -> list[int]:
    """Processes a case started that still run: their environment names a case's state folder."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if b"TESTBED_CLUSTER_STATE=" + tempfile.gettempdir().encode() + b"/fuzz-cluster-" in (
                        entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _tally(counts: dict[str, int], per_command: dict[str, dict[str, int]], failures: list[dict[str, Any]], o, *,
           victim: bool, new: set[str], root: bool) -> None:
    """One case's outcome ``o`` counted: its exit code per command, its problems (a touched victim file, the foreign
    namespace removed, namespaces left, which are removed here) and, for the first 20 with problems, the case."""
    counts["cases"] += 1
    mine = per_command.setdefault(o.command, {})
    mine[str(o.exit_code)] = mine.get(str(o.exit_code), 0) + 1
    problems = o.problems()
    if not victim:
        problems.append("victim.json touched")
    if root and not Path(f"/run/netns/{FOREIGN}").exists():
        problems.append("the foreign namespace was removed")
    if new:
        problems.append(f"namespaces left: {sorted(new)}")
        for ns in new:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
    counts["tracebacks"] += "Traceback" in o.stderr
    counts["wrong_exit_codes"] += o.exit_code not in (0, 1, 2)
    counts["timeouts"] += o.escaped == "CaseTimeout" or bool(o.killed and o.killed.startswith("over time"))
    counts["killed"] += bool(o.killed)
    counts["victim_touched"] += not victim
    counts["namespaces_left"] += len(new)
    counts["problems"] += bool(problems)
    if problems and len(failures) < 20:
        failures.append({"argv": [a[:100] for a in o.argv], "problems": problems, "stderr": o.stderr[-300:]})


def fuzz(n: int, time_limit: float = 60.0, seed: int = 0, memory_gib: float = 4.0) -> dict[str, Any]:
    from hypothesis import HealthCheck, given, settings, seed as hseed

    from testbed.cluster import netns

    root = os.geteuid() == 0 and netns.unavailable() is None
    sleeper = None
    if root:
        subprocess.run(["ip", "netns", "add", FOREIGN], check=True)
        sleeper = subprocess.Popen(["ip", "netns", "exec", FOREIGN, "sleep", "100000"])
    counts = {"cases": 0, "tracebacks": 0, "wrong_exit_codes": 0, "problems": 0, "timeouts": 0, "killed": 0,
              "victim_touched": 0, "foreign_namespace_gone": 0, "namespaces_left": 0, "clusters_built": 0}
    per_command: dict[str, dict[str, int]] = {}
    failures: list[dict[str, Any]] = []
    slowest = 0.0
    start = time.perf_counter()

    @hseed(seed)
    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=("generate",))
    @given(case=cases())
    def one(case: Case) -> None:
        nonlocal slowest
        before = _namespaces() if root else set()
        with tempfile.TemporaryDirectory(prefix="fuzz-cluster-") as tmp:
            folder = Path(tmp)
            _prepare(case.setup, folder)
            os.environ["TESTBED_CLUSTER_STATE"] = str(folder / "state")
            o = run_case_isolated(Case(case.command, case.argv, case.files), folder, time_limit, memory_gib)
            victim = (folder / "victim.json").exists() and (folder / "victim.json").read_text() == "{}"
            new = (_namespaces() - before) if root else set()
            built = [ns for ns in new if ns.startswith("tbc-") and ns.split("-")[2] == "keep"]
            if o.exit_code == 0 and case.argv[:2] == ["cluster", "up"] and built:
                counts["clusters_built"] += 1
                netns.remove(built[0].split("-")[1], "keep")
                new = _namespaces() - before
        slowest = max(slowest, o.seconds)
        _tally(counts, per_command, failures, o, victim=victim, new=new, root=root)

    warm_imports()
    try:
        one()
    finally:
        os.environ.pop("TESTBED_CLUSTER_STATE", None)
        if root:
            counts["foreign_namespace_gone"] = int(not Path(f"/run/netns/{FOREIGN}").exists()
                                                   or sleeper.poll() is not None)
            sleeper.kill()
            sleeper.wait()
            subprocess.run(["ip", "netns", "delete", FOREIGN], capture_output=True)
    left = _processes()
    return {**counts, "processes_left": len(left), "as_root": root, "per_command": per_command,
            "slowest_case_s": round(slowest, 3), "seconds": round(time.perf_counter() - start, 2),
            "first_failures": failures[:5]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=600, help="generated cases (default 600)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds one case may take (default 60)")
    parser.add_argument("--memory-limit-gib", type=float, default=4.0, help="memory one case may add, GiB")
    args = parser.parse_args()
    print(json.dumps(fuzz(args.cases, args.time_limit, args.seed, args.memory_limit_gib)))


if __name__ == "__main__":
    main()
