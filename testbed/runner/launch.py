"""Multi-process launcher: K local worker processes joined by ``jax.distributed``.

``testbed run --processes K`` and ``testbed calibrate --processes K`` start K
copies of this module as workers on 127.0.0.1 (gloo collectives on CPU, N/K
emulated devices each). Worker ``i`` calls
``jax.distributed.initialize("127.0.0.1:PORT", K, i)``, runs the command body
the payload names (``payload["body"]``, a key of :data:`BODIES`; ``run`` when
absent), and writes its result as JSON to a file the launcher names. The
launcher watches all of them:

- a worker that exits non-zero, or whose heartbeat file goes stale (a hung
  process: stopped, deadlocked, swapped out), stops the job: the launcher
  kills every worker's process group and raises :class:`WorkerFailed` naming
  the worker, its exit status and the tail of its stderr;
- a coordinator port that turns out busy is retried on a fresh port;
- workers run under the caller's ``XLA_FLAGS`` as a one-process run does, each with its own device count
  (:func:`testbed.runner.devices.prepare` replaces the caller's);
- a SIGKILLed launcher cannot stop its workers, so each worker dies with it
  (a parent-death signal and a watchdog, :func:`testbed.lifetime.die_with_parent`),
  and the next launch removes the scratch folder it left.

On a real cluster no launcher is needed: start one process per host (SLURM
``srun``, a TPU pod's ``gcloud ... --worker=all``) and JAX reads the
coordinator, process count and id from the environment
(``jax.distributed.initialize()`` with no arguments).

Fault injection for tests: ``TESTBED_FAULT=exit:I`` makes worker I exit with
status 3 after joining; ``TESTBED_FAULT=hang:I`` makes it stop itself
(SIGSTOP), as a hung process would.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.interpreter import python_argv, python_env

__all__ = ["launch", "WorkerFailed", "free_port", "port_is_free", "worker_context", "WorkerContext", "BODIES"]

#: Command bodies a worker can run: payload ``body`` -> ``module:function`` taking the payload, returning a dict.
#: Named by string so the launcher imports only the body a job runs.
BODIES: dict[str, str] = {"run": "testbed.runner.train:worker_body", "calibrate": "testbed.runner.calibrate_multi:worker_body",
                          "collective": "testbed.runner.cluster_collective:worker_body",
                          "verify": "testbed.runner.train:verify_worker_body",
                          "phases": "testbed.runner.link_phases:worker_body",
                          "collective_phases": "testbed.runner.link_phases:collective_worker_body"}

_ENV = "TESTBED_WORKER"
_LAUNCHER_ENV = "TESTBED_LAUNCHER_PID"
_WORKDIR = "testbed-launch-"  # + the launcher's pid + "-": the scratch folder of one job
_PORT_RETRIES = 3
_BUSY_MARKERS = ("address already in use", "failed to bind", "bind failed", "errno 98")


class WorkerFailed(RuntimeError):
    """A worker process died, hung or reported an error; the job was stopped."""

    def __init__(self, message: str, *, worker: int, exit_code: int | None, port_busy: bool = False):
        super().__init__(message)
        self.worker = worker
        self.exit_code = exit_code
        self.port_busy = port_busy


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerContext:
    """What one worker knows about its job (read from the environment)."""

    coordinator: str
    num_processes: int
    process_id: int
    local_devices: int
    result_file: str
    heartbeat_file: str
    payload: dict
    bind_host: str | None = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    kept = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("[Gloo]")]
    return "\n".join(kept[-lines:])


def _kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each worker's own process group (workers start in new sessions), then reap."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _run_once(payload: dict, processes: int, local_devices: int, port: int, workdir: Path,
              stale_s: float, timeout_s: float | None, hosts: Sequence[str] | None = None,
              prefixes: Sequence[Sequence[str]] | None = None) -> list[dict]:
    procs: list[subprocess.Popen] = []
    results = [workdir / f"result-{i}.json" for i in range(processes)]
    beats = [workdir / f"heartbeat-{i}" for i in range(processes)]
    errs = [workdir / f"stderr-{i}.txt" for i in range(processes)]
    for path in results + beats:
        path.unlink(missing_ok=True)
    try:
        for i in range(processes):
            env = python_env()  # nothing from the working directory on the worker's sys.path
            env[_ENV] = json.dumps({
                "coordinator": f"127.0.0.1:{port}", "num_processes": processes, "process_id": i,
                "local_devices": local_devices, "result_file": str(results[i]), "heartbeat_file": str(beats[i]),
                "payload": payload})
            if hosts:  # an emulated cluster: the coordinator on the first node, each worker on its node's address
                env[_ENV] = json.dumps({**json.loads(env[_ENV]), "coordinator": f"{hosts[0]}:{port}",
                                        "bind_host": hosts[i]})
            env[_LAUNCHER_ENV] = str(os.getpid())  # the worker dies with this process (testbed.lifetime)
            with open(errs[i], "wb") as err:
                prefix = list(prefixes[i]) if prefixes else []  # e.g. `ip netns exec NS`: a worker per namespace
                procs.append(subprocess.Popen([*prefix, *python_argv("-m", "testbed.runner.launch")], env=env,
                                              stdout=subprocess.DEVNULL, stderr=err, start_new_session=True))
        start = time.monotonic()
        while True:
            codes = [p.poll() for p in procs]
            for i, code in enumerate(codes):
                if code is not None and code != 0:
                    tail = _tail(errs[i])
                    busy = any(m in tail.lower() for m in _BUSY_MARKERS)
                    raise WorkerFailed(f"worker {i} of {processes} exited with status {code}"
                                       + (f" (signal {-code})" if code < 0 else "") + ". Its last stderr lines:\n"
                                       + (tail or "(none)"), worker=i, exit_code=code, port_busy=busy)
            if all(c == 0 for c in codes):
                break
            now = time.time()
            for i, beat in enumerate(beats):
                if codes[i] is None and beat.exists() and now - beat.stat().st_mtime > stale_s:
                    raise WorkerFailed(f"worker {i} of {processes} hung: no heartbeat for {stale_s:.0f} s "
                                       f"(the process is alive but stopped or deadlocked). Its last stderr lines:\n"
                                       + (_tail(errs[i]) or "(none)"), worker=i, exit_code=None)
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise WorkerFailed(f"the job ran past its {timeout_s:.0f} s limit; workers stopped",
                                   worker=-1, exit_code=None)
            time.sleep(0.2)
    finally:
        _kill_all(procs)
    out = []
    for i, path in enumerate(results):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            raise WorkerFailed(f"worker {i} exited cleanly but left no result", worker=i, exit_code=0) from None
    return out


def launch(payload: dict, *, processes: int, local_devices: int, port: int | None = None,
           stale_s: float = 15.0, timeout_s: float | None = None, hosts: Sequence[str] | None = None,
           prefixes: Sequence[Sequence[str]] | None = None) -> list[dict]:
    """Run ``payload`` (a command's arguments) on ``processes`` local workers; their results in order.

    ``payload["body"]`` names the command body each worker runs (a key of
    :data:`BODIES`, default ``run``). ``port`` None picks a free coordinator
    port and retries busy ones; a given busy port raises InputError. A dead or
    hung worker stops the whole job within ``stale_s`` plus a second.
    ``hosts`` (one address per worker, the coordinator on the first) and
    ``prefixes`` (a command each worker starts under, e.g. ``ip netns exec
    NS``) run the workers on an emulated cluster (:mod:`testbed.cluster`);
    by default all listen on 127.0.0.1.
    """
    from testbed.errors import InputError

    if payload.get("body", "run") not in BODIES:
        raise ValueError(f"unknown worker body {payload.get('body')!r}; known: {', '.join(BODIES)}")
    if port is not None and not port_is_free(port):
        raise InputError(f"coordinator port {port} on 127.0.0.1 is busy; pick another or leave it out "
                         f"to use a free one", field="--port")
    from testbed.lifetime import remove_stale_folders

    remove_stale_folders(Path(tempfile.gettempdir()), _WORKDIR)  # left by a SIGKILLed launcher
    with tempfile.TemporaryDirectory(prefix=f"{_WORKDIR}{os.getpid()}-") as tmp:
        for attempt in range(_PORT_RETRIES):
            chosen = port if port is not None else free_port()
            try:
                return _run_once(payload, processes, local_devices, chosen, Path(tmp), stale_s, timeout_s,
                                 hosts, prefixes)
            except WorkerFailed as exc:
                if not exc.port_busy or port is not None or attempt == _PORT_RETRIES - 1:
                    raise
    raise AssertionError("unreachable")


def worker_context() -> WorkerContext | None:
    """This process's worker context, or None outside a launched job."""
    raw = os.environ.get(_ENV)
    if not raw:
        return None
    data = json.loads(raw)
    return WorkerContext(**data)


def _heartbeat(path: str, period: float = 1.0) -> None:
    def beat() -> None:
        while True:
            Path(path).touch()
            time.sleep(period)

    threading.Thread(target=beat, daemon=True, name="testbed-heartbeat").start()


def _inject_fault(process_id: int) -> None:
    fault = os.environ.get("TESTBED_FAULT", "")
    kind, _, who = fault.partition(":")
    if not who or int(who) != process_id:
        return
    if kind == "exit":
        sys.stderr.write(f"worker {process_id}: injected fault, exiting with status 3\n")
        sys.stderr.flush()
        os._exit(3)
    if kind == "hang":
        sys.stderr.write(f"worker {process_id}: injected fault, stopping (SIGSTOP)\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSTOP)


def _body(name: str) -> Callable[[dict], dict]:
    """The worker body function registered under ``name`` in :data:`BODIES`."""
    module, _, function = BODIES[name].partition(":")
    return getattr(importlib.import_module(module), function)


def _worker_main() -> int:
    context = worker_context()
    if context is None:
        sys.stderr.write("testbed.runner.launch is started by `testbed run --processes K` or `testbed calibrate "
                         "--processes K`, not by hand\n")
        return 2
    _heartbeat(context.heartbeat_file)
    from testbed.runner import devices
    from testbed.output import to_jsonable, write_atomic

    devices.prepare(devices.DeviceRequest(kind="emulated", count=context.local_devices * context.num_processes),
                    local_count=context.local_devices)
    # Local workers listen on loopback only (the coordinator's host), never on every interface.
    devices.initialize_distributed(context.coordinator, context.num_processes, context.process_id,
                                   bind_host=context.bind_host or context.coordinator.rpartition(":")[0])
    _inject_fault(context.process_id)
    data = _body(context.payload.get("body", "run"))(context.payload)
    write_atomic(context.result_file, json.dumps(to_jsonable(data), default=str))
    import jax

    jax.distributed.shutdown()  # a barrier: no worker leaves while a peer still needs it
    return 0


def _die_with_launcher() -> None:
    """A SIGKILLed launcher cannot stop its workers: each worker stops itself when the launcher dies."""
    launcher = os.environ.get(_LAUNCHER_ENV, "")
    if launcher.isdigit():
        from testbed.lifetime import die_with_parent

        die_with_parent(int(launcher))


if __name__ == "__main__":
    _die_with_launcher()
    code = _worker_main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: JAX's distributed client may block at exit while peers finish.
    os._exit(code)
