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

from testbed.errors import InputError
from testbed.model.memory import MemoryBreakdown, memory_breakdown
from testbed.plan.io import load_plan, plan_from_dict, plan_to_dict
from testbed.plan.placement import Placement, place
from testbed.plan.spec import MESH_AXES, Axis, Plan, Precision, Remat, ScheduleName, check_plan
from testbed.sim.engine import Simulation, simulate
from testbed.sim.timeline import Report, Timeline
from testbed.topology import Calibration, DeviceSpec, Level, LinkKind, Topology
from testbed.topology.io import bundled_names, load_topology, topology_from_dict, topology_to_dict

__all__ = [
    "simulate", "Simulation", "Report", "Timeline", "memory_breakdown", "MemoryBreakdown", "place", "Placement",
    "InputError", "Axis", "MESH_AXES", "Plan", "Precision", "Remat", "ScheduleName", "check_plan",
    "load_plan", "plan_from_dict", "plan_to_dict", "Calibration", "DeviceSpec", "Level", "LinkKind",
    "Topology", "bundled_names", "load_topology", "topology_from_dict", "topology_to_dict",
]

__version__ = "0.1.0"
