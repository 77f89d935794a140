"""An emulated cluster built for real (root or CAP_NET_ADMIN; skipped with the reason elsewhere).

Every test checks that it leaves nothing behind: no namespace of this
project, no new link or qdisc in the machine's own namespace. The SIGKILL
test kills a command mid-run and shows the next build removes its cluster
and the workers still running inside it.
"""

from __future__ import annotations

import json
import os
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

#: Every cluster a test here makes is named ``<word><TAG>``: another run of these tests on the same machine (a
#: second checkout's suite, a benchmark) makes others, which the ``clean`` fixture must neither count nor remove.
TAG = str(os.getpid() % 10**6)
#: The one-shot clusters of the commands these tests start (``c<pid>``, testbed.cli.collective_cluster).
SPAWNED: set[str] = set()


def _name(word: str) -> str:
    return f"{word}{TAG}"


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
    """The test's state directory; afterwards no cluster of these tests remains, nor a new link or qdisc in the
    machine's namespace."""
    monkeypatch.setenv("TESTBED_CLUSTER_STATE", str(tmp_path / "state"))
    before = _root_state()
    yield tmp_path
    left = [c for c in netns.clusters() if c.name.endswith(TAG) or c.name in SPAWNED]
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
    spec = cluster_spec(load_topology("eth-4x2"), name=_name("tshape"), scale=0.001)
    with netns.ephemeral(spec) as owner:
        made = [c for c in netns.clusters() if c.name == _name("tshape")]
        assert len(made) == 1 and made[0].alive and len(made[0].namespaces) == 5
        node = netns.node_namespace(spec, owner, 0)
        qdisc = subprocess.run(["tc", "-n", node, "qdisc", "show", "dev", "eth0"], capture_output=True,
                               text=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        fabric = f"tbc-{_name('tshape')}-{owner}-sw"
        ports = subprocess.run(["tc", "-n", fabric, "qdisc"], capture_output=True, text=True).stdout
        assert ports.count("tbf") == 4  # the switch side of each link: the other direction
        routes = subprocess.run(["ip", "-n", node, "route"], capture_output=True, text=True).stdout
        assert "default" not in routes  # no way out of the cluster
    assert not [c for c in netns.clusters() if c.name == _name("tshape")]


def _trees(spec, owner: str) -> list[list[dict]]:
    """Every link end's qdiscs (``tc -j qdisc show``), node ends first, then the switch's."""
    ends = [(netns.node_namespace(spec, owner, i), "eth0") for i in range(len(spec.nodes))]
    ends += [(f"tbc-{spec.name}-{owner}-sw", link.upper_dev) for link in spec.links]
    return [json.loads(subprocess.run(["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev], capture_output=True,
                                      text=True, check=True).stdout) for ns, dev in ends]


@needs_netns
def test_the_links_serve_sparse_packets_first_and_keep_it_when_reshaped(clean):
    """Every link end: tbf (rate, bucket, 50 ms of queue) over htb over two bfifos, small IPv4 packets first
    (testbed.cluster.queue); a reshape keeps that queue at the new rate, or makes the plain FIFO when asked."""
    spec = cluster_spec(load_topology(_topology(clean)), name=_name("tqueue"), scale=0.001)
    with netns.ephemeral(spec) as owner:
        in_use = netns.queue_in_use(spec, owner)
        if in_use["kind"] != "sparse-first":
            pytest.skip(f"the links have the plain FIFO here: {in_use['why']}")
        assert in_use["sparse_below_bytes"] == 256 and in_use["limit_bytes"] == int(1e7 / 8 * 0.05) + 3028
        for tree in _trees(spec, owner):
            kinds = sorted((q["kind"], q.get("parent", "root")) for q in tree)
            assert kinds == [("bfifo", "10:1"), ("bfifo", "10:2"), ("htb", "1:1"), ("tbf", "root")]
            tbf = next(q for q in tree if q["kind"] == "tbf")
            assert tbf["options"]["rate"] == 1e7 / 8 and tbf["options"]["lat"] == 50_000  # 50 ms of the rate
        netns.reshape(spec, owner, 0.003)
        assert netns.queue_in_use(spec, owner)["limit_bytes"] == int(3e7 / 8 * 0.05) + 3028
        assert all(next(q for q in t if q["kind"] == "tbf")["options"]["rate"] == 3e7 / 8 for t in _trees(spec, owner))
        netns.reshape(spec, owner, 0.003, queue="fifo")
        assert netns.queue_in_use(spec, owner)["kind"] == "fifo"
        assert all([q["kind"] for q in t] == ["tbf"] for t in _trees(spec, owner))


@needs_netns
def test_without_htb_every_link_end_falls_back_to_the_fifo_and_says_so(clean, monkeypatch):
    """Where tc refuses the tree (a kernel without htb or u32: here a qdisc that does not exist stands in for it),
    the cluster is still built, every end with tbf's one FIFO, and queue_in_use says so and why."""
    real = netns.sparse_first_commands
    monkeypatch.setattr(netns, "sparse_first_commands", lambda *a, **k: [
        [word if word != "htb" else "nosuchqdisc" for word in command] for command in real(*a, **k)])
    spec = cluster_spec(load_topology(_topology(clean)), name=_name("tfifo"), scale=0.001)
    with netns.ephemeral(spec) as owner:
        in_use = netns.queue_in_use(spec, owner)
        assert in_use["kind"] == "fifo" and "htb" in in_use["why"]
        assert in_use["limit_bytes"] == int(1e7 / 8 * 0.05) + 3028
        assert all([q["kind"] for q in t] == ["tbf"] for t in _trees(spec, owner))


def _command(tmp_path: Path, scale: str, nbytes: str) -> subprocess.Popen:
    argv = ["collective", "all_reduce", "--topology", _topology(tmp_path), "--execute", "cluster", "--scale", scale,
            "--bytes", nbytes, "--repeats", "2", "--json"]
    code = f"import sys; from testbed.cli.main import main; sys.exit(main({argv!r}))"
    with open(tmp_path / "command.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)
    SPAWNED.add(f"c{proc.pid}")
    return proc


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
    spec = cluster_spec(load_topology(_topology(clean)), name=_name("tnext"), scale=0.01)
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
def test_down_all_removes_every_cluster_and_its_state(clean, monkeypatch, capsys):
    topology = _topology(clean)
    name = _name("tall")
    assert main(["cluster", "up", name, "--topology", topology, "--scale", "0.01"]) == 0
    assert (clean / "state" / f"{name}.json").exists()
    # `down --all` removes every cluster of the project: here, only the one this test made (others may be running).
    real = netns.namespaces
    monkeypatch.setattr(netns, "namespaces", lambda: [ns for ns in real() if ns.startswith(f"tbc-{name}-")])
    assert main(["cluster", "down", "--all", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["namespaces_removed"] == 3
    assert not (clean / "state" / f"{name}.json").exists()
    assert name not in {c.name for c in netns.clusters()}


def test_the_message_says_whether_a_rootless_run_is_possible():
    refused = netns.privilege_problem(euid=1000, capabilities=0, userns="user namespaces are disabled (test)")
    assert "CAP_NET_ADMIN" in refused and "no rootless mode here" in refused and "disabled (test)" in refused
    allowed = netns.privilege_problem(euid=1000, capabilities=0, userns=None)
    assert "allows unprivileged user namespaces" in allowed and "unshare --user --map-root-user" in allowed
    assert netns.privilege_problem(euid=0, userns="never asked") in (None, *(
        f"`{t}` (iproute2) is not installed" for t in ("ip", "tc")))


@needs_netns
def test_smoke_one_kept_cluster_collective_calibrate_verify_validate(clean, capsys):
    """CI's smoke test, one 2-node cluster over shaped links for every command that runs on a kept cluster: up,
    a collective, calibrate its host costs, verify a plan, validate its step (a 2-step run on the shaped links,
    then on the links unshaped, in one job that reshapes the links between them), status, down. One cluster and
    one launch per command: each launch starts and compiles JAX in two workers, the cost of this test."""
    topology, name = _topology(clean), _name("smoke")
    plan = clean / "dp2.yaml"
    plan.write_text(PLAN)
    calibrated = clean / "cal.yaml"
    assert main(["cluster", "up", name, "--topology", topology, "--scale", "0.01", "--json"]) == 0
    try:
        up = json.loads(capsys.readouterr().out)
        assert up["cluster"]["links"][0]["rate_bps"] == pytest.approx(1e8)
        assert up["queue"]["kind"] in ("sparse-first", "fifo")  # the output says which queue the links have
        assert main(["cluster", "up", name, "--topology", topology, "--scale", "0.01"]) == 2  # taken
        assert main(["collective", "all_gather", "--topology", topology, "--execute", f"cluster:{name}",
                     "--bytes", "256KiB", "--repeats", "2", "--json"]) == 0
        run = json.loads(capsys.readouterr().out)["execute"]
        assert run["ok"] and run["ranks"] == 2 and run["cluster"] == name and run["kept"]
        assert run["time_s"] > 0 and run["predicted_s"] > 0
        # `run --cluster` checks the job against the cluster before starting anything: one worker per node.
        assert main(["run", "--plan", str(plan), "--devices", "emulated:2", "--cluster", name, "--processes", "3",
                     "--steps", "2"]) == 2
        assert "one worker each" in capsys.readouterr().err
        assert main(["calibrate", "--cluster", name, "--out", str(calibrated), "--max-call-s", "0.05",
                     "--json"]) == 0
        calibrated_json = json.loads(capsys.readouterr().out.splitlines()[-1])
        costs = calibrated_json["costs"]
        assert 0 < costs["link_efficiency"] <= 1 and costs["call_s"] >= 0
        # The three ops' 4 KiB calls, the reduce-scatter's among them (a third round count for the fit).
        assert {r["op"] for r in calibrated_json["rows"] if r["bytes"] == 4096} == {
            "all_reduce", "all_gather", "reduce_scatter"}
        assert load_topology(str(calibrated)).levels[-1].bandwidth == pytest.approx(
            costs["link_efficiency"] * 1e8 / 8 * 1448 / 1514)
        assert main(["verify", "--plan", str(plan), "--cluster", name, "--steps", "1", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["ok"]
        assert main(["validate", str(plan), "--cluster", name, "--topology", str(calibrated), "--steps", "2",
                     "--json"]) == 0
        row = json.loads(capsys.readouterr().out)["plans"][0]
        shaped = row["measured"]["shaped"]
        assert len(shaped["step_times_s"]) == 2 and shaped["loss"] is not None  # the 2-step run, shaped links
        assert row["measured"]["phases"] == ["shaped", "unshaped"]  # one job, the links reshaped between
        assert len(row["measured"]["unshaped"]["step_times_s"]) == 2
        assert row["measured_s"] > 0 and row["host_step_s"] > 0
        assert row["predicted_s"] == pytest.approx(row["host_step_s"] + row["links_s"])
        assert row["links_from"] == "calls added" and row["plan_links_s"] >= 0  # the compiled step's calls
        assert main(["cluster", "status", "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert [c["nodes"] for c in status["clusters"] if c["name"] == name] == [2]
    finally:
        assert main(["cluster", "down", name]) == 0
    assert main(["cluster", "down", name]) == 2  # gone


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


def test_chained_all_reduces_time_one_program_per_chain():
    """`collective_times(..., chain=k)` (no cluster: this process's emulated devices) makes k all-reduces in one
    program, each on the last one's mean, so the sum comes out right, and reports a call as the program / k."""
    from testbed.runner.cluster_collective import collective_times

    one = collective_times("all_reduce", 4096, 2, warmup=1)
    chained = collective_times("all_reduce", 4096, 2, warmup=1, chain=3)
    assert one["ok"] and chained["ok"] and len(chained["times_s"]) == 2 and chained["bytes"] == one["bytes"]
    with pytest.raises(ValueError, match="all_reduce only"):
        collective_times("all_gather", 4096, 1, chain=2)
