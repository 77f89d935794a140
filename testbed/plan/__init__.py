"""The plan both interpreters read: its spec, YAML files, placement on a topology, and shard rules."""

from testbed.plan.io import dump_plan, load_plan, plan_from_dict, plan_to_dict
from testbed.plan.placement import Placement, place
from testbed.plan.spec import (MESH_AXES, Axis, BatchSpec, MeshSpec, ModelSpec, OptimizerSpec, Plan, Precision, Remat,
                               ScheduleName, ScheduleSpec, check_plan)

__all__ = ["Axis", "MESH_AXES", "BatchSpec", "MeshSpec", "ModelSpec", "OptimizerSpec", "Plan", "Precision", "Remat",
           "ScheduleName", "ScheduleSpec", "check_plan", "load_plan", "plan_from_dict", "plan_to_dict", "dump_plan",
           "Placement", "place"]
