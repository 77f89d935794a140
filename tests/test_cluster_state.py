"""Cluster state: names checked before any file or namespace is touched, state files only inside the state
folder, only namespaces testbed recorded are removed, every signal during `up` rolls it back, probe servers die
with their parent, link rates within what tc shapes. Tests that build namespaces need root (skipped elsewhere)
and remove everything they make."""

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
from testbed.cluster import cluster_spec, netns, state
from testbed.cluster.spec import MAX_RATE_BPS, MIN_RATE_BPS
from testbed.errors import InputError
from testbed.interpreter import python_argv, python_env
from testbed.topology.io import load_topology

REASON = netns.unavailable()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster here: {REASON}")
TAG = str(os.getpid() % 10**6)

TWO_NODES = """\
name: eth-2x1
device: {name: host-cpu, flops: {fp32: 100GFLOP/s}, memory: 2GiB, memory_bandwidth: 50GB/s}
levels:
  - {name: cluster, size: 2, bandwidth: 10Gb/s, latency: 10us, kind: ethernet, attach: switch}
"""


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A state folder of the test's own; afterwards no namespace named for this test remains."""
    monkeypatch.setenv("TESTBED_CLUSTER_STATE", str(tmp_path / "state"))
    yield tmp_path
    if REASON is None:
        left = [ns for ns in _listed() if TAG in ns]
        for ns in left:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        assert not left, f"namespaces left behind: {left}"


def _listed() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@pytest.mark.parametrize("name", ["/tmp/x/victim", "../victim", "victim/../../victim", "Victim", "a" * 13, "a-b"])
def test_down_with_a_bad_name_touches_no_file(folder: Path, name: str, capsys: pytest.CaptureFixture) -> None:
    victim = folder / "victim.json"
    victim.write_text("{}")
    (folder / "state").mkdir()
    os.symlink(victim, folder / "state" / "victim.json")
    assert main(["cluster", "down", name if "/" in name or name != "victim" else name]) == 2
    assert "cluster name is 1-12 lowercase letters" in capsys.readouterr().err
    assert victim.read_text() == "{}"


def test_a_state_file_that_links_out_of_the_folder_is_refused(folder: Path, capsys: pytest.CaptureFixture) -> None:
    victim = folder / "victim.json"
    victim.write_text("{}")
    (folder / "state").mkdir()
    os.symlink(victim, folder / "state" / "victim.json")
    with pytest.raises(InputError, match="does not resolve inside the state folder"):
        state.state_path("victim")
    assert main(["cluster", "down", "victim"]) == 2 and victim.exists()
    assert main(["collective", "all_reduce", "--topology", "eth-4x2", "--execute", "cluster:../victim", "--bytes",
                 "1MiB"]) == 2
    assert "cluster name" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["", "{", "[1]", '{"topology": 1, "scale": 0.01, "mtu": 1500}',
                                  '{"topology": "eth-4x2", "scale": -1, "mtu": 1500}',
                                  '{"topology": "eth-4x2", "scale": 0.01, "mtu": "1500"}', "\0\0"])
def test_a_corrupt_state_file_is_named(folder: Path, text: str) -> None:
    (folder / "state").mkdir()
    (folder / "state" / "tb.json").write_text(text)
    with pytest.raises(InputError) as bad:
        state.read_state("tb")
    assert "tb.json" in bad.value.render() and "cluster down tb" in bad.value.message


@pytest.mark.parametrize("scale", [1e300, 1e-300, float("inf"), 1e-9, 2.0])
def test_scales_outside_what_tc_shapes_are_refused_with_the_range(scale: float) -> None:
    with pytest.raises(InputError) as bad:
        cluster_spec(load_topology("eth-4x2"), name="tb", scale=scale)
    assert bad.value.field == "scale"
    assert "inf" in bad.value.message or "scale from 8e-08 to 1" in bad.value.message


def test_a_level_faster_than_tc_shapes_is_refused(tmp_path: Path) -> None:
    fast = tmp_path / "fast.yaml"
    fast.write_text(TWO_NODES.replace("10Gb/s", "200000GB/s"))
    with pytest.raises(InputError, match="tc shapes 8000 bit/s to 1e\\+11 bit/s"):
        cluster_spec(load_topology(str(fast)), name="tb", scale=1.0)
    spec = cluster_spec(load_topology(str(fast)), name="tb", scale=MAX_RATE_BPS / 1.6e15)
    assert all(MIN_RATE_BPS <= link.rate_bps <= MAX_RATE_BPS * (1 + 1e-9) for link in spec.links)


def test_a_probe_server_dies_with_its_sigkilled_parent() -> None:
    """The parent (standing in for `measure`) starts a server as measure does, then is SIGKILLed."""
    code = ("import os, subprocess, sys, time\n"
            "from testbed.interpreter import python_argv, python_env\n"
            "p = subprocess.Popen(python_argv('-m', 'testbed.cluster.probe', 'serve', '127.0.0.1', '0'),\n"
            "                     env={**python_env(), 'TESTBED_PROBE_PARENT': str(os.getpid())}, stdout=subprocess.PIPE,\n"
            "                     text=True, start_new_session=True)\n"
            "assert p.stdout.readline().strip() == 'ready'\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(600)\n")
    parent = subprocess.Popen(python_argv("-c", code), stdout=subprocess.PIPE, text=True, env=python_env())
    try:
        server = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _running(server):
        time.sleep(0.1)
    alive = _running(server)
    if alive:
        os.kill(server, signal.SIGKILL)
    assert not alive, "the probe server outlived its parent"


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_a_probe_server_that_cannot_listen_says_why(capsys: pytest.CaptureFixture) -> None:
    import socket

    from testbed.cluster import probe

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert probe._main(["serve", "127.0.0.1", str(busy.getsockname()[1])]) == 1
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


@needs_netns
def test_another_tools_namespace_is_never_removed(folder: Path, capsys: pytest.CaptureFixture) -> None:
    """A `tbc-A-B-C` namespace testbed did not record, with a process inside, survives leftovers cleanup, `down`
    and `down --all`; the cluster testbed made next to it goes."""
    foreign = f"tbc-other{TAG}-tool-x"
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", foreign, "sleep", "300"])
    try:
        assert foreign not in netns.namespaces()
        netns.remove_leftovers()
        assert main(["cluster", "down", f"other{TAG}"]) == 2
        spec = cluster_spec(load_topology("eth-4x2"), name=f"mine{TAG}", scale=0.001)
        netns.build(spec, "keep")
        state.write_state(spec.name, "eth-4x2", spec.scale, spec.mtu)
        assert main(["cluster", "down", "--all", "--json"]) == 0
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["namespaces_removed"] == 5
        assert foreign in _listed() and sleeper.poll() is None
        assert not [ns for ns in _listed() if ns.startswith(f"tbc-mine{TAG}-")]
    finally:
        sleeper.kill()
        sleeper.wait()
        subprocess.run(["ip", "netns", "delete", foreign], capture_output=True)


def _up(folder: Path, name: str) -> subprocess.Popen:
    topology = folder / "eth-2x1.yaml"
    topology.write_text(TWO_NODES)
    return subprocess.Popen(python_argv("-m", "testbed.cli", "cluster", "up", name, "--topology", str(topology),
                                        "--scale", "0.01"), env=python_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_namespace(prefix: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(ns.startswith(prefix) for ns in _listed()):
            return
        time.sleep(0.01)
    raise AssertionError(f"no namespace {prefix}* appeared")


@needs_netns
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_a_signal_during_up_removes_what_it_built(folder: Path, signum: int) -> None:
    name = f"sig{TAG}"
    proc = _up(folder, name)
    try:
        _wait_for_namespace(f"tbc-{name}-keep-")
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "Traceback" not in err, err
    assert not [ns for ns in _listed() if ns.startswith(f"tbc-{name}-")]
    assert not (folder / "state" / f"{name}.json").exists()


@needs_netns
def test_a_sigkilled_up_is_removed_by_the_next_up(folder: Path, capsys: pytest.CaptureFixture) -> None:
    name = f"kil{TAG}"
    proc = _up(folder, name)
    try:
        _wait_for_namespace(f"tbc-{name}-keep-")
    finally:
        proc.kill()
        proc.communicate()
    assert main(["collective", "all_reduce", "--topology", "eth-4x2", "--execute", f"cluster:{name}", "--bytes",
                 "1KiB"]) == 2
    assert "no cluster" in capsys.readouterr().err
    assert main(["cluster", "up", name, "--topology", str(folder / "eth-2x1.yaml"), "--scale", "0.01",
                 "--json"]) == 0
    assert name in json.loads(capsys.readouterr().out)["removed_leftovers"]
    assert main(["cluster", "down", name]) == 0


@needs_netns
def test_two_concurrent_ups_of_one_name_build_one_cluster(folder: Path) -> None:
    name = f"two{TAG}"
    procs = [_up(folder, name) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    try:
        assert sorted(p.returncode for p in procs) == [0, 2], outs
        assert not any("Traceback" in err for _, err in outs)
        assert len([c for c in netns.clusters() if c.name == name]) == 1
    finally:
        netns.remove(name)
        state.remove_state(name)


def test_a_build_that_lost_the_name_leaves_the_winners_owner_record(folder: Path) -> None:
    """The record of a namespace another process made is not removed by a build whose ``ip netns add`` of it failed
    (testbed.cluster.netns.build: ``remove_owner`` with its own builder token): the winner's namespace stays listed,
    so ``cluster down`` removes it."""
    ns = f"tbc-won{TAG}-keep-sw"
    state.write_owner(ns, "winner", made=False)
    state.remove_owner(ns, "loser")
    assert state.owner_record(ns) == {"namespace": ns, "inode": None, "builder": "winner"}
    state.remove_owner(ns, "winner")
    assert state.owner_record(ns) is None


def test_a_held_name_makes_a_second_holder_wait(folder: Path) -> None:
    """``state.name_held``: while one process holds a cluster's name another's hold waits for it (``cluster up``
    checks the name is free and builds it under the hold): the second gets it no earlier than the first lets go."""
    code = ("import sys, time; from testbed.cluster import state\n"
            "with state.name_held('held'):\n"
            "    print('in', time.time(), flush=True); time.sleep(float(sys.argv[1])); print('out', time.time())\n")
    env = {**os.environ, "TESTBED_CLUSTER_STATE": str(folder / "state")}
    with subprocess.Popen([sys.executable, "-c", code, "1.5"], env=env, stdout=subprocess.PIPE, text=True) as first:
        try:
            assert first.stdout.readline().split()[0] == "in"
            second = subprocess.run([sys.executable, "-c", code, "0"], env=env, capture_output=True, text=True,
                                    timeout=60)
            released = float(first.communicate(timeout=60)[0].split()[1])
        finally:
            first.kill()
    got = float(second.stdout.split()[1])
    assert got >= released, (got, released)
