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
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.errors import InputError
from testbed.explore.sweep_spec import PointTask, SweepSpec, expand

__all__ = ["COLUMNS", "EXECUTORS", "SweepDB", "SweepSummary", "evaluate_point", "run_sweep", "read_rows",
           "pareto_front"]

#: The fixed columns of the ``points`` table (each grid key adds a VARCHAR column named by its path).
COLUMNS: dict[str, str] = {
    "key": "VARCHAR PRIMARY KEY", "sweep": "VARCHAR", "point": "INTEGER", "params": "VARCHAR",
    "status": "VARCHAR", "error": "VARCHAR",
    "topology": "VARCHAR", "device_type": "VARCHAR", "devices": "INTEGER", "levels": "VARCHAR",
    "plan": "VARCHAR", "model_params": "BIGINT", "global_batch": "INTEGER", "seq_len": "INTEGER",
    "tokens_per_step": "BIGINT", "data": "INTEGER", "fsdp": "INTEGER", "tensor": "INTEGER", "stage": "INTEGER",
    "expert": "INTEGER", "context": "INTEGER",
    "schedule": "VARCHAR", "virtual_stages": "INTEGER", "microbatches": "INTEGER", "zero": "INTEGER",
    "remat": "VARCHAR", "precision": "VARCHAR", "plan_json": "VARCHAR",
    "step_time_s": "DOUBLE", "compute_s": "DOUBLE", "exposed_comm_s": "DOUBLE", "bubble_fraction": "DOUBLE",
    "mfu": "DOUBLE", "memory_bytes": "BIGINT", "capacity_bytes": "BIGINT", "fits": "BOOLEAN",
    "tokens_per_s": "DOUBLE", "price_per_device_hour": "DOUBLE", "dollars_per_step": "DOUBLE",
    "tokens_per_dollar": "DOUBLE", "searched": "BOOLEAN", "search_enumerated": "INTEGER",
    "search_estimated": "INTEGER", "eval_s": "DOUBLE",
}
EXECUTORS = ("process", "ray", "dask")


def _param_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def evaluate_point(task: PointTask) -> dict[str, Any]:
    """The database row of one point: its parameters, the plan it ran and the DES breakdown (pure, picklable)."""
    from testbed.plan.io import plan_from_dict, plan_to_dict
    from testbed.sim.engine import simulate
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
    m = plan.mesh
    tokens = plan.tokens_per_step
    row.update(status="ok", error=None, plan=plan.name, model_params=int(report.memory.get("params_count", 0)),
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
        row.update(dollars_per_step=dollars, tokens_per_dollar=tokens / dollars)
    row["eval_s"] = time.perf_counter() - start
    return row


def _duckdb():
    try:
        import duckdb
    except ModuleNotFoundError:
        raise InputError("the sweep database needs the `duckdb` package: pip install duckdb", field="--db") from None
    return duckdb


class SweepDB:
    """The DuckDB file of a sweep: ``points`` (one row per point key). One writer: the process that opened it."""

    def __init__(self, path: str | Path, read_only: bool = False):
        duckdb = _duckdb()
        self.path = Path(path)
        if read_only and not self.path.is_file():
            raise InputError(f"no sweep database at `{path}`", field="--db")
        try:
            self.con = duckdb.connect(str(self.path), read_only=read_only)
        except duckdb.Error as exc:  # locked by a running sweep, or not a DuckDB file
            raise InputError(f"cannot open the sweep database `{path}`: {str(exc).splitlines()[0]}",
                             field="--db") from None
        if not read_only:
            cols = ", ".join(f'"{c}" {t}' for c, t in COLUMNS.items())
            self.con.execute(f"CREATE TABLE IF NOT EXISTS points ({cols})")
            missing = [c for c in COLUMNS if c not in self.columns()]
            for c in missing:  # a database an older testbed wrote gains the newer columns (NULL in its rows)
                self.con.execute(f'ALTER TABLE points ADD COLUMN "{c}" {COLUMNS[c]}')

    def __enter__(self) -> "SweepDB":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.con.close()

    def columns(self) -> list[str]:
        return [r[0] for r in self.con.execute("SELECT column_name FROM information_schema.columns "
                                               "WHERE table_name = 'points' ORDER BY ordinal_position").fetchall()]

    def add_param_columns(self, paths: Iterable[str]) -> None:
        for p in paths:
            self.con.execute(f'ALTER TABLE points ADD COLUMN IF NOT EXISTS "{p}" VARCHAR')

    def keys(self) -> set[str]:
        return {r[0] for r in self.con.execute("SELECT key FROM points").fetchall()}

    def insert(self, row: dict[str, Any]) -> bool:
        """Insert one row in its own transaction; False (and nothing written) when its key is already there."""
        cols = list(row)
        names = ", ".join(f'"{c}"' for c in cols)
        marks = ", ".join("?" for _ in cols)
        self.con.execute("BEGIN TRANSACTION")
        try:
            done = self.con.execute("SELECT count(*) FROM points WHERE key = ?", [row["key"]]).fetchone()[0]
            if not done:
                self.con.execute(f"INSERT INTO points ({names}) VALUES ({marks})", [row[c] for c in cols])
            self.con.execute("COMMIT")
        except BaseException:
            self.con.execute("ROLLBACK")
            raise
        return not done

    def rows(self, where: str = "", args: list | None = None) -> list[dict[str, Any]]:
        cur = self.con.execute(f"SELECT * FROM points {where} ORDER BY sweep, point", args or [])
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]


def read_rows(path: str | Path, sweep: str | None = None) -> list[dict[str, Any]]:
    """Every row of a sweep database (of one sweep when named), ordered by sweep and point."""
    with SweepDB(path, read_only=True) as db:
        return db.rows("WHERE sweep = ?", [sweep]) if sweep else db.rows()


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

        return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
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
    with SweepDB(db_path) as db:
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
