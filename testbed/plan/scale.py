"""Exploration helpers: re-shape a plan for another topology.

:func:`scale_data` keeps everything about a plan except its data degree and
global batch: the per-replica batch (and so the microbatch size, the memory
per device and the pipeline schedule) stays the same, so comparing the plan
across topologies of different sizes compares like with like.
"""

from __future__ import annotations

from dataclasses import replace

from testbed.errors import InputError
from testbed.plan.spec import Plan

__all__ = ["scale_data", "SCALE_AXES"]

#: Axes ``testbed compare --scale`` can scale.
SCALE_AXES = ("data",)


def scale_data(plan: Plan, num_devices: int, where: str = "the topology") -> Plan:
    """``plan`` with its data degree set so the mesh uses ``num_devices`` devices.

    The global batch scales with the data degree (same sequences per replica).
    Raises InputError when ``num_devices`` is not a multiple of the devices of
    one data replica (stage x fsdp x tensor).
    """
    mesh = plan.mesh
    per_replica = mesh.stage * mesh.fsdp * mesh.tensor
    if num_devices < per_replica or num_devices % per_replica:
        raise InputError(
            f"cannot scale the data degree to {where} ({num_devices} devices): one data replica uses "
            f"stage x fsdp x tensor = {mesh.stage} x {mesh.fsdp} x {mesh.tensor} = {per_replica} devices, "
            f"which must divide the device count", field="mesh.data")
    data = num_devices // per_replica
    per_replica_batch = plan.batch.global_batch // mesh.data
    scaled = replace(plan, mesh=replace(mesh, data=data),
                     batch=replace(plan.batch, global_batch=per_replica_batch * data))
    return scaled
