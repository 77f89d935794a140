"""`testbed demo --no-run`: the predict-and-compare half of the demo (the run half is tested by the runner tests)."""

from __future__ import annotations

import json

from testbed.cli import main


def test_demo_without_run_writes_every_picture(tmp_path, capsys):
    code = main(["demo", "--no-run", "--out", str(tmp_path), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["measured"] is None and data["verify"] is None
    assert {r["topology"] for r in data["compare"]} >= {"host-cpu-8", "dgx-h100", "eth-100g-8", "tpu-v5e-4x4"}
    # Scaling keeps the per-replica batch: global batch / data is the same on every topology.
    assert len({r["global_batch"] // r["data"] for r in data["compare"]}) == 1
    for name in ("demo-trace.json", "demo-gantt.png", "demo-compare.png", "demo-topology.png", "demo.json"):
        assert (tmp_path / name).stat().st_size > 0
    trace = json.loads((tmp_path / "demo-trace.json").read_text())
    pids = {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert len(pids) == 8
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary files left behind"
