"""A topology at any size: ``NAME@DEVICES`` and ``--devices N`` resize the outermost level.

Levels resize their outermost tier, a torus its outermost dim, a multi-slice
torus its slice count; a graph is refused; a size that is not a whole
multiple of the inner levels is exit 2 naming the valid sizes. ``search --out``
writes a plan that ``simulate``, ``sweep`` and ``run`` take as is, for a
bundled and a resized topology.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from testbed.cli.main import main
from testbed.errors import InputError
from testbed.plan.io import load_plan
from testbed.topology import Form
from testbed.topology.io import load_topology
from testbed.topology.resize import resize_topology, sized_name, split_sized_name


@pytest.mark.parametrize(("name", "devices", "sizes"), [
    ("dgx-h100-superpod", 256, (8, 32)),          # levels: the nodes
    ("tpu-v5e-16x16", 64, (16, 4)),               # torus: the outermost dim
    ("tpu-v5p-multislice", 128, (4, 4, 4, 2)),    # multi-slice torus: the slices
])
def test_outermost_level_takes_the_devices(name: str, devices: int, sizes: tuple[int, ...]) -> None:
    base = load_topology(name)
    sized = load_topology(f"{name}@{devices}")
    assert sized.num_devices == devices == math.prod(sizes)
    assert tuple(l.size for l in sized.levels) == sizes
    assert sized.name == f"{name}@{devices}" and sized.form is base.form
    # Everything but the outermost level's size is the file's: links, device, calibration.
    assert sized.levels[:-1] == base.levels[:-1] and sized.device == base.device
    assert sized.calibration == base.calibration
    assert sized.levels[-1].bandwidth == base.levels[-1].bandwidth
    assert load_topology(name, devices) == sized


def test_the_same_size_is_the_same_topology() -> None:
    base = load_topology("dgx-h100-x4")
    assert resize_topology(base, base.num_devices) is base


@pytest.mark.parametrize("devices", [12, 0, 1 << 21])
def test_a_size_off_the_outer_step_names_the_valid_sizes(devices: int) -> None:
    with pytest.raises(InputError) as info:
        load_topology("dgx-h100-superpod", devices)
    assert info.value.field == "--devices"
    assert "multiples of 8" in info.value.message and "8, 16, 24, 32" in info.value.message


def test_a_graph_topology_is_not_resized(tmp_path: Path) -> None:
    graph = {"name": "pair", "device": {"flops": {"fp32": "1TFLOP/s"}, "memory": "1GB", "memory_bandwidth": "1GB/s"},
             "graph": {"devices": 2, "links": [{"a": 0, "b": 1, "bandwidth": "1GB/s"}]}}
    path = tmp_path / "pair.yaml"
    path.write_text(yaml.safe_dump(graph))
    assert load_topology(str(path)).form is Form.GRAPH
    with pytest.raises(InputError, match="explicit `graph:`"):
        load_topology(f"{path}@4")


def test_sized_names() -> None:
    assert split_sized_name("dgx-h100@16") == ("dgx-h100", 16)
    assert split_sized_name("a@b") == ("a@b", None)
    assert sized_name("dgx-h100@16", 32) == "dgx-h100@32" and sized_name("x", None) == "x"


def test_commands_take_devices_and_sized_names(capsys) -> None:
    for argv in (["simulate", "--plan", "gpt-1b-cluster", "--topology", "dgx-h100-superpod", "--devices", "32"],
                 ["simulate", "--plan", "gpt-1b-cluster", "--topology", "dgx-h100-superpod@32"],
                 ["memory", "--plan", "gpt-1b-cluster", "--topology", "dgx-h100-superpod@32"],
                 ["plan", "check", "gpt-1b-cluster", "--topology", "dgx-h100-superpod", "--devices", "32"]):
        assert main([*argv, "--json"]) == 0, argv
        data = json.loads(capsys.readouterr().out)
        assert data["topology"] == "dgx-h100-superpod@32"
    assert main(["simulate", "--plan", "gpt-1b-cluster", "--topology", "dgx-h100-superpod", "--devices", "12"]) == 2
    err = capsys.readouterr().err
    assert "--devices" in err and "multiples of 8" in err and "Traceback" not in err


def test_a_plan_naming_a_bad_size_names_the_plan_file(tmp_path: Path, capsys) -> None:
    plan = yaml.safe_load(Path("plans/gpt-1b-cluster.yaml").read_text())
    plan["topology"] = "dgx-h100-superpod@12"
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(plan))
    assert main(["simulate", "--plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "topology" in err and "multiples of 8" in err


@pytest.mark.parametrize(("topology", "devices", "written"), [
    ("host-cpu-8", None, "host-cpu-8"),                  # bundled, as it is
    ("dgx-h100-x4", 8, "dgx-h100-x4@8"),                 # resized: one node of the four
])
def test_search_out_runs_as_is(topology: str, devices: int | None, written: str, tmp_path: Path, capsys) -> None:
    """The written plan names its (resized) topology; simulate, sweep and run take it unchanged."""
    out = tmp_path / "best.yaml"
    argv = ["search", "--model", "gpt-tiny", "--topology", topology, "--schedules", "1f1b",
            "--microbatches", "1,2", "--remat", "none", "--zero", "0", "--replay", "2", "--out", str(out), "--json"]
    assert main(argv + (["--devices", str(devices)] if devices else [])) == 0
    searched = json.loads(capsys.readouterr().out)
    plan = load_plan(str(out))
    assert plan.topology == written and plan.mesh.size == 8
    assert main(["simulate", "--plan", str(out), "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["topology"] == written and simulated["devices"] == 8
    assert simulated["step_time_s"] == pytest.approx(searched["ranked"][0]["step_time_s"], rel=1e-9)
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({"name": "s", "plan": str(out), "grid": {"plan.remat": ["none", "full"]}}))
    assert main(["sweep", str(spec), "--db", str(tmp_path / "s.duckdb"), "--workers", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows["points"] == 2 and rows["ok"] == 2
    assert main(["run", "--plan", str(out), "--devices", "emulated:8", "--steps", "1", "--json"]) == 0
    ran = capsys.readouterr()
    assert json.loads(ran.out)["devices"] == 8
    assert f"running {plan.name}: compile and first step: 1/1 (100%)" in ran.err  # progress on stderr
