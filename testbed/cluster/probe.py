"""The host's TCP on an emulated cluster, measured: loopback throughput in a node, one-way latency per hop.

The simulator prices an emulated cluster (``ClusterSpec.emulated_topology``)
with what the host's network stack adds and the shaping does not set: the
bandwidth between two processes of one node (TCP over the namespace's
loopback, which gloo uses between the devices of one process and the next)
and the latency of a hop (no delay is emulated; what is left is the
kernel's and the bridge's). Both are measured here with plain sockets:

- latency: 1-byte ping-pong over TCP (``TCP_NODELAY``), median round trip
  over 2, inside node 0 and between nodes 0 and 1. In the emulated
  topology a path inside a node is two hops of the node level (device,
  node switch, device) and one across nodes adds two hops of the network
  level: inner hop = loopback / 2, network hop = (across - loopback) / 2;
- loopback: 32 MiB streamed over TCP inside node 0.

Run as ``python -m testbed.cluster.probe serve HOST PORT`` or ``... client
HOST PORT LOOP_PORT`` inside the namespaces (by :func:`measure`), without the
working directory on ``sys.path`` (:mod:`testbed.interpreter`). A server dies
with the process that started it, even a SIGKILLed one (a parent-death signal
and a watchdog, :func:`testbed.lifetime.die_with_parent`), so no orphan keeps
a kept cluster's probe port.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from testbed.cluster.spec import ClusterSpec, namespace_name
from testbed.interpreter import python_argv, python_env
from testbed.lifetime import die_with_parent

__all__ = ["ProbeResult", "measure"]

_CHUNK = 1 << 20
_PORT = 7455
#: The pid a probe server dies with (the process running :func:`measure`).
_PARENT = "TESTBED_PROBE_PARENT"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeResult:
    """Loopback TCP throughput inside a node (bytes/s); one-way latencies inside a node and from node 0 to 1."""

    loopback_bandwidth: float
    loopback_latency_s: float
    across_latency_s: float

    @property
    def inner_hop_s(self) -> float:
        """One hop of the node level (a path inside a node is two)."""
        return self.loopback_latency_s / 2

    @property
    def network_hop_s(self) -> float:
        """One hop of a network level (a path across nodes adds two)."""
        return max(self.across_latency_s - self.loopback_latency_s, 0.0) / 2


def _serve(host: str, port: int) -> None:
    """Answer connections one at a time: mode ``e`` echoes single bytes, ``s`` drains a stream."""
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((host, port))
        srv.listen(4)
        print("ready", flush=True)
        _answer(srv)


def _answer(srv: socket.socket) -> None:
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = conn.recv(1)
        while True:
            data = conn.recv(1 if mode == b"e" else _CHUNK)
            if not data:
                break
            if mode == b"e":
                conn.sendall(data)
        conn.close()


def _latency(host: str, port: int, rounds: int = 400) -> float:
    with socket.create_connection((host, port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(b"e")
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            conn.sendall(b"x")
            conn.recv(1)
            times.append(time.perf_counter() - start)
    return statistics.median(times[rounds // 10:]) / 2


def _throughput(host: str, port: int, nbytes: int = 32 * _CHUNK) -> float:
    buf = b"\0" * _CHUNK
    with socket.create_connection((host, port)) as conn:
        conn.sendall(b"s")
        start = time.perf_counter()
        for _ in range(nbytes // _CHUNK):
            conn.sendall(buf)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # the server closes once it has drained everything
        return nbytes / (time.perf_counter() - start)


def _exec(ns: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *python_argv("-m", "testbed.cluster.probe", *args)]


def _start_server(ns: str, host: str) -> subprocess.Popen:
    """A probe server in namespace ``ns``, dying with this process however it ends (:data:`_PARENT`)."""
    env = {**python_env(), _PARENT: str(os.getpid())}
    return subprocess.Popen(_exec(ns, "serve", host, str(_PORT)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)


def _stop(server: subprocess.Popen) -> str:
    """Kill a server's process group and reap it; its stderr's last line (why it ended, if it did early)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()
    err = server.stderr.read() if server.stderr else ""
    for stream in (server.stdout, server.stderr):
        if stream:
            stream.close()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def measure(spec: ClusterSpec, owner: str) -> ProbeResult:
    """Probe a built cluster (nodes 0 and 1): one server per node, one client in node 0.

    A server that cannot listen (its port taken in the namespace) raises
    :class:`testbed.cluster.netns.ClusterError` naming the namespace and why.
    """
    from testbed.cluster.netns import ClusterError

    n0, n1 = (namespace_name(spec.name, owner, spec.nodes[i].role) for i in (0, 1))
    servers: list[tuple[str, subprocess.Popen]] = []
    try:
        for ns, host in ((n1, spec.nodes[1].address), (n0, "127.0.0.1")):
            servers.append((ns, _start_server(ns, host)))
            if servers[-1][1].stdout.readline().strip() != "ready":
                raise ClusterError(f"the TCP probe's server in namespace {ns} did not start: "
                                   f"{_stop(servers.pop()[1]) or 'no reason given'}")
        client = subprocess.run(_exec(n0, "client", spec.nodes[1].address, str(_PORT), str(_PORT)),
                                capture_output=True, text=True, timeout=120, env=python_env())
        if client.returncode != 0:
            raise ClusterError(f"the TCP probe's client in namespace {n0} failed ({client.returncode}): "
                               f"{client.stderr.strip()[-300:]}")
    finally:
        for _, server in servers:
            _stop(server)
    data = json.loads(client.stdout)
    return ProbeResult(loopback_bandwidth=data["loopback"], loopback_latency_s=data["loopback_latency"],
                       across_latency_s=data["latency"])


def _main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        parent = os.environ.get(_PARENT, "")
        if parent.isdigit():  # a SIGKILLed measure() cannot stop its servers: each stops itself
            die_with_parent(int(parent))
        try:
            _serve(argv[1], int(argv[2]))
        except OSError as exc:
            sys.stderr.write(f"cannot listen on {argv[1]}:{argv[2]}: {exc.strerror or exc}\n")
            return 1
        return 0
    if argv[:1] == ["client"]:
        print(json.dumps({"latency": _latency(argv[1], int(argv[2])),
                          "loopback_latency": _latency("127.0.0.1", int(argv[3])),
                          "loopback": _throughput("127.0.0.1", int(argv[3]))}))
        return 0
    sys.stderr.write("testbed.cluster.probe is started by testbed.cluster.probe.measure\n")
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
