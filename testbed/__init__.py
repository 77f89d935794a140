"""testbed: simulate and run distributed JAX training plans.

The core (this package) never imports jax, optax or runners; it decides what
happens (plans, topologies, placement, schedules, collectives, model shapes)
and times it on a modelled topology.
"""

from testbed.errors import InputError
from testbed.plan.spec import Axis, MESH_AXES, Plan, Precision, Remat, ScheduleName, check_plan
from testbed.plan.io import load_plan, plan_from_dict, plan_to_dict
from testbed.topology import Calibration, DeviceSpec, Level, LinkKind, Topology
from testbed.topology.io import bundled_names, load_topology, topology_from_dict, topology_to_dict

__all__ = [
    "InputError", "Axis", "MESH_AXES", "Plan", "Precision", "Remat", "ScheduleName", "check_plan",
    "load_plan", "plan_from_dict", "plan_to_dict", "Calibration", "DeviceSpec", "Level", "LinkKind",
    "Topology", "bundled_names", "load_topology", "topology_from_dict", "topology_to_dict",
]

__version__ = "0.1.0"
