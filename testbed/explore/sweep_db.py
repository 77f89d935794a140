"""The DuckDB file of ``testbed sweep``: one ``points`` table, opened so that no input can steer it.

A SPEC reaches this file only through names the project checks and values
it binds:

- column names are the fixed :data:`COLUMNS` and the SPEC's grid keys, which
  :func:`testbed.explore.sweep_spec.spec_from_dict` restricts to dotted
  paths of plain segments; every identifier is still quoted with DuckDB's
  identifier quoting (:func:`ident`), and every value is a bound parameter;
- the database is opened with external access and extension loading
  disabled (``enable_external_access``, ``autoload_known_extensions``,
  ``autoinstall_known_extensions`` all false) and by its absolute path, so a
  name like ``md:x`` or a SQLite file never makes DuckDB fetch an extension;
- a file that is not a DuckDB database, or a DuckDB database of another
  program (a ``points`` table testbed did not write), or one holding a sweep
  of the same name over another grid, is refused before anything is written
  to it: the checks run on a read-only connection.

Each sweep's fingerprint (a hash of its resolved SPEC) is kept in the table
``sweeps``; a database an older testbed wrote (``points`` alone) adopts the
fingerprint of the first sweep that resumes it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from testbed.errors import InputError

__all__ = ["COLUMNS", "SweepDB", "read_rows", "ident", "DUCKDB_CONFIG"]

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
#: Columns whose presence (with these types) marks a ``points`` table as one testbed wrote.
_OWN = ("key", "sweep", "point", "params", "status", "error", "plan_json", "step_time_s")
#: Connection settings: no file, network or extension access beyond the database file itself.
DUCKDB_CONFIG = {"enable_external_access": False, "autoload_known_extensions": False,
                 "autoinstall_known_extensions": False}
_MAGIC = b"DUCK"  # bytes 8-12 of every DuckDB database file


def ident(name: str) -> str:
    """``name`` as a DuckDB identifier: double-quoted, inner double quotes doubled (never executed as SQL)."""
    return '"' + str(name).replace('"', '""') + '"'


def _duckdb():
    try:
        import duckdb
    except ModuleNotFoundError:
        raise InputError("the sweep database needs the `duckdb` package: pip install duckdb", field="--db") from None
    return duckdb


def _check_file(path: Path, shown: str) -> bool:
    """True when ``path`` holds a DuckDB database, False when it does not exist yet; InputError otherwise."""
    if not os.path.lexists(path):
        return False
    if not path.is_file():
        raise InputError(f"`{shown}` is not a regular file; give a DuckDB database file path", field="--db")
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as exc:
        raise InputError(f"cannot read `{shown}` ({exc.strerror})", field="--db") from None
    if head[8:12] != _MAGIC:
        kind = "a SQLite database" if head.startswith(b"SQLite format 3") else \
            "an empty file" if not head else "not a DuckDB database"
        raise InputError(f"`{shown}` is {kind}; a sweep reads and writes only DuckDB files testbed created, "
                         f"give another --db path", field="--db")
    return True


class SweepDB:
    """The DuckDB file of a sweep: ``points`` (one row per point key). One writer: the process that opened it.

    ``sweep``/``fingerprint`` (both or neither, writers only) claim the
    sweep's name in the file: a database holding that name with another
    fingerprint is refused.
    """

    def __init__(self, path: str | Path, read_only: bool = False, *, sweep: str | None = None,
                 fingerprint: str | None = None):
        duckdb = _duckdb()
        shown = str(path)
        self.path = Path(os.path.abspath(path))  # absolute: never a `scheme:` URL to DuckDB
        exists = _check_file(self.path, shown)
        if read_only and not exists:
            raise InputError(f"no sweep database at `{shown}`", field="--db")
        if exists:
            with self._connect(duckdb, shown, read_only=True) as probe:
                self.con = probe
                self._check_owner(shown, sweep, fingerprint)
        self.con = self._connect(duckdb, shown, read_only)
        if not read_only:
            cols = ", ".join(f"{ident(c)} {t}" for c, t in COLUMNS.items())
            self.con.execute(f"CREATE TABLE IF NOT EXISTS points ({cols})")
            self.con.execute("CREATE TABLE IF NOT EXISTS sweeps (name VARCHAR PRIMARY KEY, fingerprint VARCHAR)")
            have = set(self.columns())
            for c in (c for c in COLUMNS if c not in have):  # an older testbed's file gains the newer columns
                self.con.execute(f"ALTER TABLE points ADD COLUMN {ident(c)} {COLUMNS[c]}")
            if sweep is not None:
                self.con.execute("INSERT INTO sweeps VALUES (?, ?) ON CONFLICT DO NOTHING", [sweep, fingerprint])

    def _connect(self, duckdb, shown: str, read_only: bool):
        try:
            return duckdb.connect(str(self.path), read_only=read_only, config=dict(DUCKDB_CONFIG))
        except duckdb.Error as exc:  # locked by a running sweep, or damaged
            raise InputError(f"cannot open the sweep database `{shown}`: {str(exc).splitlines()[0]}",
                             field="--db") from None

    def _tables(self) -> dict[str, dict[str, str]]:
        rows = self.con.execute("SELECT table_name, column_name, data_type FROM information_schema.columns").fetchall()
        tables: dict[str, dict[str, str]] = {}
        for table, column, kind in rows:
            tables.setdefault(table, {})[column] = kind
        return tables

    def _check_owner(self, shown: str, sweep: str | None, fingerprint: str | None) -> None:
        """Refuse a database of another program, or one holding ``sweep`` over another grid (read-only checks)."""
        tables = self._tables()
        points = tables.get("points")
        if points is not None:
            foreign = [c for c in _OWN if points.get(c) != COLUMNS[c].split()[0]]
            if foreign:
                raise InputError(f"`{shown}` holds a `points` table testbed did not write (no column "
                                 f"{ident(foreign[0])} of type {COLUMNS[foreign[0]].split()[0]}); it is left "
                                 f"unchanged, give another --db path", field="--db")
        if sweep is None or "sweeps" not in tables:
            return
        found = self.con.execute("SELECT fingerprint FROM sweeps WHERE name = ?", [sweep]).fetchone()
        if found is not None and found[0] != fingerprint:
            raise InputError(f"`{shown}` holds a sweep named `{sweep}` over another grid (its plan, topology, "
                             f"search or grid differ); it is left unchanged: rename the SPEC's `name` or give "
                             f"another --db path", field="--db")

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
            self.con.execute(f"ALTER TABLE points ADD COLUMN IF NOT EXISTS {ident(p)} VARCHAR")

    def keys(self) -> set[str]:
        return {r[0] for r in self.con.execute("SELECT key FROM points").fetchall()}

    def insert(self, row: dict[str, Any]) -> bool:
        """Insert one row in its own transaction; False (and nothing written) when its key is already there."""
        cols = list(row)
        names = ", ".join(ident(c) for c in cols)
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

    def rows(self, sweep: str | None = None) -> list[dict[str, Any]]:
        """Every row (of ``sweep`` when given), ordered by sweep and point."""
        if "points" not in self._tables():
            return []
        where, args = ("WHERE sweep = ?", [sweep]) if sweep is not None else ("", [])
        cur = self.con.execute(f"SELECT * FROM points {where} ORDER BY sweep, point", args)
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]


def read_rows(path: str | Path, sweep: str | None = None) -> list[dict[str, Any]]:
    """Every row of a sweep database (of one sweep when named), ordered by sweep and point."""
    with SweepDB(path, read_only=True) as db:
        return db.rows(sweep)
