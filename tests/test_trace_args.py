"""Trace slices carry their arguments: op, bytes, group size, algorithm and links for communication."""

from __future__ import annotations

import json

from testbed.cli import main
from testbed.plan.io import load_plan
from testbed.sim.graph.engine import simulate
from testbed.sim.graph.tasks import TaskKind
from testbed.sim.report.trace_files import chrome_trace, trace_bytes, write_trace
from testbed.sim.graph.trace_args import span_args
from testbed.topology.io import load_topology


def _sim():
    from testbed.plan.scale import scale_data

    topology = load_topology("dgx-h100-x4")  # 2 stages x data 8 x tensor 2 = 32 devices over two levels
    return simulate(scale_data(load_plan("demo"), topology.num_devices, "test"), topology), topology


def test_every_task_slice_carries_what_it_was_priced_from():
    sim, topology = _sim()
    args = span_args(sim.program, sim.timeline, topology)
    events = [e for e in chrome_trace(sim.timeline, args=args)["traceEvents"] if e["ph"] == "X"]
    kinds = {t.name: t.kind for t in sim.program.tasks}
    seen, flops = set(), []
    for e in events:
        kind = kinds.get(e["name"])
        if kind is TaskKind.COMPUTE:
            assert {"flops", "hbm_bytes", "kernels"} <= set(e["args"])
            flops.append(e["args"]["flops"])
        elif kind is TaskKind.COLLECTIVE:
            a = e["args"]
            assert {"op", "bytes", "group_size", "groups_at_once"} <= set(a)
            if a["bytes"] > 0 and a["group_size"] > 1:
                assert a["algorithm"] and a["links"] and all("->" in link for link in a["links"])
        elif kind is TaskKind.SEND:
            assert e["args"]["op"] == "send" and e["args"]["bytes"] > 0 and e["args"]["links"]
        seen.add(kind)
    assert {TaskKind.COMPUTE, TaskKind.COLLECTIVE, TaskKind.SEND} <= seen and max(flops) > 1e6
    # the data-parallel gradient all-reduce over 8 ranks crosses the InfiniBand level
    grads = [e["args"] for e in events if e["cat"] == "comm" and e.get("args", {}).get("group_size") == 8]
    assert grads and any("infiniband" in link for a in grads for link in a["links"])


def test_written_trace_has_the_args_and_its_size_estimate_counts_them(tmp_path):
    sim, topology = _sim()
    args = span_args(sim.program, sim.timeline, topology)
    path = write_trace(sim.timeline, tmp_path / "t.json", args=args)
    data = json.loads(path.read_text())
    assert all("args" in e for e in data["traceEvents"] if e["ph"] == "X")  # tasks, waits and bubbles alike
    size = path.stat().st_size
    assert abs(trace_bytes(sim.timeline, args=args) - size) < 0.02 * size + 4096


def test_another_programs_timeline_gets_no_args():
    sim, topology = _sim()
    other = simulate(load_plan("demo"), load_topology("host-cpu-8"))
    assert set(span_args(other.program, sim.timeline, topology)) == {None}


def test_simulate_trace_cli_writes_args(tmp_path, capsys):
    assert main(["simulate", "--plan", "demo", "--trace", str(tmp_path / "t.json")]) == 0
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    comm = [e for e in events if e["ph"] == "X" and e["cat"] == "comm" and not e["name"].startswith("wait")]
    assert comm and all({"op", "bytes", "group_size"} <= set(e["args"]) for e in comm)
