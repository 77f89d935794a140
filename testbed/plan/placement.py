"""Placement: which topology device holds each mesh coordinate.

The default order (``MESH_AXES`` read from the end; Megatron-LM's
tp-cp-ep-dp-pp) puts the axes whose traffic the step waits for on the
fastest links: ``tensor`` innermost (collectives inside every layer that
block it), then ``context`` (ring attention: every attention layer passes
each rank's K/V, and in the backward dK/dV, to its ring neighbour, bytes of
the order of tensor's on long sequences, but hidden behind the attention
while the links keep up, and only between neighbours:
testbed.model.ring), ``expert`` (a dispatch and a combine all-to-all per MoE
layer, blocking), ``fsdp`` (parameter gathers every layer, prefetched),
``data`` (one gradient reduction per step) and ``stage`` outermost
(point-to-point activations only). Topology device ids are numbered
innermost level first, so filling the mesh with the last axis of the order
varying fastest keeps tensor groups inside a node, and the context ring there
too when tensor x context fits in it. A plan may override the order with
``mesh.order``.

The simulator and the runner both take the mesh from here: the runner builds
its ``jax.sharding.Mesh`` from :attr:`Placement.device_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from testbed.plan.spec import MESH_AXES, Axis, Plan, check_plan
from testbed.topology import Topology

__all__ = ["Placement", "place", "group_span"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """The device-id array of a mesh (dims in MESH_AXES order) and its axis groups."""

    device_ids: np.ndarray
    order: tuple[Axis, ...]
    _groups: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ids = np.array(self.device_ids, dtype=np.int64)
        ids.setflags(write=False)
        if ids.ndim != len(MESH_AXES):
            raise ValueError(f"device_ids must have {len(MESH_AXES)} dims (MESH_AXES), got shape {ids.shape}")
        if sorted(ids.ravel().tolist()) != list(range(ids.size)):
            raise ValueError("device_ids must be a permutation of 0..n-1")
        object.__setattr__(self, "device_ids", ids)
        object.__setattr__(self, "_groups", {})

    @property
    def shape(self) -> dict[Axis, int]:
        return {axis: int(n) for axis, n in zip(MESH_AXES, self.device_ids.shape)}

    @property
    def num_devices(self) -> int:
        return int(self.device_ids.size)

    def groups(self, axis: Axis | str) -> tuple[tuple[int, ...], ...]:
        """Device groups that communicate along ``axis`` (each ordered by axis index).

        The groups partition the devices; each has the axis degree as size.
        """
        axis = Axis(axis)
        cached = self._groups.get(axis)
        if cached is None:
            dim = MESH_AXES.index(axis)
            moved = np.moveaxis(self.device_ids, dim, -1).reshape(-1, self.device_ids.shape[dim])
            cached = tuple(tuple(int(d) for d in row) for row in moved)
            self._groups[axis] = cached
        return cached

    def group_of(self, axis: Axis | str, device: int) -> tuple[int, ...]:
        return next(g for g in self.groups(axis) if device in g)

    def coords(self, device: int) -> dict[Axis, int]:
        """Mesh coordinate of ``device`` along each axis."""
        index = np.argwhere(self.device_ids == device)[0]
        return {axis: int(i) for axis, i in zip(MESH_AXES, index)}

    def stage_devices(self, stage: int) -> tuple[int, ...]:
        """All devices of pipeline stage ``stage`` (its sub-mesh), in mesh order."""
        return tuple(int(d) for d in self.device_ids[stage].ravel())

    def sub_mesh(self, stage: int) -> np.ndarray:
        """Device ids of one stage as an array of the other axes (MESH_AXES after stage)."""
        return self.device_ids[stage]


def place(plan: Plan, topology: Topology | None = None, num_devices: int | None = None) -> Placement:
    """Place ``plan``'s mesh on ``topology`` (or on ``num_devices`` anonymous devices).

    Raises InputError (field ``mesh``) when the mesh size differs from the device count.
    """
    n = topology.num_devices if topology is not None else (num_devices if num_devices is not None else plan.mesh.size)
    check_plan(plan, n, where=f"topology `{topology.name}`" if topology is not None else f"{n} devices")
    order = plan.mesh.order
    degrees = [plan.mesh.degree(a) for a in order]
    # Linear device id of each coordinate in `order` (last axis fastest), then
    # transposed into the canonical MESH_AXES layout.
    linear = np.arange(n, dtype=np.int64).reshape(degrees)
    perm = [order.index(a) for a in MESH_AXES]
    return Placement(device_ids=np.transpose(linear, perm), order=order)


def group_span(topology: Topology, group: tuple[int, ...]) -> str:
    """Name of the smallest set of levels a device group spans (``node``, ``x,y``, ``all``)."""
    if len(group) <= 1 or not topology.levels:
        return "-" if len(group) <= 1 else "all"
    coords = [topology.coords(d) for d in group]
    varying = [i for i in range(len(topology.levels)) if len({c[i] for c in coords}) > 1]
    if topology.nested:
        top = max(varying)
        return topology.levels[top].name
    return ",".join(topology.levels[i].name for i in varying)
