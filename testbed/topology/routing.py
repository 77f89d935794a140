"""A topology's graph and routes: the networkx graph of its form, and the links a transfer crosses.

Device ids are mixed-radix with the innermost level fastest, so consecutive
ids share the fastest links. :class:`~testbed.topology.spec.Topology` builds
its graph and caches its routes with these functions.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import networkx as nx

from testbed.errors import InputError
from testbed.topology.parts import Form, Level, LinkSpec

if TYPE_CHECKING:  # the Topology class calls this module; only its annotations name it here
    from testbed.topology.spec import Topology

__all__ = ["build_graph", "route"]

Node = int | str
Hop = tuple[Node, Node]


# -- graph construction ---------------------------------------------------------

def _edge(graph: nx.Graph, u: Node, v: Node, level: Level | LinkSpec) -> None:
    graph.add_edge(u, v, bandwidth=float(level.bandwidth), latency=float(level.latency), kind=str(level.kind))


def _switch_name(topology: Topology, k: int, device: int) -> str:
    block = math.prod(l.size for l in topology.levels[: k + 1])
    return f"{topology.levels[k].name}{device // block}"


def build_graph(topology: Topology) -> nx.Graph:
    """The networkx graph of a topology's form (devices carry ``kind='device'``)."""
    graph = nx.Graph(name=topology.name)
    graph.add_nodes_from(range(topology.num_devices), kind="device")
    if topology.form is Form.TORUS:
        sizes = [l.size for l in topology.levels]
        strides = [math.prod(sizes[:i]) for i in range(len(sizes))]
        for device in range(topology.num_devices):
            coords = topology.coords(device)
            for i, level in enumerate(topology.levels):
                if level.size == 1:
                    continue
                nxt = coords[i] + 1
                if nxt == level.size:
                    if not level.wraparound or level.size == 2:
                        continue
                    nxt = 0
                _edge(graph, device, device + (nxt - coords[i]) * strides[i], level)
    elif topology.form is Form.LEVELS:
        for k, level in enumerate(topology.levels):
            for device in range(topology.num_devices):
                sw = _switch_name(topology, k, device)
                graph.add_node(sw, kind="switch", level=level.name)
                if level.attach == "device" or k == 0:
                    _edge(graph, device, sw, level)
                else:
                    _edge(graph, _switch_name(topology, k - 1, device), sw, level)
    else:
        graph.add_nodes_from(topology.switches, kind="switch")
        known = set(range(topology.num_devices)) | set(topology.switches)
        for i, link in enumerate(topology.links):
            for end in (link.a, link.b):
                if end not in known:
                    raise InputError(
                        f"link end {end!r} is neither a device id 0..{topology.num_devices - 1} nor a declared switch",
                        field=f"graph.links[{i}]",
                    )
            _edge(graph, link.a, link.b, link)
    return graph


# -- routing ----------------------------------------------------------------------

def _torus_route(topology: Topology, src: int, dst: int) -> tuple[Hop, ...]:
    hops: list[Hop] = []
    sizes = [l.size for l in topology.levels]
    strides = [math.prod(sizes[:i]) for i in range(len(sizes))]
    here = src
    for i, level in enumerate(topology.levels):
        a, b, n = topology.coords(here)[i], topology.coords(dst)[i], level.size
        if a == b:
            continue
        if level.wraparound:
            forward = (b - a) % n
            step = 1 if forward <= n - forward else -1
        else:
            step = 1 if b > a else -1
        while a != b:
            nxt = (a + step) % n
            nxt_device = here + (nxt - a) * strides[i]
            hops.append((here, nxt_device))
            here, a = nxt_device, nxt
    return tuple(hops)


def _up(topology: Topology, device: int, k: int) -> list[Node]:
    """Nodes from ``device`` up to its level-k switch."""
    level = topology.levels[k]
    if k == 0 or level.attach == "device":
        return [device, _switch_name(topology, k, device)]
    return [*_up(topology, device, k - 1), _switch_name(topology, k, device)]


def _levels_route(topology: Topology, src: int, dst: int) -> tuple[Hop, ...]:
    a, b = topology.coords(src), topology.coords(dst)
    common = next(k for k in range(len(a)) if a[k + 1:] == b[k + 1:])
    up, down = _up(topology, src, common), _up(topology, dst, common)
    nodes = up + down[-2::-1]
    return tuple(zip(nodes[:-1], nodes[1:]))


def route(topology: Topology, src: int, dst: int) -> tuple[Hop, ...]:
    """Directed links from device src to device dst (empty when src == dst)."""
    if src == dst:
        return ()
    if topology.form is Form.TORUS:
        return _torus_route(topology, src, dst)
    if topology.form is Form.LEVELS:
        return _levels_route(topology, src, dst)
    nodes = nx.shortest_path(topology.graph, src, dst, weight=lambda u, v, d: 1.0 + d["latency"])
    return tuple(zip(nodes[:-1], nodes[1:]))
