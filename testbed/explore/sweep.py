"""``testbed sweep``: evaluate every point of a SPEC's grid into a DuckDB database, resumably, in parallel.

- :func:`evaluate_point` is a pure function of a :class:`PointTask` (plain
  mappings in, one plain row out), so it runs in this process, in a
  ``ProcessPoolExecutor`` worker, or on a Ray or Dask cluster unchanged. A
  point either simulates the SPEC's plan (the DES report) or, with
  ``search:``, runs :func:`testbed.explore.search.search` on its topology
  and keeps the best plan's DES report. A plan that does not suit the
  point's topology becomes a row with ``status = 'invalid'`` and the error.
- :class:`SweepDB` is the database: one table ``points``, one row per point,
  primary key = the point's key (a hash of the resolved plan, topology,
  search options and price). Only this process writes; each row is its own
  transaction, so a sweep killed at any moment keeps exactly the rows
  committed before, and a rerun skips their keys.
- :func:`run_sweep` ties them together with an executor: ``process``
  (default; ``workers`` processes, 1 = in this process), ``ray`` or ``dask``
  (optional extras, imported only when asked for).
- :func:`pareto_front` and :func:`read_rows` serve the plots.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.errors import InputError
from testbed.explore.sweep_db import COLUMNS, SweepDB, read_rows
from testbed.explore.sweep_spec import PointTask, SweepSpec, expand

__all__ = ["COLUMNS", "EXECUTORS", "SweepDB", "SweepSummary", "evaluate_point", "run_sweep", "read_rows",
           "pareto_front"]

EXECUTORS = ("process", "ray", "dask")


def _param_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def evaluate_point(task: PointTask) -> dict[str, Any]:
    """The database row of one point: its parameters, the plan it ran and the DES breakdown (pure, picklable)."""
    from testbed.plan.io import plan_from_dict
    from testbed.sim.graph.engine import simulate
    from testbed.topology.io import topology_from_dict

    start = time.perf_counter()
    topo = task.topology
    row: dict[str, Any] = {"key": task.key, "sweep": task.sweep, "point": task.index,
                           "params": json.dumps(dict(task.params), sort_keys=True, default=str),
                           "device_type": topo["device"].get("name", "device"), "topology": topo.get("name"),
                           "price_per_device_hour": task.price_per_device_hour, "searched": task.search is not None}
    row.update({path: _param_text(value) for path, value in task.params})
    try:
        topology = topology_from_dict(topo)
        row["devices"] = topology.num_devices
        row["levels"] = json.dumps([{"name": lv.name, "size": lv.size, "bandwidth": lv.bandwidth,
                                     "latency": lv.latency} for lv in topology.levels])
        plan = plan_from_dict(task.plan, default_name="plan")
        if task.search is None:
            report = simulate(plan, topology).report
        else:
            from testbed.explore.search import search

            opts = task.search
            result = search(plan, topology, opts.search_space(), objective=opts.objective,
                            memory_cap=opts.memory_cap, replay=opts.replay, top=1,
                            price_per_device_hour=task.price_per_device_hour)
            row["search_enumerated"], row["search_estimated"] = result.enumerated, result.estimated
            plan, report = result.best.plan, result.best.report
    except InputError as exc:
        row.update(status="invalid", error=exc.render(), eval_s=time.perf_counter() - start)
        return row
    except (ArithmeticError, ValueError, RecursionError, MemoryError) as exc:  # an extreme value the model
        # cannot carry (an overflow, a NaN): this point fails, the sweep goes on
        row.update(status="failed", error=_failure(exc), eval_s=time.perf_counter() - start)
        return row
    try:
        row.update(_result(task, topology, plan, report))
    except (ArithmeticError, ValueError) as exc:
        row.update(status="failed", error=_failure(exc))
    row["eval_s"] = time.perf_counter() - start
    return row


def _failure(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"the model failed on this point ({type(exc).__name__}{': ' + text[:300] if text else ''})"


def _result(task: PointTask, topology, plan, report) -> dict[str, Any]:
    """The plan and DES columns of an evaluated point; ValueError when one is not finite or overflows its column."""
    from testbed.plan.io import plan_to_dict

    m = plan.mesh
    tokens = plan.tokens_per_step
    row = dict(status="ok", error=None, plan=plan.name, model_params=int(report.memory.get("params_count", 0)),
               global_batch=plan.batch.global_batch, seq_len=plan.model.seq_len, tokens_per_step=tokens,
               data=m.data, fsdp=m.fsdp, tensor=m.tensor, stage=m.stage, expert=m.expert, context=m.context,
               schedule=plan.schedule.name.value,
               virtual_stages=plan.schedule.virtual_stages, microbatches=plan.batch.microbatches, zero=plan.zero,
               remat=plan.remat.value, precision=plan.precision.value,
               plan_json=json.dumps(plan_to_dict(plan), sort_keys=True),
               step_time_s=report.step_time_s, compute_s=report.compute_s, exposed_comm_s=report.exposed_comm_s,
               bubble_fraction=report.bubble_fraction, mfu=report.mfu,
               memory_bytes=int(report.memory.get("total", 0)), capacity_bytes=int(report.memory.get("capacity", 0)),
               fits=bool(report.memory.get("fits", True)),
               tokens_per_s=tokens / report.step_time_s if report.step_time_s > 0 else None)
    if task.price_per_device_hour and report.step_time_s > 0:
        dollars = task.price_per_device_hour * topology.num_devices * report.step_time_s / 3600.0
        row.update(dollars_per_step=dollars, tokens_per_dollar=tokens / dollars if dollars > 0 else None)
    for name, value in row.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name} is {value} (a value of the point overflows the model)")
        bits = {"INTEGER": 31, "BIGINT": 63}.get(COLUMNS[name])
        if bits and isinstance(value, int) and not -2**bits <= value < 2**bits:
            raise ValueError(f"{name} is {value}, beyond the {bits + 1}-bit integer the database holds")
    return row


@dataclass(frozen=True, slots=True)
class SweepSummary:
    total: int
    skipped: int
    evaluated: int
    invalid: int
    seconds: float


class _RayExecutor:
    def __init__(self, address: str | None):
        try:
            import ray
        except ModuleNotFoundError:
            raise InputError("`--executor ray` needs the `ray` extra: pip install 'jax-testbed[ray]'",
                             field="--executor") from None
        self._ray = ray
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
        self._remote = ray.remote(evaluate_point)

    def submit(self, fn: Callable, task: PointTask) -> Future:
        return self._remote.remote(task).future()

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        self._ray.shutdown()


class _DaskExecutor:
    def __init__(self, address: str | None, workers: int):
        try:
            from distributed import Client
        except ModuleNotFoundError:
            raise InputError("`--executor dask` needs the `dask` extra: pip install 'jax-testbed[dask]'",
                             field="--executor") from None
        self._client = Client(address) if address else Client(n_workers=workers, threads_per_worker=1)
        self._executor = self._client.get_executor(pure=False)

    def submit(self, fn: Callable, task: PointTask) -> Future:
        return self._executor.submit(fn, task)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        self._executor.shutdown(wait=wait)
        self._client.close()


def _executor(kind: str, workers: int, address: str | None):
    if kind == "process":
        import multiprocessing

        from testbed.lifetime import die_with_parent

        # Pool processes die with the sweep, even a SIGKILLed one (nothing else would stop them), and start
        # without the working directory on sys.path (their parent's sys.path follows; testbed.interpreter).
        os.environ["PYTHONSAFEPATH"] = "1"
        return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=die_with_parent, initargs=(os.getpid(),))
    if kind == "ray":
        return _RayExecutor(address)
    if kind == "dask":
        return _DaskExecutor(address, workers)
    raise InputError(f"unknown executor `{kind}`; valid: {', '.join(EXECUTORS)}", field="--executor")


def run_sweep(spec: SweepSpec, db_path: str | Path, *, executor: str = "process", workers: int | None = None,
              address: str | None = None, progress: Callable[[int, int], None] | None = None,
              on_row: Callable[[dict[str, Any]], None] | None = None) -> SweepSummary:
    """Evaluate every point of ``spec`` not yet in the database at ``db_path``; returns what was done.

    ``workers`` defaults to the CPU count; with ``executor="process"`` and one
    worker the points run in this process. ``progress(done, total)`` counts
    points already in the database as done. ``on_row`` sees each row after it
    is committed.
    """
    if executor not in EXECUTORS:
        raise InputError(f"unknown executor `{executor}`; valid: {', '.join(EXECUTORS)}", field="--executor")
    workers = workers if workers is not None else (os.cpu_count() or 1)
    if workers < 1:
        raise InputError(f"must be at least 1, got {workers}", field="--workers")
    start = time.perf_counter()
    tasks = expand(spec)
    with SweepDB(db_path, sweep=spec.name, fingerprint=spec.fingerprint) as db:
        db.add_param_columns(spec.grid_keys)
        done_keys = db.keys()
        todo = [t for t in tasks if t.key not in done_keys]
        done, invalid, evaluated = len(tasks) - len(todo), 0, 0
        if progress is not None:
            progress(done, len(tasks))

        def record(row: dict[str, Any]) -> None:
            nonlocal done, invalid, evaluated
            db.insert(row)
            done, evaluated = done + 1, evaluated + 1
            invalid += row["status"] != "ok"
            if on_row is not None:
                on_row(row)
            if progress is not None:
                progress(done, len(tasks))

        if executor == "process" and (workers == 1 or len(todo) <= 1):
            for task in todo:
                record(evaluate_point(task))
        elif todo:
            pool = _executor(executor, min(workers, len(todo)), address)
            try:
                futures = {pool.submit(evaluate_point, t): t for t in todo}
                for future in as_completed(futures):
                    record(future.result())
            finally:
                pool.shutdown(wait=False, cancel_futures=True)
    return SweepSummary(total=len(tasks), skipped=len(tasks) - len(todo), evaluated=evaluated, invalid=invalid,
                        seconds=time.perf_counter() - start)


def pareto_front(rows: list[dict[str, Any]], x: str, y: str = "step_time_s") -> list[dict[str, Any]]:
    """The rows no other row beats on both ``x`` and ``y`` (lower is better for both), sorted by ``x``.

    Rows missing either value (invalid points, unpriced cost) are ignored;
    of rows with equal ``x`` only the lowest ``y`` stays.
    """
    usable = sorted((r for r in rows if r.get(x) is not None and r.get(y) is not None),
                    key=lambda r: (r[x], r[y]))
    front, best = [], float("inf")
    for r in usable:
        if r[y] < best:
            front.append(r)
            best = r[y]
    return front
