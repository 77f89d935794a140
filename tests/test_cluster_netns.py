"""An emulated cluster built for real (root or CAP_NET_ADMIN; skipped with the reason elsewhere).

Every test checks that it leaves nothing behind: no namespace of this
project, no new link or qdisc in the machine's own namespace. The SIGKILL
test kills a command mid-run and shows the next build removes its cluster
and the workers still running inside it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.cli.main import main
from testbed.cluster import cluster_spec, netns
from testbed.topology.io import load_topology

REASON = netns.unavailable()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster here: {REASON}")

TWO_NODES = """\
name: eth-2x1
device: {name: host-cpu, flops: {fp32: 100GFLOP/s}, memory: 2GiB, memory_bandwidth: 50GB/s}
levels:
  - {name: cluster, size: 2, bandwidth: 10Gb/s, latency: 10us, kind: ethernet, attach: switch}
"""

PLAN = """\
name: dp2
model: {kind: gpt, layers: 1, d_model: 16, heads: 2, d_ff: 32, seq_len: 8, vocab: 32}
batch: {global_batch: 4, microbatches: 1}
mesh: {data: 2}
"""


def _root_state() -> tuple[str, str]:
    link = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    qdisc = subprocess.run(["tc", "qdisc"], capture_output=True, text=True).stdout
    return "\n".join(sorted(l.split(":")[1] for l in link.splitlines())), "\n".join(sorted(qdisc.splitlines()))


@pytest.fixture
def clean(tmp_path, monkeypatch):
    """The test's state directory; afterwards no namespace, link or qdisc of the project remains."""
    monkeypatch.setenv("TESTBED_CLUSTER_STATE", str(tmp_path / "state"))
    before = _root_state()
    mine = {c.name for c in netns.clusters()}
    yield tmp_path
    left = [c for c in netns.clusters() if c.name not in mine]
    for c in left:
        netns.remove(c.name, c.owner)
    assert not left, f"clusters left behind: {left}"
    assert _root_state() == before


def _topology(tmp_path: Path) -> str:
    path = tmp_path / "eth-2x1.yaml"
    path.write_text(TWO_NODES)
    return str(path)


def test_without_privilege_exit_2_says_what_is_missing(monkeypatch, capsys):
    monkeypatch.setattr(netns, "privilege_problem", lambda: "needs root or CAP_NET_ADMIN (test)")
    assert main(["cluster", "up", "x", "--topology", "eth-4x2", "--scale", "0.01"]) == 2
    assert "CAP_NET_ADMIN" in capsys.readouterr().err


def test_privilege_problem_names_the_capability():
    assert "CAP_NET_ADMIN" in netns.privilege_problem(euid=1000, capabilities=0)
    assert netns.privilege_problem(euid=1000, capabilities=1 << 12) in (None, *(
        f"`{t}` (iproute2) is not installed" for t in ("ip", "tc")))


@needs_netns
def test_build_shapes_both_ways_and_removes_everything(clean):
    spec = cluster_spec(load_topology("eth-4x2"), name="tshape", scale=0.001)
    with netns.ephemeral(spec) as owner:
        made = [c for c in netns.clusters() if c.name == "tshape"]
        assert len(made) == 1 and made[0].alive and len(made[0].namespaces) == 5
        node = netns.node_namespace(spec, owner, 0)
        qdisc = subprocess.run(["tc", "-n", node, "qdisc", "show", "dev", "eth0"], capture_output=True,
                               text=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        fabric = f"tbc-tshape-{owner}-sw"
        ports = subprocess.run(["tc", "-n", fabric, "qdisc"], capture_output=True, text=True).stdout
        assert ports.count("tbf") == 4  # the switch side of each link: the other direction
        routes = subprocess.run(["ip", "-n", node, "route"], capture_output=True, text=True).stdout
        assert "default" not in routes  # no way out of the cluster
    assert not [c for c in netns.clusters() if c.name == "tshape"]


def _command(tmp_path: Path, scale: str, nbytes: str) -> subprocess.Popen:
    argv = ["collective", "all_reduce", "--topology", _topology(tmp_path), "--execute", "cluster", "--scale", scale,
            "--bytes", nbytes, "--repeats", "2", "--json"]
    code = f"import sys; from testbed.cli.main import main; sys.exit(main({argv!r}))"
    with open(tmp_path / "command.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)


def _wait_for_workers(pid: int, timeout: float = 90.0) -> tuple[list[str], list[int]]:
    """The namespaces of the cluster process ``pid`` owns and the processes in its nodes, once each node has one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in netns.clusters():
            if c.owner.startswith(f"{pid}x"):
                nodes = [ns for ns in c.namespaces if not ns.endswith("-sw")]
                pids = [subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
                        for ns in nodes]
                if all(pids):
                    return list(c.namespaces), [int(p) for group in pids for p in group]
        time.sleep(0.2)
    raise AssertionError("the command's workers never started in its cluster")


@needs_netns
def test_sigkill_mid_run_then_the_next_build_cleans_up(clean):
    # 1 MiB at 10 kb/s takes minutes: the command is surely mid-run when it is killed.
    proc = _command(clean, "0.000001", "1MiB")
    try:
        names, workers = _wait_for_workers(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    killed = [c for c in netns.clusters() if c.owner.startswith(f"{proc.pid}x")]
    assert killed and not killed[0].alive  # left behind, its owner gone
    spec = cluster_spec(load_topology(_topology(clean)), name="tnext", scale=0.01)
    with netns.ephemeral(spec):
        assert not set(names) & set(netns.namespaces())
    for ns in names:
        assert not Path(f"/run/netns/{ns}").exists()
    assert not [pid for pid in workers if _running(pid)]  # the workers left inside were killed with it


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@needs_netns
def test_sigterm_mid_run_removes_the_cluster(clean):
    proc = _command(clean, "0.000001", "1MiB")
    try:
        names, _ = _wait_for_workers(proc.pid)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code != 0
    assert not set(names) & set(netns.namespaces())


@needs_netns
def test_smoke_up_collective_status_down(clean, capsys):
    """CI's smoke test: a 2-node cluster over shaped links, a collective and a 2-step run on it, then down."""
    topology = _topology(clean)
    assert main(["cluster", "up", "smoke", "--topology", topology, "--scale", "0.01", "--json"]) == 0
    try:
        assert json.loads(capsys.readouterr().out)["cluster"]["links"][0]["rate_bps"] == pytest.approx(1e8)
        assert main(["cluster", "up", "smoke", "--topology", topology, "--scale", "0.01"]) == 2  # taken
        assert main(["collective", "all_gather", "--topology", topology, "--execute", "cluster:smoke",
                     "--bytes", "256KiB", "--repeats", "2", "--json"]) == 0
        run = json.loads(capsys.readouterr().out)["execute"]
        assert run["ok"] and run["ranks"] == 2 and run["cluster"] == "smoke" and run["kept"]
        assert run["time_s"] > 0 and run["predicted_s"] > 0
        plan = clean / "dp2.yaml"
        plan.write_text(PLAN)
        assert main(["run", "--plan", str(plan), "--devices", "emulated:2", "--cluster", "smoke", "--steps", "2",
                     "--json"]) == 0
        steps = json.loads(capsys.readouterr().out)
        assert steps["processes"] == 2 and steps["steps"] == 2 and steps["loss"] is not None
        assert main(["cluster", "status", "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert [c["nodes"] for c in status["clusters"] if c["name"] == "smoke"] == [2]
    finally:
        assert main(["cluster", "down", "smoke"]) == 0
    assert main(["cluster", "down", "smoke"]) == 2  # gone


@needs_netns
def test_down_all_removes_every_cluster_and_its_state(clean, monkeypatch, capsys):
    topology = _topology(clean)
    others = set(netns.namespaces())
    assert main(["cluster", "up", "tall", "--topology", topology, "--scale", "0.01"]) == 0
    assert (clean / "state" / "tall.json").exists()
    # `down --all` removes every cluster of the project: here, only those this test made (others may be running).
    real = netns.namespaces
    monkeypatch.setattr(netns, "namespaces", lambda: [ns for ns in real() if ns not in others])
    assert main(["cluster", "down", "--all", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["namespaces_removed"] == 3
    assert not (clean / "state" / "tall.json").exists()
    assert "tall" not in {c.name for c in netns.clusters()}


def test_the_message_says_whether_a_rootless_run_is_possible():
    refused = netns.privilege_problem(euid=1000, capabilities=0, userns="user namespaces are disabled (test)")
    assert "CAP_NET_ADMIN" in refused and "no rootless mode here" in refused and "disabled (test)" in refused
    allowed = netns.privilege_problem(euid=1000, capabilities=0, userns=None)
    assert "allows unprivileged user namespaces" in allowed and "unshare --user --map-root-user" in allowed
    assert netns.privilege_problem(euid=0, userns="never asked") in (None, *(
        f"`{t}` (iproute2) is not installed" for t in ("ip", "tc")))


@needs_netns
def test_calibrate_verify_validate_on_a_cluster(clean, capsys):
    """The commands that run on a kept cluster: calibrate its host costs, verify a plan, validate its step."""
    topology = _topology(clean)
    plan = clean / "dp2.yaml"
    plan.write_text(PLAN)
    calibrated = clean / "cal.yaml"
    assert main(["cluster", "up", "cal", "--topology", topology, "--scale", "0.01"]) == 0
    try:
        assert main(["calibrate", "--cluster", "cal", "--out", str(calibrated), "--max-call-s", "0.05",
                     "--json"]) == 0
        costs = json.loads(capsys.readouterr().out.splitlines()[-1])["costs"]
        assert 0 < costs["link_efficiency"] <= 1 and costs["call_s"] >= 0
        assert load_topology(str(calibrated)).levels[-1].bandwidth == pytest.approx(
            costs["link_efficiency"] * 1e8 / 8 * 1448 / 1514)
        assert main(["verify", "--plan", str(plan), "--cluster", "cal", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["ok"]
        assert main(["validate", str(plan), "--cluster", "cal", "--topology", str(calibrated), "--steps", "2",
                     "--json"]) == 0
        row = json.loads(capsys.readouterr().out)["plans"][0]
        assert row["measured_s"] > 0 and row["host_step_s"] > 0
        assert row["predicted_s"] == pytest.approx(row["host_step_s"] + row["links_s"])
    finally:
        assert main(["cluster", "down", "cal"]) == 0


def _as_nobody() -> list[str] | None:
    """A command prefix running as uid/gid 65534 (root with setpriv only), else None."""
    import os
    import shutil

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return None
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.mark.skipif(_as_nobody() is None, reason="needs root and setpriv to run a command as an unprivileged user")
def test_rootless_one_shot_collective_as_an_unprivileged_user(tmp_path):
    """As uid 65534: the message is honest, and where user namespaces work a one-shot collective runs."""
    import os
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="tb-rootless-"))
    try:
        os.chmod(shared, 0o777)
        topology = shared / "eth-2x1.yaml"
        topology.write_text(TWO_NODES)
        os.chmod(topology, 0o644)
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(shared), "TMPDIR": str(shared)}
        probe = [sys.executable, "-c", "from testbed.cluster.rootless import userns_problem as p; print(p())"]
        refused = subprocess.run(_as_nobody() + probe, capture_output=True, text=True, env=env, timeout=60)
        if refused.stdout.strip() == "None":
            inside = ["unshare", "--user", "--map-root-user", sys.executable, "-c", "pass"]
            runs = subprocess.run(_as_nobody() + inside, capture_output=True, text=True, env=env, timeout=60)
            if runs.returncode != 0:
                pytest.skip(f"this Python cannot run inside an unprivileged user namespace here (it lives where "
                            f"the namespace's root has no access): {runs.stderr.strip()[:200]}")
        before = set(netns.namespaces())
        argv = [sys.executable, "-m", "testbed.cli", "collective", "all_gather", "--topology", str(topology),
                "--execute", "cluster", "--scale", "0.01", "--bytes", "64KiB", "--repeats", "1", "--json"]
        done = subprocess.run(_as_nobody() + argv, capture_output=True, text=True, env=env, timeout=300)
        if refused.stdout.strip() != "None":
            assert done.returncode == 2 and "no rootless mode here" in done.stderr
        else:
            assert done.returncode == 0, done.stderr[-2000:]
            assert json.loads(done.stdout)["execute"]["ok"]
        assert set(netns.namespaces()) == before  # it all lived in the command's own user namespace
    finally:
        import shutil

        shutil.rmtree(shared, ignore_errors=True)
