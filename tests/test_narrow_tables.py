"""Every command's table at 80 columns (rich's width when piped): the identifying column is whole.

A cut name (``dgx-h100-su…``) cannot be typed back or compared; the tables drop secondary columns first
(``testbed/cli/tables.py``) and say which. Each test renders a command at COLUMNS=80 and checks that
every identifying value appears whole on one line and that no line is wider than 80.
"""

from __future__ import annotations

import io
import json

import pytest
import yaml
from rich.console import Console

from testbed.cli import main
from testbed.cli.tables import Col, fitted_table

LONG_TOPOLOGY = "a-rather-long-topology-name-for-a-lab"  # 37 characters
PLAN = {"name": "wide", "model": {"layers": 2, "d_model": 64, "heads": 4, "d_ff": 256, "seq_len": 32, "vocab": 256},
        "batch": {"global_batch": 16, "microbatches": 2}, "mesh": {"data": 2, "tensor": 2, "stage": 2}}
TOPO = {"name": LONG_TOPOLOGY,
        "device": {"name": "H100-SXM5-80GB", "flops": {"bf16": "989TFLOP/s", "fp32": "67TFLOP/s"}, "memory": "80GB",
                   "memory_bandwidth": "3.35TB/s"},
        "levels": [{"name": "nvlink-domain-of-eight", "size": 8, "bandwidth": "450GB/s", "latency": "1us",
                    "kind": "nvswitch"}]}


@pytest.fixture(autouse=True)
def _eighty_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")


def _run(argv, capsys) -> list[str]:
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    return lines


def _whole(lines: list[str], values) -> None:
    for value in values:
        assert any(value in line for line in lines), f"{value!r} is not whole on any line"


@pytest.fixture
def files(tmp_path):
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(PLAN))
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(TOPO))
    return str(tmp_path / "p.yaml"), str(tmp_path / "t.yaml")


def test_fitted_table_drops_secondary_columns_and_keeps_keys_whole():
    console = Console(file=io.StringIO(), width=40, color_system=None)
    columns = [Col(header="name", key=True, justify="left"), Col(header="a", drop=1), Col(header="b", drop=2),
               Col(header="c")]
    rows = [["a-name-of-exactly-thirty-chars", "1111111", "2222222", "3"]]
    table = fitted_table(console, columns, rows)
    console.print(table)
    out = console.file.getvalue()
    assert "a-name-of-exactly-thirty-chars" in out and "2222222" not in out and "hidden at this width: b" in out
    assert all(len(line) <= 40 for line in out.splitlines())
    wide = Console(file=io.StringIO(), width=200, color_system=None)
    wide.print(fitted_table(wide, columns, rows))
    assert "1111111" in wide.file.getvalue() and "2222222" in wide.file.getvalue()
    with pytest.raises(ValueError):
        Col(header="x", key=True, drop=1)


def test_topologies(capsys):
    lines = _run(["topologies"], capsys)
    assert main(["topologies", "--json"]) == 0
    _whole(lines, [r["name"] for r in json.loads(capsys.readouterr().out)["topologies"]])


def test_topology_show_and_plan_check(files, capsys):
    plan, topo = files
    _whole(_run(["topology", "show", topo], capsys), [LONG_TOPOLOGY, "nvlink-domain-of-eight"])
    _whole(_run(["plan", "check", plan, "--topology", topo], capsys), ["stage", "data", "tensor", "context"])


def test_memory_and_simulate(files, capsys):
    plan, topo = files
    _run(["memory", "--plan", plan, "--topology", topo], capsys)
    _whole(_run(["simulate", "--plan", plan, "--topology", topo], capsys), [LONG_TOPOLOGY])


def test_compare(files, capsys):
    plan, topo = files
    _whole(_run(["compare", "--plan", plan, "--topology", topo, "dgx-h100", "--scale", "data"], capsys),
           [LONG_TOPOLOGY, "dgx-h100"])


def test_collective(capsys):
    lines = _run(["collective", "all_reduce", "--topology", "dgx-h100-superpod", "--bytes", "64MiB"], capsys)
    assert main(["collective", "all_reduce", "--topology", "dgx-h100-superpod", "--bytes", "64MiB", "--json"]) == 0
    _whole(lines, [r["algorithm"] for r in json.loads(capsys.readouterr().out)["algorithms"]])


def test_schedule(capsys):
    _whole(_run(["schedule", "interleaved", "--stages", "4", "--microbatches", "8", "--virtual", "2"],
                capsys), ["stage"])


def test_search():
    """One small search, rendered at 80 columns and compared with its own rows."""
    from testbed.cli.main import build_parser

    args = build_parser(only="search").parse_args(["search", "--model", "demo", "--topology", "host-cpu-8", "--devices",
                                                   "4", "--top", "4", "--replay", "2", "--schedules", "1f1b",
                                                   "--zero", "0"])
    result = args._command.execute(args)
    console = Console(file=io.StringIO(), width=80, color_system=None)
    result.render(console)
    lines = console.file.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines)
    rows = result.data["ranked"]
    _whole(lines, [f"{r['data']}.{r['fsdp']}.{r['tensor']}.{r['stage']}" for r in rows] + [r["remat"] for r in rows])


def test_validate_table():
    from testbed.cli.validate import render_validation

    console = Console(file=io.StringIO(), width=80, color_system=None)
    plans = [{"plan": f"plans/validation/{name}.yaml", "predicted_s": 0.0123, "measured_s": 0.0131, "error": -0.061,
              "predicted_memory": 2.5e6, "measured_memory": 2.7e6, "memory_error": -0.074}
             for name in ("pipeline-interleaved-4x2", "fsdp-and-tensor-parallel-2x4")]
    render_validation(console, {"topology": LONG_TOPOLOGY, "devices": {"devices": 8, "platform": "cpu"}, "steps": 5,
                                "rounds": 1, "plans": plans, "median_abs_error": 0.06, "max_abs_error": 0.06})
    lines = console.file.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines)
    _whole(lines, [p["plan"] for p in plans])


def test_sweep(tmp_path, capsys):
    pytest.importorskip("duckdb")
    spec = {"name": "narrow", "plan": PLAN, "topology": {**TOPO, "levels": TOPO["levels"] + [
        {"name": "cluster", "size": 2, "bandwidth": "400Gb/s", "latency": "3us", "kind": "infiniband"}]},
        "fill": "data", "price_per_device_hour": {"H100-SXM5-80GB": 3.0},
        "grid": {"topology.levels.cluster.bandwidth, price_per_device_hour": [["400Gb/s", 3.0], ["800Gb/s", 3.3]],
                 "plan.mesh.stage": [1, 2]}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    db = str(tmp_path / "s.duckdb")
    lines = _run(["sweep", str(tmp_path / "s.yaml"), "--db", db, "--workers", "1"], capsys)
    text = "\n".join(lines)
    for words in ("bandwidth=400Gb/s", "bandwidth=800Gb/s", "price_per_device_hour=3.3", "stage=1", "stage=2"):
        assert words in text  # each k=v whole (the params column wraps between them, never inside)
    rows = "\n".join(line for line in lines if "evaluated" not in line)  # the header may elide a long db path
    assert "…" not in rows  # MFU and tokens per dollar are shown, not cut


def test_calibrate_from_measurements(tmp_path, capsys):
    """The fitted calibration's group and field (the YAML keys to edit) whole; values fold."""
    from pathlib import Path

    from testbed.cli.calibration_table import calibration_rows

    run = Path(__file__).resolve().parent.parent / "benchmarks" / "host_runs" / "2026-12-02" / "run-10"
    argv = ["calibrate", "--from-measurements", str(run / "measurements.json"), "--out", str(tmp_path / "c.yaml")]
    assert main([*argv, "--json"]) == 0
    rows = calibration_rows(json.loads(capsys.readouterr().out)["fitted"])
    lines = _run(argv, capsys)
    _whole(lines, sorted({group for group, _, _ in rows} | {field for _, field, _ in rows}))
