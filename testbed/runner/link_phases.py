"""A plan's steps on an emulated cluster in phases, the links reshaped between them, in one job.

``testbed validate --cluster`` and ``benchmarks/cluster_steps.py`` need the
step on the shaped links and the host's part of it: the same step with the
links unshaped. Timed in two jobs, the two are minutes apart and each job
starts JAX and compiles anew: on a shared host the load moves between them
(the unshaped tensor-parallel step of ``benchmarks/cluster_steps.py`` was
0.16-0.42 s at one rate over runs), and the host's part read from the second
job is not the first job's. Here one job of one worker per node builds the
trainer once and runs its phases in turn (shaped, unshaped, shaped, ... as
the caller orders them); between phases every worker waits for the caller's
go, and the caller (:func:`run_phases`) reshapes the links meanwhile. Shaped
and unshaped steps are then timed by the same processes, with the same
compiled program, interleaved, so a change in the load reaches both.

The hand-over is through files in a folder both sides see (the namespaces
share the machine's filesystem): the caller writes ``go-K`` when phase K's
links are in place; each worker writes ``done-K-P`` when its steps of phase K
are timed. Each phase runs one step more than it times: the first one
absorbs the workers' staggered start and the links' change.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["worker_body", "collective_worker_body", "run_phases", "phase_medians"]

_POLL_S = 0.005


def _wait_for(path: Path, timeout_s: float, stop: threading.Event | None = None) -> bool:
    """Wait until ``path`` exists (True), ``timeout_s`` passes or ``stop`` is set (False)."""
    end = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > end or (stop is not None and stop.is_set()):
            return False
        time.sleep(_POLL_S)
    return True


def worker_body(payload: dict[str, Any]) -> dict[str, Any]:
    """One worker's phases: warm-up (compiles), then per phase wait for ``go-K``, time ``steps`` steps after one
    untimed, write ``done-K-P``. Payload: ``plan``, ``steps``, ``phases`` (names), ``sync`` (the folder)."""
    import jax

    from testbed.plan.io import plan_from_dict
    from testbed.runner.devices import select_devices
    from testbed.runner.launch import worker_context
    from testbed.runner.train import build_trainer

    plan = plan_from_dict(payload["plan"], default_name=payload["plan"].get("name", "plan"))
    sync, me = Path(payload["sync"]), worker_context().process_id
    trainer = build_trainer(plan, select_devices(plan.mesh.size))
    start = time.perf_counter()
    state = trainer.init()
    state, loss = trainer.step(state, 0)
    jax.block_until_ready((state, loss))
    compile_s, index, phases = time.perf_counter() - start, 1, []
    for k, _ in enumerate(payload["phases"]):
        if not _wait_for(sync / f"go-{k}", float(payload.get("timeout_s", 600))):
            raise TimeoutError(f"no go for phase {k} within {payload.get('timeout_s', 600)} s")
        times = []
        for i in range(int(payload["steps"]) + 1):
            t = time.perf_counter()
            state, loss = trainer.step(state, index)
            jax.block_until_ready((state, loss))
            index += 1
            if i:
                times.append(time.perf_counter() - t)
        phases.append(times)
        (sync / f"done-{k}-{me}").touch()
    from testbed.runner.step import scalar

    value = scalar(loss) if loss is not None and loss.addressable_shards else None
    return {"phases": phases, "compile_time_s": compile_s, "loss": value}


def collective_worker_body(payload: dict[str, Any]) -> dict[str, Any]:
    """One worker's collectives in phases: per phase wait for ``go-K``, time that phase's ``calls`` (``[op,
    bytes, repeats]`` each, or ``[op, bytes, repeats, warmup]``, as
    :func:`testbed.runner.cluster_collective.collective_times`), write ``done-K-P``.
    Payload: ``phase_calls`` (one list of calls per phase), ``phases``, ``sync``, ``warmup`` (default 2)."""
    from testbed.runner.cluster_collective import collective_times
    from testbed.runner.launch import worker_context

    sync, me, warmup = Path(payload["sync"]), worker_context().process_id, int(payload.get("warmup", 2))
    phases = []
    for k, calls in enumerate(payload["phase_calls"]):
        if not _wait_for(sync / f"go-{k}", float(payload.get("timeout_s", 600))):
            raise TimeoutError(f"no go for phase {k} within {payload.get('timeout_s', 600)} s")
        phases.append([collective_times(op, int(size), int(count), int(rest[0]) if rest else warmup)
                       for op, size, count, *rest in calls])
        (sync / f"done-{k}-{me}").touch()
    return {"phases": phases}


def run_phases(launch: Callable[[dict], list[dict]], payload: dict, phases: Sequence[str], workers: int,
               set_links: Callable[[str], None], sync: Path, *, timeout_s: float = 600,
               body: str = "phases") -> list[dict]:
    """Run the phased ``payload`` through ``launch`` (one worker per node); before phase K, ``set_links(name)``.

    ``body``: ``phases`` (a plan's steps, :func:`worker_body`) or ``collective_phases``
    (:func:`collective_worker_body`).

    The links are set by a thread of this process while the workers wait; the workers' results in order.
    """
    stop, failure = threading.Event(), []

    def conduct() -> None:
        try:
            for k, name in enumerate(phases):
                if k and not all(_wait_for(sync / f"done-{k - 1}-{p}", timeout_s, stop) for p in range(workers)):
                    return
                set_links(name)
                (sync / f"go-{k}").touch()
        except Exception as exc:  # reported after the job; the workers time out waiting for go
            failure.append(exc)

    conductor = threading.Thread(target=conduct, daemon=True, name="testbed-link-phases")
    conductor.start()
    try:
        results = launch({**payload, "body": body, "phases": list(phases), "sync": str(sync),
                          "timeout_s": timeout_s})
    finally:
        stop.set()
        conductor.join(timeout=30)
    if failure:
        raise failure[0]
    return results


def phase_medians(results: list[dict], phases: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per phase name: every timed step (the slowest worker's, phases of one name in order) and their median."""
    out: dict[str, dict[str, Any]] = {}
    for k, name in enumerate(phases):
        per_step = [max(ts) for ts in zip(*[r["phases"][k] for r in results])]
        out.setdefault(name, {"step_times_s": []})["step_times_s"].extend(per_step)
    loss = next((r["loss"] for r in results if r.get("loss") is not None), None)
    for timed in out.values():
        timed["median_step_s"] = statistics.median(timed["step_times_s"])
        timed["loss"] = loss
        timed["compile_time_s"] = results[0].get("compile_time_s")
    return out
