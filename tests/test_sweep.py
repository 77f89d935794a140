"""`testbed sweep`: the SPEC's validation, the grid's expansion, resumable runs into DuckDB, plots, executors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("duckdb")

from testbed.cli.main import main  # noqa: E402
from testbed.errors import InputError  # noqa: E402
from testbed.explore.sweep import pareto_front, read_rows, run_sweep  # noqa: E402
from testbed.explore.sweep_spec import expand, spec_from_dict  # noqa: E402

TOPOLOGY = {
    "name": "two-level",
    "device": {"name": "H100", "flops": {"bf16": "989TFLOP/s", "fp32": "67TFLOP/s"}, "memory": "80GB",
               "memory_bandwidth": "3.35TB/s"},
    "levels": [{"name": "node", "size": 8, "bandwidth": "450GB/s", "latency": "1us", "kind": "nvswitch"},
               {"name": "cluster", "size": 4, "bandwidth": "400Gb/s", "latency": "3us", "kind": "infiniband"}],
}
PLAN = {"name": "tiny", "model": {"layers": 4, "d_model": 64, "heads": 4, "d_ff": 256, "seq_len": 32, "vocab": 256},
        "batch": {"global_batch": 16, "microbatches": 2}, "mesh": {"data": 2, "tensor": 2, "stage": 2},
        "schedule": "1f1b"}


def _spec(**over) -> dict:
    spec = {"name": "tiny", "plan": PLAN, "topology": TOPOLOGY, "fill": "data",
            "price_per_device_hour": {"H100": 3.0},
            "grid": {"topology.nodes": [1, 2],
                     "topology.levels.cluster.bandwidth, price_per_device_hour": [["400Gb/s", 3.0], ["800Gb/s", 3.3]],
                     "plan.mesh.stage": [1, 2, 4, 3]}}
    spec.update(over)
    return spec


def _rows(db: Path) -> set[str]:
    """The rows as comparable text, without the one column that measures wall time."""
    return {json.dumps({k: v for k, v in r.items() if k != "eval_s"}, sort_keys=True, default=str)
            for r in read_rows(db)}


def test_grid_expands_with_zipped_keys_and_stable_keys():
    spec = spec_from_dict(_spec())
    tasks = expand(spec)
    assert spec.size == len(tasks) == 16
    assert len({t.key for t in tasks}) == 16
    assert [t.key for t in expand(spec_from_dict(_spec()))] == [t.key for t in tasks]
    t = tasks[-1]  # last key varies fastest
    assert dict(t.params) == {"topology.nodes": 2, "topology.levels.cluster.bandwidth": "800Gb/s",
                              "price_per_device_hour": 3.3, "plan.mesh.stage": 3}
    assert t.topology["levels"][1]["size"] == 2 and t.topology["levels"][1]["bandwidth"] == "800Gb/s"
    assert t.price_per_device_hour == 3.3
    assert t.plan["mesh"]["data"] == 16 // (2 * 3) or t.plan["mesh"]["data"] == 2  # 16 % 6: left for the DES to refuse
    devices = spec_from_dict(_spec(grid={"topology.devices": [8, 32]}))
    assert [x.topology["levels"][1]["size"] for x in expand(devices)] == [1, 4]


def test_topology_price_prices_points_the_sweep_leaves_unpriced():
    """Without a sweep price, each point takes its topology's price_per_device_hour (also a grid field)."""
    spec = spec_from_dict(_spec(price_per_device_hour=None, topology={**TOPOLOGY, "price_per_device_hour": 2.5},
                                grid={"topology.price_per_device_hour": [2.5, 4.0]}, search={"objective": "cost"}))
    assert [t.price_per_device_hour for t in expand(spec)] == [2.5, 4.0]
    with pytest.raises(InputError) as info:
        spec_from_dict(_spec(price_per_device_hour=None, search={"objective": "cost"}))
    assert info.value.field == "search.objective"
    with pytest.raises(InputError) as info:
        spec_from_dict(_spec(topology={**TOPOLOGY, "price_per_device_hour": "cheap"}))
    assert info.value.field == "topology.price_per_device_hour"


@pytest.mark.parametrize("over, field", [
    ({"grid": {"topology.levels.clusterx.bandwidth": ["1Gb/s"]}}, "grid.topology.levels.clusterx.bandwidth[0]"),
    ({"grid": {"topology.levels.cluster.bandwidth": ["400Gb/s", "fast"]}}, "grid.topology.levels.cluster.bandwidth[1]"),
    ({"grid": {"plan.mesh.stages": [1]}}, "grid.plan.mesh.stages[0]"),
    ({"grid": {"plan.mesh.stage": []}}, "grid.plan.mesh.stage"),
    ({"grid": {"plan.mesh.stage": [1, 1]}}, "grid.plan.mesh.stage"),
    ({"grid": {"model.layers": [2]}}, "grid.model.layers"),
    ({"grid": {"topology.nodes, price_per_device_hour": [[1, 2.0], [2]]}}, "grid.topology.nodes, price_per_device_hour[1]"),
    ({"grid": {"topology.devices": [12]}}, "grid.topology.devices[0]"),
    ({"grid": {"price_per_device_hour": [-1]}}, "grid.price_per_device_hour[0]"),
    ({"grid": {"plan.mesh.tensor": [2]}, "search": True}, "grid.plan.mesh.tensor"),
    ({"search": {"objective": "speed"}}, "search.objective"),
    ({"search": {"zero": [5]}}, "search.zero"),
    ({"fill": "tensor"}, "fill"),
    ({"price_per_device_hour": "cheap"}, "price_per_device_hour"),
    ({"grids": {}}, "grids"),
])
def test_spec_errors_name_the_field(over, field):
    with pytest.raises(InputError) as exc:
        spec_from_dict(_spec(**over))
    assert exc.value.field == field, exc.value.render()


def test_sweep_rows_breakdown_cost_and_invalid_points(tmp_path):
    db = tmp_path / "s.duckdb"
    summary = run_sweep(spec_from_dict(_spec()), db, workers=1)
    assert (summary.total, summary.evaluated, summary.invalid) == (16, 16, 4)  # stage 3 does not divide 4 layers
    rows = read_rows(db)
    assert len(rows) == 16
    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        assert r["devices"] == r["data"] * r["fsdp"] * r["tensor"] * r["stage"]
        assert r["step_time_s"] > 0 and r["memory_bytes"] > 0 and r["fits"] and 0 < r["mfu"] < 1
        price = 3.0 if r["topology.levels.cluster.bandwidth"] == "400Gb/s" else 3.3
        assert r["price_per_device_hour"] == price
        assert r["dollars_per_step"] == pytest.approx(price * r["devices"] * r["step_time_s"] / 3600)
        assert r["tokens_per_dollar"] == pytest.approx(r["tokens_per_step"] / r["dollars_per_step"])
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_time_s"])
    bad = [r for r in rows if r["status"] != "ok"]
    assert all(r["plan.mesh.stage"] == "3" and "layers" in r["error"] for r in bad)
    again = run_sweep(spec_from_dict(_spec()), db, workers=1)
    assert (again.skipped, again.evaluated) == (16, 0)
    assert len(read_rows(db)) == 16


def test_interrupted_sweep_resumes_to_the_same_rows(tmp_path):
    whole = tmp_path / "whole.duckdb"
    run_sweep(spec_from_dict(_spec()), whole, workers=1)

    def stop(row):
        if row["point"] == 5:
            raise KeyboardInterrupt

    part = tmp_path / "part.duckdb"
    with pytest.raises(KeyboardInterrupt):
        run_sweep(spec_from_dict(_spec()), part, workers=1, on_row=stop)
    assert len(read_rows(part)) == 6
    summary = run_sweep(spec_from_dict(_spec()), part, workers=1)
    assert (summary.skipped, summary.evaluated) == (6, 10)
    assert _rows(part) == _rows(whole)


def test_sigkilled_sweep_resumes_to_the_same_database(tmp_path):
    # 64 points, killed after the first: a sweep of 16 could finish while a loaded parent read its third line.
    grid = dict(_spec()["grid"], **{"plan.batch.global_batch": [16, 32, 64, 128]})
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(yaml.safe_dump(_spec(grid=grid)))
    whole, part = tmp_path / "whole.duckdb", tmp_path / "part.duckdb"
    assert main(["sweep", str(spec_file), "--db", str(whole), "--workers", "1"]) == 0
    assert len(read_rows(whole)) == 64
    cmd = [sys.executable, "-m", "testbed.cli", "sweep", str(spec_file), "--db", str(part), "--workers", "1", "-v"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=tmp_path)
    seen = 0
    for line in proc.stderr:
        seen += line.startswith("point ")
        if seen == 1:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    killed = len(read_rows(part))
    assert 1 <= killed < 64
    assert main(["sweep", str(spec_file), "--db", str(part), "--workers", "1"]) == 0
    assert _rows(part) == _rows(whole)


def test_process_pool_gives_the_rows_of_one_process(tmp_path):
    one, pool = tmp_path / "one.duckdb", tmp_path / "pool.duckdb"
    spec = spec_from_dict(_spec(grid={"topology.nodes": [1, 2], "plan.mesh.stage": [1, 2]}))
    run_sweep(spec, one, workers=1)
    summary = run_sweep(spec, pool, workers=2)
    assert summary.evaluated == 4
    assert _rows(pool) == _rows(one)


def test_search_per_topology_point(tmp_path):
    spec = spec_from_dict(_spec(fill="none", search={"schedules": ["1f1b"], "remat": ["none"], "zero": [0],
                                                      "microbatches": [1, 2], "replay": 2},
                                grid={"topology.levels.cluster.bandwidth": ["100Gb/s", "800Gb/s"],
                                      "topology.nodes": [1, 2]}))
    db = tmp_path / "s.duckdb"
    run_sweep(spec, db, workers=1)
    rows = read_rows(db)
    assert [r["status"] for r in rows] == ["ok"] * 4
    assert all(r["searched"] and r["search_enumerated"] > 0 for r in rows)
    assert all(r["data"] * r["fsdp"] * r["tensor"] * r["stage"] * r["expert"] * r["context"] == r["devices"]
               for r in rows)
    plan = json.loads(rows[0]["plan_json"])
    assert plan["mesh"]["data"] == rows[0]["data"]


def test_pareto_front():
    rows = [{"x": 1, "step_time_s": 5.0}, {"x": 2, "step_time_s": 3.0}, {"x": 2, "step_time_s": 4.0},
            {"x": 3, "step_time_s": 3.5}, {"x": 4, "step_time_s": 1.0}, {"x": None, "step_time_s": 0.1}]
    assert [(r["x"], r["step_time_s"]) for r in pareto_front(rows, "x")] == [(1, 5.0), (2, 3.0), (4, 1.0)]


def test_cli_plot_from_database_and_json(tmp_path, capsys):
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(yaml.safe_dump(_spec(grid={"topology.nodes": [1, 2], "plan.mesh.stage": [1, 2]})))
    db = tmp_path / "t.duckdb"
    assert main(["sweep", str(spec_file), "--db", str(db), "--workers", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["points"] == out["ok"] == 4 and out["summary"]["evaluated"] == 4
    plots = tmp_path / "plots"
    assert main(["sweep", "--db", str(db), "--plot", str(plots)]) == 0
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["step_time_by_field.png", "step_time_vs_cost.png", "step_time_vs_devices.png",
                     "step_time_vs_memory.png", "tokens_per_dollar_vs_devices.png"]
    assert all((plots / n).read_bytes()[:4] == b"\x89PNG" for n in names)
    from matplotlib.image import imread

    height, width = imread(str(plots / "step_time_by_field.png")).shape[:2]
    assert width > 1.5 * height  # two swept fields: two panels side by side


def test_cli_errors_exit_2(tmp_path, capsys):
    assert main(["sweep"]) == 2
    assert main(["sweep", "--db", str(tmp_path / "none.duckdb"), "--plot", str(tmp_path / "p")]) == 2
    spec_file = tmp_path / "bad.yaml"
    spec_file.write_text(yaml.safe_dump(_spec(grid={"topology.levels.cluster.latency": ["soon"]})))
    assert main(["sweep", str(spec_file), "--db", str(tmp_path / "x.duckdb")]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "grid.topology.levels.cluster.latency[0]" in err


@pytest.mark.parametrize("executor, module", [("ray", "ray"), ("dask", "distributed")])
def test_cluster_executor_without_its_extra_is_exit_2(tmp_path, capsys, executor, module):
    try:
        __import__(module)
        pytest.skip(f"{module} is installed")
    except ModuleNotFoundError:
        pass
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(yaml.safe_dump(_spec(grid={"topology.nodes": [1, 2]})))
    assert main(["sweep", str(spec_file), "--db", str(tmp_path / "x.duckdb"), "--executor", executor]) == 2
    assert f"jax-testbed[{executor}]" in capsys.readouterr().err


def test_dask_executor_writes_the_same_rows_as_the_process_one(tmp_path):
    """With the `dask` extra installed, `--executor dask` (a local cluster of worker processes) fills the same
    database as the default executor; half the points done by one, the rest by the other, still the same."""
    pytest.importorskip("distributed")
    spec = spec_from_dict(_spec(grid={"topology.nodes": [1, 2], "plan.mesh.stage": [1, 2, 3]}))
    whole, mixed, dasked = tmp_path / "whole.duckdb", tmp_path / "mixed.duckdb", tmp_path / "dask.duckdb"
    run_sweep(spec, whole, workers=1)
    summary = run_sweep(spec, dasked, executor="dask", workers=1)
    assert (summary.evaluated, summary.invalid) == (6, 2)
    assert _rows(dasked) == _rows(whole)

    def stop(row):
        if row["point"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(spec, mixed, workers=1, on_row=stop)
    assert run_sweep(spec, mixed, executor="dask", workers=1).skipped == 3
    assert _rows(mixed) == _rows(whole)


def test_a_database_without_the_newer_columns_gains_them(tmp_path):
    """A database written before the expert and context columns existed resumes: they are added (NULL in its
    old rows), and new rows fill them."""
    import duckdb

    from testbed.explore.sweep import COLUMNS

    db = tmp_path / "old.duckdb"
    older = {c: t for c, t in COLUMNS.items() if c not in ("expert", "context")}
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE points (" + ", ".join(f'"{c}" {t}' for c, t in older.items()) + ")")
    con.execute("INSERT INTO points (key, sweep, point, status) VALUES ('old-key', 'tiny', 99, 'ok')")
    con.close()
    run_sweep(spec_from_dict(_spec(grid={"plan.mesh.stage": [2, 4]})), db, workers=1)
    rows = {r["key"]: r for r in read_rows(db)}
    assert rows["old-key"]["expert"] is None and rows["old-key"]["context"] is None
    new = [r for k, r in rows.items() if k != "old-key"]
    assert [r["status"] for r in new] == ["ok", "ok"] and all(r["expert"] == r["context"] == 1 for r in new)

