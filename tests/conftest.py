"""Test setup: 8 emulated CPU devices before JAX starts (TESTBED_TEST_DEVICES=N: N), hypothesis profiles.

HYPOTHESIS_PROFILE=ci (default, small and fast) or thorough (large). The profile governs every
property test: a test that needs fewer (or more) examples than the profile's ``max_examples`` asks
for a share of it (``@settings(max_examples=max(1, settings().max_examples // 5))``, read when the
test module is imported, after this file has loaded the profile), never for a fixed number, which
would override the thorough profile too.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# TESTBED_TEST_DEVICES=1 is the one-device mode (tests/test_kit_one_device.py, what a single TPU chip runs).
_count = int(os.environ.get("TESTBED_TEST_DEVICES", "8"))
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + f" --xla_force_host_platform_device_count={_count}").strip()
else:
    os.environ["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+",
                                     f"--xla_force_host_platform_device_count={_count}", _flags)
# The tests check what programs compute and which collectives they run, on tiny models, never how fast the
# compiled code is: XLA:CPU's LLVM backend optimisation is most of each compile and buys nothing here (an
# 8-device pipeline verify: 41 s of CPU at the default level, 24 s at 0). HLO passes (SPMD partitioning,
# collectives, buffer assignment) are untouched. A level set by the caller is kept.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"


def _jaxlib_knows(flag: str) -> bool:
    """Whether the installed jaxlib parses ``--flag`` (an unknown flag in XLA_FLAGS aborts JAX's start): its name is
    in jaxlib's shared libraries."""
    import mmap
    from importlib.util import find_spec

    root = Path(find_spec("jaxlib").origin).parent
    for lib in sorted(root.rglob("*.so"), key=lambda p: -p.stat().st_size):
        with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(flag.encode()) >= 0:
                return True
    return False


# The same for the fusions' code: XLA:CPU's MLIR fusion emitters take a third more CPU to compile these programs
# than its LLVM IR emitters (tests/test_runner.py: 66 -> 45 s of CPU); what the programs compute, their HLO and
# their buffers are the same. Set where this jaxlib has the flag and the caller has not.
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"] and _jaxlib_knows("xla_cpu_use_fusion_emitters"):
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# And one LLVM module per program: XLA:CPU splits each program's code into parts it compiles on threads of their own,
# which for these small programs costs more CPU than it saves (three verified plans' 47 compiles, four A/B pairs on a
# 2-core host: 14-26% less compile CPU, 2-17% less in all); the code is the same, in one object.
if "xla_cpu_parallel_codegen_split_count" not in os.environ["XLA_FLAGS"] and _jaxlib_knows(
        "xla_cpu_parallel_codegen_split_count"):
    os.environ["XLA_FLAGS"] += " --xla_cpu_parallel_codegen_split_count=1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gc  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from testbed.explore.collector import THRESHOLD  # noqa: E402

# The cyclic collector as a search runs it: a test process holds JAX's and testbed's caches, which every full
# collection at Python's default thresholds rescanned (test_program_vs_plan and test_runner in one process: 12.8 s
# of 103 CPU s in the collector, 3.4 s of 81 at THRESHOLD; the same peak memory, 0.83 GB).
gc.set_threshold(*THRESHOLD)

settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


class _FileProgress:
    """One line per test file when its last test finishes: ``tests/test_x.py: 12 passed (3.4 s)``.

    ``make test`` runs quietly (``-q``: a dot per test); these lines say which files are done and what
    they cost, under xdist too (the controller sees every worker's reports; the tests per file come from
    the workers' collections). Pytest's own final summary line is untouched.
    """

    def __init__(self, config) -> None:
        self.config = config
        self.remaining: dict[str, int] = {}
        self.outcomes: dict[str, dict[str, int]] = {}
        self.seconds: dict[str, float] = {}

    def _expect(self, nodeids) -> None:
        if self.remaining:  # every xdist worker collects the same tests: count them once
            return
        for nodeid in nodeids:
            path = nodeid.split("::", 1)[0]
            self.remaining[path] = self.remaining.get(path, 0) + 1

    def pytest_collection_finish(self, session) -> None:  # the items left after -m, -k and deselection
        self._expect(item.nodeid for item in session.items)

    @pytest.hookimpl(optionalhook=True)  # an xdist hook: absent with -p no:xdist
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        self._expect(ids)

    def pytest_runtest_logreport(self, report) -> None:
        path = report.nodeid.split("::", 1)[0]
        if path not in self.remaining:
            return
        self.seconds[path] = self.seconds.get(path, 0.0) + report.duration
        counts = self.outcomes.setdefault(path, {})
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
            counts[outcome] = counts.get(outcome, 0) + 1
        elif report.when == "teardown" and not report.passed:
            counts["error"] = counts.get("error", 0) + 1
        if report.when != "teardown":
            return
        self.remaining[path] -= 1
        if self.remaining[path] == 0:
            summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
            reporter = self.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                if reporter._tw.width_of_current_line:  # after the dots of -q: a line of its own
                    reporter.write("\n")
                reporter.write_line(f"{path}: {summary or 'nothing run'} ({self.seconds[path]:.1f} s)")


def pytest_addoption(parser) -> None:
    parser.addoption("--quick", action="store_true",
                     help="the inner loop: per test module its tests marked `quick`, else its first test not marked "
                          "`slow` (make test-quick)")


def pytest_collection_modifyitems(config, items) -> None:
    """Under ``--quick``, keep per module the tests marked ``quick`` (else its first one not marked ``slow``): every
    module still imports and runs at least one test, in minutes instead of the whole suite's time."""
    if not config.getoption("--quick"):
        return
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    keep = set()
    for tests in modules.values():
        marked = [t for t in tests if t.get_closest_marker("quick")]
        keep.update(marked or [next((t for t in tests if not t.get_closest_marker("slow")), tests[0])])
    config.hook.pytest_deselected(items=[t for t in items if t not in keep])
    items[:] = [t for t in items if t in keep]


def pytest_configure(config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) prints the lines
        config.pluginmanager.register(_FileProgress(config), "testbed-file-progress")
