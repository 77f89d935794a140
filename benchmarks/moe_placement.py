"""Mixture of experts in the simulator: Mixtral 8x7B and DeepSeekMoE 16B on four DGX H100 nodes, the expert
groups across nodes (``mesh.order`` with expert outermost: one rank per node, the all-to-alls on the NICs) and
inside a node (expert innermost: NVLink).

For each case, simulated by the discrete-event engine and by the analytic tier: step time, exposed
communication and the MoE all-to-alls' share of it (testbed.sim.step.moe.exposed_stream_s), MFU, memory per device,
and the seconds the simulation took. These are the rows of docs/llms.md's "Mixture of experts" table. The
routed experts run a dropless grouped GEMM over the routed tokens (``runtime.moe_padded_dropless: false``, as
Megatron-Core's GroupedMLP), where ``expert_imbalance`` paces them; testbed's runner pads every expert's slots to
the sequence instead.
Prints one JSON object. Usage: ``python benchmarks/moe_placement.py``.
"""

from __future__ import annotations

import json
import time

from testbed.explore.analytic import estimate
from testbed.plan.io import plan_from_dict
from testbed.sim.graph.engine import simulate
from testbed.sim.step.moe import exposed_stream_s
from testbed.topology.io import load_topology

ACROSS = ["stage", "expert", "data", "fsdp", "context", "tensor"]  # one rank of every expert group per node
INSIDE = ["stage", "data", "fsdp", "context", "expert", "tensor"]  # an expert group inside one node

#: (name, model mapping, global batch, mesh, expert_imbalance)
CASES = [
    ("mixtral-8x7b DP 8 x EP 4", {"preset": "mixtral-8x7b", "seq_len": 4096}, 32, {"data": 8, "expert": 4}, 1.0),
    ("mixtral-8x7b FSDP 8 x EP 4", {"preset": "mixtral-8x7b", "seq_len": 4096}, 32, {"fsdp": 8, "expert": 4}, 1.0),
    ("deepseek-moe-16b DP 4 x EP 8", {"preset": "deepseek-moe-16b"}, 64, {"data": 4, "expert": 8}, 1.0),
    ("deepseek-moe-16b DP 4 x EP 8, imbalance 1.5", {"preset": "deepseek-moe-16b"}, 64, {"data": 4, "expert": 8},
     1.5),
]


def main() -> dict:
    topology = load_topology("dgx-h100-x4")
    rows = []
    for name, model, batch, mesh, imbalance in CASES:
        for where, order in (("across nodes", ACROSS), ("inside a node", INSIDE)):
            plan = plan_from_dict({"name": name, "model": model, "batch": {"global_batch": batch},
                                   "mesh": {**mesh, "order": order}, "precision": "bf16-mixed", "remat": "full",
                                   "expert_imbalance": imbalance, "runtime": {"moe_padded_dropless": False}})
            start = time.perf_counter()
            sim = simulate(plan, topology)
            seconds = time.perf_counter() - start
            r = sim.report
            rows.append({"case": name, "expert_groups": where, "step_time_s": r.step_time_s,
                         "exposed_comm_s": r.exposed_comm_s, "exposed_all_to_all_s": exposed_stream_s(sim.timeline),
                         "mfu": r.mfu, "memory_bytes": r.memory["total"], "fits": r.memory["fits"],
                         "analytic_step_time_s": estimate(plan, topology).step_time_s, "simulate_s": seconds})
    return {"topology": topology.name, "precision": "bf16-mixed", "remat": "full", "rows": rows}


if __name__ == "__main__":
    print(json.dumps(main()))
