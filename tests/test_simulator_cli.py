"""`testbed simulate` and `testbed compare`: JSON contract, files, --scale data, bad input (exit 2)."""

from __future__ import annotations

import json
import textwrap

import pytest

from testbed.cli import main
from testbed.plan.scale import scale_data
from testbed.errors import InputError
from testbed.plan.io import load_plan

TOPO6 = textwrap.dedent("""\
    device: {name: x, flops: {fp32: 1TFLOP/s}, memory: 16GB, memory_bandwidth: 1TB/s}
    levels:
      - {name: node, size: 6, bandwidth: 100GB/s, latency: 1us, kind: nvswitch}
    """)
MEMORY_KEYS = {"params_count", "params", "grads", "optimizer", "activations", "workspace", "total", "capacity", "fits"}


def run_cli(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_simulate_json_contract_and_files(tmp_path, capsys):
    trace, gantt = tmp_path / "t.json", tmp_path / "g.png"
    code, out, _ = run_cli(["simulate", "--plan", "demo", "--trace", str(trace), "--gantt", str(gantt), "--json"],
                           capsys)
    assert code == 0
    data = json.loads(out)
    assert {"step_time_s", "compute_s", "exposed_comm_s", "bubble_fraction", "mfu", "memory"} <= set(data)
    assert MEMORY_KEYS <= set(data["memory"])
    assert data["topology"] == "host-cpu-8" and data["devices"] == 8
    assert 0 < data["compute_s"] <= data["step_time_s"] and 0 < data["mfu"] < 1
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == set(range(8))
    assert gantt.read_bytes()[:4] == b"\x89PNG"


def test_simulate_renders_without_json(capsys):
    code, out, _ = run_cli(["simulate", "--plan", "demo"], capsys)
    assert code == 0 and "step time" in out and "MFU" in out


def test_compare_rows_and_png(tmp_path, capsys):
    png = tmp_path / "c.png"
    code, out, _ = run_cli(["compare", "--plan", "demo", "--topology", "host-cpu-8", "eth-100g-8", "--png", str(png),
                            "--json"], capsys)
    assert code == 0
    rows = json.loads(out)["rows"]
    assert [r["topology"] for r in rows] == ["host-cpu-8", "eth-100g-8"]
    for r in rows:
        assert {"step_time_s", "compute_s", "exposed_comm_s", "bubble_fraction", "mfu", "fits"} <= set(r)
        assert r["compute_s"] + r["exposed_comm_s"] <= r["step_time_s"] * (1 + 1e-9)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_compare_scale_data_keeps_the_per_replica_batch(capsys):
    code, out, _ = run_cli(["compare", "--plan", "demo", "--topology", "host-cpu-8", "dgx-h100-x4", "--scale", "data",
                            "--json"], capsys)
    assert code == 0
    rows = {r["topology"]: r for r in json.loads(out)["rows"]}
    assert rows["host-cpu-8"]["data"] == 2 and rows["dgx-h100-x4"]["data"] == 8
    assert rows["dgx-h100-x4"]["global_batch"] == 4 * rows["host-cpu-8"]["global_batch"]


def test_scale_data_reference():
    plan = load_plan("demo")  # data 2 x tensor 2 x stage 2, global batch 16
    scaled = scale_data(plan, 32)
    assert scaled.mesh.data == 8 and scaled.batch.global_batch == 64
    assert scaled.microbatch_size == plan.microbatch_size and scaled.mesh.tensor == plan.mesh.tensor
    with pytest.raises(InputError) as err:
        scale_data(plan, 6)
    assert err.value.field == "mesh.data"


@pytest.mark.parametrize("argv,needle", [
    (["simulate", "--plan", "demo", "--topology", "dgx-h100-x4"], "mesh"),
    (["simulate", "--plan", "demo", "--topology", "no-such-topology"], "no-such-topology"),
    (["simulate", "--plan", "no-such-plan.yaml"], "no-such-plan"),
    (["compare", "--plan", "demo", "--topology", "host-cpu-8", "TOPO6", "--scale", "data"], "mesh.data"),
    (["compare", "--plan", "demo", "--topology", "host-cpu-8", "TOPO6"], "mesh"),
])
def test_bad_input_exits_2_with_one_paragraph(argv, needle, tmp_path, capsys):
    topo6 = tmp_path / "six.yaml"
    topo6.write_text(TOPO6)
    argv = [str(topo6) if a == "TOPO6" else a for a in argv]
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == ""
    assert needle in err and "Traceback" not in err and err.count("\n") == 1
