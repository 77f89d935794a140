"""Topology generators named by shape: ring, torus, switch, hierarchical, explicit.

Each returns a :class:`~testbed.topology.spec.Topology`; its networkx graph
and routes come from :mod:`testbed.topology.routing`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from testbed.errors import InputError
from testbed.topology.calibration import Calibration
from testbed.topology.parts import DeviceSpec, Form, Level, LinkKind, LinkSpec
from testbed.topology.spec import Topology

__all__ = ["ring", "torus", "switch", "hierarchical", "explicit"]


def ring(n: int, *, device: DeviceSpec, bandwidth: float, latency: float = 0.0,
         kind: LinkKind = LinkKind.ICI, name: str = "ring", calibration: Calibration | None = None) -> Topology:
    """n devices in a cycle: a one-dim torus with wraparound, dim named ``x``."""
    return torus([n], device=device, bandwidth=bandwidth, latency=latency, kind=kind, names=["x"],
                 wraparound=True, name=name, calibration=calibration)


def torus(dims: Sequence[int], *, device: DeviceSpec, bandwidth: float, latency: float = 0.0,
          kind: LinkKind = LinkKind.ICI, names: Sequence[str] | None = None,
          wraparound: bool | Sequence[bool] = True, name: str = "torus",
          calibration: Calibration | None = None, slices: Level | None = None) -> Topology:
    """A torus (or mesh, without wraparound) with named dims, x fastest.

    ``slices``: ``slices.size`` copies of the torus joined by a data-center
    network (each chip's own link, ``slices.bandwidth`` per direction, to one
    switch): a last, switched level, so device ids are slice-major (slice s
    holds ids ``s * chips .. (s + 1) * chips - 1``) and ``--over`` its name
    groups the chips at one position of every slice.
    """
    names = list(names) if names is not None else ["x", "y", "z", "w"][: len(dims)]
    if len(names) != len(dims):
        raise InputError(f"{len(dims)} dims need {len(dims)} names, got {names}", field="torus.names")
    wraps = [wraparound] * len(dims) if isinstance(wraparound, bool) else list(wraparound)
    if len(wraps) != len(dims):
        raise InputError(f"{len(dims)} dims need {len(dims)} wraparound flags, got {wraps}", field="torus.wraparound")
    levels = tuple(
        Level(name=n_, size=d, bandwidth=bandwidth, latency=latency, kind=kind, wraparound=bool(w))
        for n_, d, w in zip(names, dims, wraps)
    )
    count = 1
    if slices is not None:
        if slices.name in names:
            raise InputError(f"the slices' name `{slices.name}` is already a dim name ({names})",
                             field="torus.slices.name")
        if slices.bandwidth is None:
            raise InputError("needs a bandwidth (each chip's share of its host's data-center NICs)",
                             field="torus.slices.bandwidth")
        levels = (*levels, replace(slices, switched=True, wraparound=False, kind=slices.kind or LinkKind.DCN))
        count = slices.size
    return Topology(name=name, form=Form.TORUS, device=device, levels=levels, num_devices=math.prod(dims) * count,
                    calibration=calibration or Calibration())


def switch(n: int, *, device: DeviceSpec, bandwidth: float, latency: float = 0.0,
           kind: LinkKind = LinkKind.NVSWITCH, level: str = "node", name: str = "switch",
           calibration: Calibration | None = None) -> Topology:
    """n devices on one switch (a star), the group named ``level``."""
    return hierarchical([Level(name=level, size=n, bandwidth=bandwidth, latency=latency, kind=kind)],
                        device=device, name=name, calibration=calibration)


def hierarchical(levels: Sequence[Level], *, device: DeviceSpec, name: str = "hierarchical",
                 calibration: Calibration | None = None) -> Topology:
    """Nested tiers, innermost first, each group of a tier joined by its own switch."""
    for level in levels:
        if level.bandwidth is None or level.kind is None:
            raise InputError("needs bandwidth and kind", field=f"levels.{level.name}")
    return Topology(name=name, form=Form.LEVELS, device=device, levels=tuple(levels),
                    num_devices=math.prod(l.size for l in levels), calibration=calibration or Calibration())


def explicit(num_devices: int, links: Sequence[LinkSpec], *, device: DeviceSpec, switches: Sequence[str] = (),
             levels: Sequence[Level] = (), name: str = "graph", calibration: Calibration | None = None) -> Topology:
    """Any graph: devices 0..n-1, named switches, and explicit links (asymmetric layouts)."""
    if levels and num_devices % math.prod(l.size for l in levels) != 0:
        raise InputError(f"level sizes must divide the device count {num_devices}", field="graph.levels")
    if levels and math.prod(l.size for l in levels) != num_devices:
        # The outermost named group spans the rest of the devices implicitly.
        rest = num_devices // math.prod(l.size for l in levels)
        levels = (*levels, Level(name="rest", size=rest))
    return Topology(name=name, form=Form.GRAPH, device=device, levels=tuple(levels), num_devices=num_devices,
                    links=tuple(links), switches=tuple(switches), calibration=calibration or Calibration())
