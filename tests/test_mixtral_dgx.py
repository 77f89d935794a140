"""`testbed simulate` of Mixtral 8x7B on four DGX H100 nodes with expert parallelism 4 (issue 23).

With the expert axis outermost (mesh.order), each expert group spans the four nodes and every
dispatch and combine all-to-all crosses the InfiniBand NICs; with it innermost, the group sits in
one node on NVLink. The exposed all-to-all time shows in the breakdown (text and --json) and as
its own events on the ``expert`` stream of the Perfetto trace, and moving the axis inside a node
shrinks it by the ratio of the all-to-all's time on the two kinds of links, which the test
derives from the topology file (its levels' bandwidths and the collective timing over them).
"""

from __future__ import annotations

import json

import pytest
import yaml

from testbed.cli import main
from testbed.collectives.timing import collective_time
from testbed.model import moe
from testbed.plan.io import load_plan
from testbed.plan.placement import place
from testbed.sim.graph.program import axis_groups
from testbed.topology.io import load_topology

TOPOLOGY = "dgx-h100-x4"
ACROSS = ["stage", "expert", "data", "fsdp", "context", "tensor"]   # expert outermost: one rank per node
INSIDE = ["stage", "data", "fsdp", "context", "expert", "tensor"]   # expert innermost: a group in one node


def _simulate(tmp_path, order, capsys, name):
    plan = {"name": name, "topology": TOPOLOGY, "precision": "bf16-mixed", "remat": "full",
            "model": {"preset": "mixtral-8x7b", "seq_len": 4096},
            "batch": {"global_batch": 32, "microbatches": 1}, "mesh": {"data": 8, "expert": 4, "order": order}}
    path, trace = tmp_path / f"{name}.yaml", tmp_path / f"{name}.trace.json"
    path.write_text(yaml.safe_dump(plan))
    assert main(["simulate", "--plan", str(path), "--json", "--trace", str(trace)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert main(["simulate", "--plan", str(path)]) == 0
    text = capsys.readouterr().out
    return load_plan(str(path)), data, json.loads(trace.read_text())["traceEvents"], text


@pytest.fixture(scope="module")
def topo():
    return load_topology(TOPOLOGY)


def test_exposed_all_to_all_follows_the_links(tmp_path, capsys, topo):
    runs = {}
    for name, order in (("across", ACROSS), ("inside", INSIDE)):
        plan, data, events, text = _simulate(tmp_path, order, capsys, name)
        exposed = data["exposed_all_to_all_s"]
        assert 0 < exposed <= data["exposed_comm_s"] + 1e-12 and "all-to-all" in text
        # Its own events in the trace: dispatch and combine on the `expert` thread of every device.
        threads = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M" and e["name"] == "thread_name"
               and e["args"]["name"] == "expert"}
        a2a = [e for e in events if e.get("ph") == "X" and (e["pid"], e["tid"]) in threads]
        assert {e["pid"] for e in a2a} == set(range(32))
        assert {e["name"].rsplit(" ", 1)[-1] for e in a2a} == {"dispatch", "combine"}
        # One all-to-all over the placement's expert group, as the collective timing prices it on the topology.
        group = axis_groups(place(plan, topo), ["expert"])[0][0]
        one = collective_time(topo, "all_to_all", group, moe.dispatch_bytes(plan)).time_s
        # F: dispatch + combine per layer; B under full remat: the recomputed forward's two and the backward's two.
        count = plan.model.layers * (2 + 4)
        # Mixtral has no shared experts to hide them: every all-to-all is exposed (up to link sharing).
        assert count * one <= exposed * (1 + 1e-6) and exposed < 1.05 * count * one
        runs[name] = (exposed, one, group)
    # The groups: one rank per node across, one node inside.
    nodes = lambda g: {d // 8 for d in g}  # noqa: E731
    assert len(nodes(runs["across"][2])) == 4 and len(nodes(runs["inside"][2])) == 1
    ratio = runs["across"][0] / runs["inside"][0]
    expected = runs["across"][1] / runs["inside"][1]
    assert ratio == pytest.approx(expected, rel=0.05)
    # And that timing is the links': each rank sends 3/4 of its buffer over its NIC (cluster level) or its
    # NVSwitch port (node level); the ratio of those times is the bandwidths' (the NCCL model's NVLink
    # efficiency makes the node level somewhat slower than its raw bandwidth, so the ratio lies below it).
    node, cluster = (level.bandwidth for level in topo.levels)
    assert 0.6 * node / cluster < ratio < node / cluster
