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

A plan may also state ``mesh.tile`` (one size per topology level): the mesh is then filled tile by tile, the
tiles in device-id order, each tile's devices in a snake (the innermost level forward, then back, each
outer step of the tile in turn), so the innermost mesh axis whose degree is the tile's size lies on a block
of neighbouring chips, and on a torus tile of two rows on a ring. MaxText's ``custom_mesh: hybrid_ring_64x4``
(maxtext ``max_utils.reshape_mesh_to_rings``) lays a 16x16 v6e pod's 4-chip groups so: ``[a[i, j],
a[i, j+1], a[i+1, j+1], a[i+1, j]]`` for each 2x2 block, tile ``[2, 2]``; its ``hybrid_ring_32x8`` is tile
``[4, 2]``. The tile needs the topology's geometry: placed on anonymous devices (``num_devices``, as the
runner places on the devices it is given) the mesh keeps device-id order.

The simulator and the runner both take the mesh from here: the runner builds
its ``jax.sharding.Mesh`` from :attr:`Placement.device_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from testbed.errors import InputError
from testbed.plan.spec import MESH_AXES, Axis, Plan, check_plan
from testbed.topology import Topology

__all__ = ["Placement", "place", "group_span", "tile_order"]


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
        if not np.array_equal(np.sort(ids, axis=None), np.arange(ids.size)):
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
    if plan.mesh.tile and topology is not None:
        linear = tile_order(topology, plan.mesh.tile)[linear]
    perm = [order.index(a) for a in MESH_AXES]
    return Placement(device_ids=np.transpose(linear, perm), order=order)


def _snake(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every coordinate of ``shape`` (innermost first) once, each next to the one before: the innermost digit
    runs forward or back as the digits outside it sum to even or odd (a boustrophedon)."""
    if not shape:
        return [()]
    inner, out = shape[0], []
    for k, rest in enumerate(_snake(shape[1:])):
        steps = range(inner) if k % 2 == 0 else range(inner - 1, -1, -1)
        out += [(i, *rest) for i in steps]
    return out


def tile_order(topology: Topology, tile: tuple[int, ...]) -> np.ndarray:
    """The device ids in the order ``mesh.tile`` fills them: tile after tile (tiles in device-id order), each
    tile's devices in :func:`_snake` order. InputError (``mesh.tile``) when the tile does not divide the levels."""
    sizes = [level.size for level in topology.levels]
    if len(tile) > len(sizes) or any(s % t for s, t in zip(sizes, tile)):
        raise InputError(f"a tile of {list(tile)} does not divide topology `{topology.name}`'s levels "
                         f"{dict(zip(topology.level_names, sizes))}: give one size per level (innermost first, at "
                         f"most {len(sizes)}), each dividing its level", field="mesh.tile")
    tile = tuple(tile) + (1,) * (len(sizes) - len(tile))
    strides = np.cumprod([1] + sizes[:-1])
    inside = _snake(tile)
    blocks = [tuple(reversed(b)) for b in np.ndindex(*reversed([s // t for s, t in zip(sizes, tile)]))]
    order = [sum((b * t + c) * stride for b, t, c, stride in zip(block, tile, cell, strides))
             for block in blocks for cell in inside]
    return np.array(order, dtype=np.int64)


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
