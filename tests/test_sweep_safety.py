"""Sweep SPECs cannot steer SQL or the file system (issue 40): grid keys, SPEC names, foreign databases."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest
import yaml

duckdb = pytest.importorskip("duckdb")

from testbed.cli.main import main  # noqa: E402
from testbed.errors import InputError  # noqa: E402
from testbed.explore.sweep import read_rows, run_sweep  # noqa: E402
from testbed.explore.sweep_spec import spec_from_dict  # noqa: E402

PLAN = {"name": "tiny", "model": {"layers": 2, "d_model": 32, "heads": 4, "d_ff": 64, "seq_len": 16, "vocab": 128},
        "batch": {"global_batch": 8, "microbatches": 1}, "mesh": {"data": 8}, "schedule": "gpipe"}
SQL = "x\" VARCHAR); COPY (SELECT 1) TO 'pwned.csv'; --"


def _spec(**over) -> dict:
    return {"name": "tiny", "plan": PLAN, "topology": "host-cpu-8",
            "grid": {"plan.batch.global_batch": [8, 16]}, **over}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sweep(tmp_path: Path, spec: dict, *args: str) -> int:
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    return main(["sweep", str(tmp_path / "spec.yaml"), "--workers", "1", *args])


@pytest.mark.parametrize("key", [f"topology.levels.{SQL}.bandwidth", 'plan.batch."global_batch"',
                                 "plan.batch.global_batch; DROP TABLE points", "plan..batch", "plan.a b",
                                 "topology.levels.node\x1b[31m.size", "plan." + "x" * 300])
def test_grid_keys_with_quotes_or_sql_are_refused(key, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError) as bad:
        spec_from_dict(_spec(grid={key: [1, 2]}))
    assert bad.value.field.startswith("grid.") and "dotted path of segments" in bad.value.message
    assert not list(tmp_path.iterdir())


def test_sql_in_names_and_values_is_stored_verbatim(tmp_path, monkeypatch):
    """A level named with SQL, reached by index, and SQL as a grid value: rows hold the text, nothing runs."""
    monkeypatch.chdir(tmp_path)
    topo = {"name": SQL, "device": {"name": SQL, "flops": {"bf16": "1TFLOP/s", "fp32": "1TFLOP/s"},
                                    "memory": "16GB", "memory_bandwidth": "100GB/s"},
            "levels": [{"name": SQL, "size": 8, "bandwidth": "10GB/s", "latency": "1us", "kind": "host"}]}
    spec = spec_from_dict(_spec(topology=topo, grid={"topology.levels.0.name": [SQL, SQL + "2"],
                                                     "topology.levels.0.bandwidth": ["10GB/s", "20GB/s"]}))
    db = tmp_path / "s.duckdb"
    run_sweep(spec, db, workers=1)
    rows = read_rows(db)
    assert len(rows) == 4 and {r["topology.levels.0.name"] for r in rows} == {SQL, SQL + "2"}
    assert {r["device_type"] for r in rows} == {SQL} and all(r["status"] == "ok" for r in rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.duckdb"]


@pytest.mark.parametrize("name", ["../x", "../../x", "/tmp/x", "a/b", "md:foo", "s3:bucket", "..", ".hidden",
                                  "a\\b", "x" * 300, "bell\x07", "esc\x1b[31m", "[/bold]", ""])
def test_spec_names_that_are_paths_or_urls_are_refused(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _sweep(tmp_path, _spec(name=name)) == 2
    err = capsys.readouterr().err
    assert "field `name`" in err and "plain name" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


def test_outputs_default_to_the_current_folder(tmp_path, monkeypatch, capsys):
    elsewhere = tmp_path / "specs"
    elsewhere.mkdir()
    (elsewhere / "my-grid.yaml").write_text(yaml.safe_dump({k: v for k, v in _spec().items() if k != "name"}))
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", "specs/my-grid.yaml", "--workers", "1", "--json"]) == 0
    assert (tmp_path / "my-grid.duckdb").is_file() and sorted(p.name for p in elsewhere.iterdir()) == ["my-grid.yaml"]


def test_a_database_of_another_program_is_refused_unchanged(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "theirs.duckdb"
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE points (x DOUBLE, y DOUBLE)")
    con.execute("INSERT INTO points VALUES (1, 2)")
    con.close()
    before = _digest(db)
    assert _sweep(tmp_path, _spec(), "--db", str(db)) == 2
    err = capsys.readouterr().err
    assert "testbed did not write" in err and "unchanged" in err
    assert _digest(db) == before
    assert main(["sweep", "--db", str(db), "--plot", str(tmp_path / "plots")]) == 2


@pytest.mark.parametrize("kind", ["sqlite", "text", "empty"])
def test_a_file_that_is_not_duckdb_is_refused_unchanged(kind, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "file.db"
    if kind == "sqlite":
        con = sqlite3.connect(db)
        con.execute("CREATE TABLE points (x)")
        con.commit()
        con.close()
    else:
        db.write_text("" if kind == "empty" else "hello\n" * 10)
    before = _digest(db)
    assert _sweep(tmp_path, _spec(), "--db", str(db)) == 2
    err = capsys.readouterr().err
    assert "field `--db`" in err and ("SQLite" in err if kind == "sqlite" else "file.db" in err)
    assert _digest(db) == before and sorted(p.name for p in tmp_path.iterdir()) == ["file.db", "spec.yaml"]


def test_a_url_like_db_path_is_a_local_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _sweep(tmp_path, _spec(), "--db", "md:foo", "--json") == 0
    assert (tmp_path / "md:foo").is_file() and len(read_rows(tmp_path / "md:foo")) == 2


def test_a_sweep_of_the_same_name_over_another_grid_is_refused_unchanged(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _sweep(tmp_path, _spec()) == 0
    db = tmp_path / "tiny.duckdb"
    before = _digest(db)
    assert _sweep(tmp_path, _spec(grid={"plan.batch.global_batch": [8, 16, 32]})) == 2
    assert "over another grid" in capsys.readouterr().err and _digest(db) == before
    assert _sweep(tmp_path, _spec()) == 0  # the same grid resumes (nothing to do)
    other = _spec(name="other", grid={"plan.batch.global_batch": [32]})
    assert _sweep(tmp_path, other, "--db", str(db)) == 0  # another name in the same file: fine
    assert {r["sweep"] for r in read_rows(db)} == {"tiny", "other"} and len(read_rows(db, "tiny")) == 2


def test_a_sweep_with_an_overflowing_point_records_it_and_finishes_the_rest(tmp_path):
    """A point at the plan limits (d_model 2^17, seq 2^22, batch 2^30) needs ~1.6e23 bytes: more than the 64-bit
    column holds (DuckDB refused the insert and the sweep stopped); it is a failed row, the others are ok."""
    spec = spec_from_dict(_spec(grid={"plan.model.d_model, plan.model.seq_len, plan.batch.global_batch": [
        [32, 16, 8], [1 << 17, 1 << 22, 1 << 30], [64, 16, 16]]}))
    db = tmp_path / "s.duckdb"
    summary = run_sweep(spec, db, workers=1)
    rows = read_rows(db)
    assert summary.total == summary.evaluated == 3 and summary.invalid == 1
    assert [r["status"] for r in rows] == ["ok", "failed", "ok"]
    failed = rows[1]
    assert "the model failed" in failed["error"] and "memory_bytes" in failed["error"]
    assert failed["step_time_s"] is None and failed["memory_bytes"] is None


def test_a_grid_over_the_point_limit_is_refused_before_it_is_built(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    big = _spec(grid={"plan.model.layers": list(range(1, 1001)), "plan.model.d_model": list(range(8, 8008, 8))})
    assert _sweep(tmp_path, big) == 2
    err = capsys.readouterr().err
    assert "1,000,000 points" in err and "--max-points" in err
    small = _spec(grid={"plan.model.layers": [1, 2, 3]})
    assert _sweep(tmp_path, small, "--max-points", "2") == 2
    assert _sweep(tmp_path, small, "--max-points", "0") == 2
    assert _sweep(tmp_path, small, "--max-points", "3", "--json") == 0
