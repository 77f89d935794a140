"""`testbed compare --plans / --vary`: plans side by side, each row's time and memory breakdown.

Invariants: the exposed communication split by kind sums to the timeline's
exposed communication; compute + exposed + idle is the step; the memory
parts sum to the total; ZeRO-3 holds fewer parameter bytes than ZeRO-1 once
the data axis is wider than one; every varied combination is one row.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from testbed.cli.main import main
from testbed.plan.io import load_plan
from testbed.sim.graph.engine import simulate
from testbed.sim.report.exposed import exposed_by_kind
from testbed.topology.io import load_topology


@pytest.mark.parametrize(("plan", "topology"), [("gpt-1b-cluster", None), ("mixtral-8x7b", None),
                                                ("demo", "host-cpu-8")])
def test_exposed_kinds_sum_to_the_exposed_communication(plan: str, topology: str | None) -> None:
    p = load_plan(plan)
    timeline = simulate(p, load_topology(topology or p.topology)).timeline
    kinds = exposed_by_kind(timeline)
    assert kinds and all(v > 0 for v in kinds.values())
    assert sum(kinds.values()) == pytest.approx(timeline.exposed_comm_s(), rel=1e-9, abs=1e-12)


def test_mixtral_waits_on_its_all_to_alls() -> None:
    p = load_plan("mixtral-8x7b")
    assert "all-to-all" in exposed_by_kind(simulate(p, load_topology(p.topology)).timeline)


def test_plans_and_vary_one_row_each(tmp_path: Path, capsys) -> None:
    other = yaml.safe_load(Path("plans/gpt-1b-cluster.yaml").read_text())
    other["name"] = "gpt-1b-1f1b"
    other["schedule"] = "1f1b"
    second = tmp_path / "b.yaml"
    second.write_text(yaml.safe_dump(other))
    png = tmp_path / "c.png"
    argv = ["compare", "--plans", "gpt-1b-cluster", str(second), "--vary", "zero=1,3", "--topology",
            "dgx-h100-superpod@64", "--scale", "data", "--png", str(png), "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["rows"]
    assert [r["label"] for r in rows] == ["gpt-1b-cluster zero=1", "gpt-1b-cluster zero=3", "gpt-1b-1f1b zero=1",
                                          "gpt-1b-1f1b zero=3"]
    for r in rows:
        assert r["devices"] == 64 and r["data"] == 2
        assert sum(r["exposed_by_kind"].values()) == pytest.approx(r["exposed_comm_s"], rel=1e-9, abs=1e-12)
        assert r["compute_s"] + r["exposed_comm_s"] + r["idle_s"] == pytest.approx(r["step_time_s"], rel=1e-9)
        m = r["memory"]
        assert sum(m[k] for k in ("params", "grads", "optimizer", "activations", "workspace")) == m["total"]
    assert rows[1]["memory"]["params"] < rows[0]["memory"]["params"]  # ZeRO-3 shards the parameters over data
    from matplotlib.image import imread

    height, width = imread(str(png)).shape[:2]
    assert 600 <= width <= 1600 and height <= 900  # readable at its written size: no 4,000-pixel strip


def test_the_table_names_each_column(capsys) -> None:
    assert main(["compare", "--plan", "gpt-1b-cluster", "--vary", "remat=none,full"]) == 0
    out = capsys.readouterr().out
    assert "remat=none" in out and "remat=full" in out
    for word in ("tensor:", "bubble:", "MFU:", "params:", "work:"):
        assert word in out


@pytest.mark.parametrize(("argv", "needle"), [
    (["--plan", "demo", "--vary", "zerro=1,3"], "--vary"),
    (["--plan", "demo", "--vary", "zero=9"], "--vary"),
    (["--plan", "demo", "--vary", "zero"], "FIELD=V1,V2"),
    (["--plan", "demo"], "nothing to compare"),
    ([], "--plans"),
])
def test_bad_input_is_exit_2(argv: list[str], needle: str, capsys) -> None:
    assert main(["compare", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
