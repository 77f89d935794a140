"""testbed.sim.graph.pricing.price prices each compute task alike once (every microbatch's task of an action reads
its chunk's GEMMs and spans, testbed.sim.graph.program scaling them once per action alike): each task's duration is,
to the bit, testbed.sim.price.compute.compute_seconds of that task alone, on sampled plans of a GPU node and of a TPU
slice (whose spans, blocks and gathers differ)."""

from __future__ import annotations

from helpers import sampled_plans

from testbed.plan.placement import place
from testbed.sim.graph.pricing import price
from testbed.sim.graph.program import build_program
from testbed.sim.graph.tasks import TaskKind
from testbed.sim.price.compute import compute_seconds, plan_matmul_dtype
from testbed.sim.step.facts import topology_rules
from testbed.sim.step.step_rules import serial_host
from testbed.topology.io import load_topology


def test_each_compute_task_is_priced_as_alone() -> None:
    shared = 0  # compute tasks whose GEMMs another task of their program holds too (the memo's hits)
    for name in ("dgx-h100-x4", "tpu-v5e-8x4"):
        topology = load_topology(name)
        for plan in sampled_plans("llama3-8b", 32, 8, 21):
            program = build_program(plan, place(plan, topology), controller=topology.calibration.controller is not None,
                                    serial=serial_host(topology.calibration), **topology_rules(topology))
            dtype = plan_matmul_dtype(plan, topology)
            durations = price(program, topology, dtype).durations
            computes = [(i, t) for i, t in enumerate(program.tasks) if t.kind is TaskKind.COMPUTE]
            for i, t in computes:
                assert durations[i] == compute_seconds(
                    topology, dtype, t.flops, t.hbm_bytes, t.kernels, t.replicated_bytes, t.split_bytes,
                    t.tensor_bytes, t.gemms, t.spans, (t.epilogue_flops, t.epilogue_bytes)), (name, plan.name, t.name)
            shared += len(computes) - len({id(t.gemms) for _, t in computes})
    assert shared > 0
