"""testbed: simulate and run distributed JAX training plans.

The core (this package, less its ``runner``, ``testing`` and ``cli`` subpackages)
never imports jax or optax; it decides what
happens (plans, topologies, placement, schedules, collectives, model shapes)
and times it on a modelled topology. ``testbed.runner`` executes the same plan with
JAX; the ``testbed`` command (:mod:`testbed.cli`) drives both.

    from testbed import load_plan, load_topology, simulate
    sim = simulate(load_plan("demo"), load_topology("host-cpu-8"))
    print(sim.report.step_time_s, sim.report.memory["total"])
"""

from __future__ import annotations

import importlib

#: Public name -> the module defining it. Imported on first use, so ``import testbed`` (and the ``testbed``
#: command's start) loads nothing until a name is needed.
_EXPORTS = {
    "InputError": "testbed.errors", "MemoryBreakdown": "testbed.model.memory",
    "memory_breakdown": "testbed.model.memory", "load_plan": "testbed.plan.io", "plan_from_dict": "testbed.plan.io",
    "plan_to_dict": "testbed.plan.io", "Placement": "testbed.plan.placement", "place": "testbed.plan.placement",
    "MESH_AXES": "testbed.plan.spec", "Axis": "testbed.plan.spec", "Plan": "testbed.plan.spec",
    "Precision": "testbed.plan.spec", "Remat": "testbed.plan.spec", "ScheduleName": "testbed.plan.spec",
    "check_plan": "testbed.plan.spec", "Simulation": "testbed.sim.graph.engine", "simulate": "testbed.sim.graph.engine",
    "Report": "testbed.sim.report.timeline", "Timeline": "testbed.sim.report.timeline", "Calibration": "testbed.topology",
    "DeviceSpec": "testbed.topology", "Level": "testbed.topology", "LinkKind": "testbed.topology",
    "Topology": "testbed.topology", "bundled_names": "testbed.topology.io", "load_topology": "testbed.topology.io",
    "topology_from_dict": "testbed.topology.io", "topology_to_dict": "testbed.topology.io",
}

__all__ = [
    "simulate", "Simulation", "Report", "Timeline", "memory_breakdown", "MemoryBreakdown", "place", "Placement",
    "InputError", "Axis", "MESH_AXES", "Plan", "Precision", "Remat", "ScheduleName", "check_plan",
    "load_plan", "plan_from_dict", "plan_to_dict", "Calibration", "DeviceSpec", "Level", "LinkKind",
    "Topology", "bundled_names", "load_topology", "topology_from_dict", "topology_to_dict",
]

__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'testbed' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
