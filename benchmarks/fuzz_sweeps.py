"""Bad-input cases for sweep SPECs, their DuckDB files, and names a user controls (issue 40).

Part of the bad-input fuzzer (benchmarks/fuzz_inputs.py runs the cases). A
case here is one of:

- a small SPEC whose ``name`` is a path, a URL, a control or markup string or
  very long, whose grid keys carry quotes and SQL fragments, whose grid
  values are SQL text, or whose price and ``--max-points`` are extreme;
- a good SPEC swept into a database path that is a folder, a link (to the
  SPEC itself, to a folder, dangling), a FIFO, a read-only file or folder,
  another program's DuckDB file, a SQLite file, a database where a sweep of
  the same name ran over another grid, or one another connection holds
  open (two sweeps into one file at once);
- a plan whose name carries control characters or rich markup, through the
  commands that print it.

:func:`apply_setup` makes what a case's ``setup`` names in its folder
(returning what to close afterwards); the runner calls it before the case.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from benchmarks.fuzz_docs import PLANS, SMALL_PLANS, SMALL_TOPOLOGIES, SWEEPS, TMP, Case, _dump

__all__ = ["NASTY_NAMES", "GRID_KEYS", "SETUPS", "spec_name_case", "sweep_db_case", "named_plan_case", "apply_setup",
           "undo_setup"]

#: Names a user might give (or an attacker craft): paths, URLs, control characters, markup, very long ones.
NASTY_NAMES = ("../x", "../../x", "/tmp/x", "a/b", "md:foo", "s3://b/k", "..", ".hidden", "a\\b", "C:x",
               "\x1b[31mred\x1b[0m", "\x1b]0;title\x07", "bell\x07", "nul\x00x", "tab\tx", "cr\rx", "\u202eevil",
               "[/bold]", "[bold]x[/bold]", "[link=file:///etc/passwd]x[/link]", "x" * 255, "x" * 256,
               "x" * 30_000, "ok-name", "plain.name+1", "")
_SQL = ("x\" VARCHAR); COPY (SELECT 1) TO 'pwn.csv'; --", "'; DROP TABLE points; --", "a\"b", "a'b", "a;b",
        "a--b", "a/*b*/", "a\x1bb", "a b")
#: Grid keys: SQL and quotes in every position, and ones a SPEC may legitimately use.
GRID_KEYS = (*(f"topology.levels.{s}.bandwidth" for s in _SQL), *(f"plan.{s}" for s in _SQL),
             'plan.batch."global_batch"', "plan..batch", "plan.batch.global_batch, " + _SQL[0],
             "topology.levels.0.bandwidth", "plan.batch.global_batch", "plan." + "x" * 300)
#: What a case's database path can be made into before the sweep.
SETUPS = ("folder", "link-to-spec", "link-to-folder", "link-dangling", "fifo", "readonly-file", "readonly-folder",
          "foreign-duckdb", "sqlite", "other-grid", "locked", "text")


def _small_spec(name: Any = "tiny") -> dict:
    spec = dict(SWEEPS["tiny"])
    spec["name"] = name
    spec["grid"] = {"plan.mesh.stage": [1, 2]}
    return spec


@st.composite
def spec_name_case(draw: Any) -> Case:
    """A small SPEC with a nasty name, grid key, grid value, price or point limit."""
    what = draw(st.sampled_from(["name", "name", "key", "key", "value", "price", "max-points"]))
    spec = _small_spec()
    argv_extra: list[str] = []
    if what == "name":
        spec["name"] = draw(st.sampled_from(NASTY_NAMES))
    elif what == "key":
        spec["grid"] = {draw(st.sampled_from(GRID_KEYS)): draw(st.sampled_from([["400Gb/s", "800Gb/s"], [16, 32],
                                                                                [[1, 2]], ["x"]]))}
    elif what == "value":
        spec["grid"] = {draw(st.sampled_from(["plan.name", "topology.name", "topology.levels.0.name",
                                              "topology.device.name"])): [draw(st.sampled_from(_SQL)), "ok"]}
    elif what == "price":
        spec["price_per_device_hour"] = draw(st.sampled_from([1e-300, float("inf"), 1e308, -0.0, 1e-7, 1e7, 3.0,
                                                              {"H100": 1e-300}, {"H100": float("nan")}]))
    else:
        argv_extra = ["--max-points", draw(st.sampled_from(["0", "-1", "1", "3", "abc", "1e9", "99999999999999"]))]
    files = {"spec.yaml": _dump(spec).encode()}
    db = [] if what == "name" and draw(st.booleans()) else ["--db", f"{TMP}/x.duckdb"]
    return Case("sweep", ["sweep", f"{TMP}/spec.yaml", *db, "--workers", "1", *argv_extra], files)


@st.composite
def sweep_db_case(draw: Any) -> Case:
    """A good SPEC (or plot-only mode) against a database path made into something bad first."""
    setup = draw(st.sampled_from(SETUPS))
    files = {"spec.yaml": _dump(_small_spec()).encode()}
    if draw(st.integers(0, 5)) == 0:  # plot-only: reads the database
        argv = ["sweep", "--db", f"{TMP}/x.duckdb", "--plot", f"{TMP}/plots"]
    else:
        argv = ["sweep", f"{TMP}/spec.yaml", "--db", f"{TMP}/x.duckdb", "--workers", "1"]
    return Case("sweep", argv, files, setup=setup)


@st.composite
def named_plan_case(draw: Any) -> Case:
    """A small plan whose name (or its topology's) is a control or markup string, through a printing command."""
    plan = dict(PLANS[draw(st.sampled_from(SMALL_PLANS))])
    plan["name"] = draw(st.sampled_from(NASTY_NAMES))
    files = {"plan.yaml": _dump(plan).encode()}
    command = draw(st.sampled_from(["plan", "memory", "simulate"]))
    argv = {"plan": ["plan", "check", f"{TMP}/plan.yaml"], "memory": ["memory", "--plan", f"{TMP}/plan.yaml"],
            "simulate": ["simulate", "--plan", f"{TMP}/plan.yaml"]}[command]
    argv += ["--topology", draw(st.sampled_from(SMALL_TOPOLOGIES))]
    return Case(command, argv, files)


def apply_setup(setup: str, folder: Path) -> list:
    """Make ``setup`` at ``folder/x.duckdb``; returns the objects to close (and modes to restore) afterwards."""
    db = folder / "x.duckdb"
    keep: list = []
    if not setup:
        return keep
    if setup == "folder":
        db.mkdir()
    elif setup == "link-to-spec":
        db.symlink_to(folder / "spec.yaml")
    elif setup == "link-to-folder":
        (folder / "sub").mkdir()
        db.symlink_to(folder / "sub")
    elif setup == "link-dangling":
        db.symlink_to(folder / "no" / "where.duckdb")
    elif setup == "fifo":
        os.mkfifo(db)
    elif setup == "text":
        db.write_text("not a database\n")
    elif setup == "sqlite":
        con = sqlite3.connect(db)
        con.execute("CREATE TABLE points (key TEXT, x REAL)")
        con.commit()
        con.close()
    else:
        import duckdb

        if setup == "foreign-duckdb":
            con = duckdb.connect(str(db))
            con.execute("CREATE TABLE points (x DOUBLE, y VARCHAR)")
            con.execute("INSERT INTO points VALUES (1, 'theirs')")
            con.close()
        elif setup == "other-grid":
            from testbed.explore.sweep_db import SweepDB

            SweepDB(db, sweep="tiny", fingerprint="0" * 24).close()
        elif setup == "locked":  # another process holds the database open (two sweeps into one file at once)
            keep.append(_holder(db))
        elif setup in ("readonly-file", "readonly-folder"):
            duckdb.connect(str(db)).close()
            target = db if setup == "readonly-file" else folder
            keep.append((target, target.stat().st_mode))
            target.chmod(0o444 if setup == "readonly-file" else 0o555)
    return keep


def _holder(db: Path) -> subprocess.Popen:
    """A process that creates the DuckDB file ``db`` and keeps it open (locked) until killed."""
    code = ("import duckdb, sys, time\ncon = duckdb.connect(sys.argv[1])\ncon.execute('CREATE TABLE t (x INT)')\n"
            "print('open', flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(db)], stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()
    return proc


def undo_setup(keep: list) -> None:
    """Stop what :func:`apply_setup` kept open and restore the modes it changed."""
    for item in keep:
        if isinstance(item, tuple):
            item[0].chmod(item[1])
        else:
            item.kill()
            item.wait()
            item.stdout.close()
