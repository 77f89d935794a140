"""A topology's graph and routes: the networkx graph of its form, and the links a transfer crosses.

Device ids are mixed-radix with the innermost level fastest, so consecutive
ids share the fastest links. :class:`~testbed.topology.spec.Topology` builds
its graph and caches its routes with these functions.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import networkx as nx
import numpy as np

from testbed.errors import InputError
from testbed.topology.parts import Form, Level, LinkSpec

if TYPE_CHECKING:  # the Topology class calls this module; only its annotations name it here
    from testbed.topology.spec import Topology

__all__ = ["build_graph", "route", "slice_switch"]

Node = int | str
Hop = tuple[Node, Node]


# -- graph construction ---------------------------------------------------------

def _edge(graph: nx.Graph, u: Node, v: Node, level: Level | LinkSpec) -> None:
    graph.add_edge(u, v, bandwidth=float(level.bandwidth), latency=float(level.latency), kind=str(level.kind))


def _switch_name(topology: Topology, k: int, device: int) -> str:
    block = math.prod(l.size for l in topology.levels[: k + 1])
    return f"{topology.levels[k].name}{device // block}"


def slice_switch(topology: Topology) -> str | None:
    """The data-center switch node joining the slices of a multi-slice torus (None without slices)."""
    k = topology.slice_level
    return None if k is None else f"{topology.levels[k].name}0"


def _attrs(level: Level | LinkSpec) -> dict[str, object]:
    return {"bandwidth": float(level.bandwidth), "latency": float(level.latency), "kind": str(level.kind)}


def _add_edges(graph: nx.Graph, us: list, vs: list, attrs: list[dict]) -> None:
    """``graph.add_edges_from`` for new edges between existing nodes, each with its own copy of its attributes.

    Writes networkx's adjacency dicts directly (one shared data dict per
    undirected edge, as ``add_edge`` does): ``add_edges_from`` spends ~10 us an
    edge merging attributes, seconds on the 196,608 links of a 65,536-chip torus.
    """
    adj = graph._adj
    for u, v, attr in zip(us, vs, attrs):
        data = adj[u].get(v)
        if data is None:
            data = dict(attr)
            adj[u][v] = data
            adj[v][u] = data
        else:
            data.update(attr)


#: Links a topology's graph may have (its expansion is checked against this before it is built): a levels
#: topology of 2^20 devices on three levels has 3.1 M and took 15 s of CPU and 1.5 GB to build on the project's
#: 2-core host (about 500 bytes a link), so 2^22 links stay near 2 GB.
MAX_LINKS = 1 << 22


def link_count(topology: Topology) -> int:
    """How many links the graph of ``topology`` has (a torus: at most), computed without building it."""
    n = topology.num_devices
    if topology.form is Form.TORUS:
        rings = sum(1 for level in topology.levels if not level.switched and level.size > 1)
        return n * rings + (n if topology.slice_level is not None else 0)
    if topology.form is Form.LEVELS:
        count, block = 0, 1
        for k, level in enumerate(topology.levels):
            count += n if level.attach == "device" or k == 0 else n // block
            block *= level.size
        return count
    return len(topology.links)


def check_size(topology: Topology) -> None:
    """InputError when the graph of ``topology`` would have more than :data:`MAX_LINKS` links."""
    count = link_count(topology)
    if count > MAX_LINKS:
        raise InputError(f"expands to {count:,} links ({topology.num_devices:,} devices); the testbed builds at most "
                         f"{MAX_LINKS:,} links (about 2 GB of graph): use fewer devices, fewer levels or fewer "
                         "`attach: device` levels", field="levels")


def build_graph(topology: Topology) -> nx.Graph:
    """The networkx graph of a topology's form (devices carry ``kind='device'``).

    Tori and hierarchies are laid out with numpy (a 65,536-device torus in well
    under a second); edges are added in the order the forms define: device by
    device, innermost level first. A graph past :data:`MAX_LINKS` is refused before
    any of it is built (:func:`check_size`).
    """
    check_size(topology)
    graph = nx.Graph(name=topology.name)
    # add_nodes_from(range(n), kind="device"), written directly (a fresh attribute dict per device)
    graph._node.update({device: {"kind": "device"} for device in range(topology.num_devices)})
    graph._adj.update({device: {} for device in range(topology.num_devices)})
    if topology.form is Form.TORUS:
        _add_torus(graph, topology)
    elif topology.form is Form.LEVELS:
        _add_levels(graph, topology)
    else:
        _add_links(graph, topology)
    return graph


def _add_torus(graph: nx.Graph, topology: Topology) -> None:
    """A torus's ring links, device-major and level-minor, then every chip's link to the data-center switch
    when it has slices."""
    ids = np.arange(topology.num_devices, dtype=np.int64)
    stride = 1
    ends, attrs = [], []
    for i, level in enumerate(topology.levels):
        if level.switched:  # the last level, slices: links to the data-center switch below, no ring
            continue
        coord = ids // stride % level.size
        nxt = coord + 1
        keep = (nxt < level.size) | bool(level.wraparound and level.size > 2)
        if level.size == 1:
            keep = np.zeros_like(keep)
        ends.append((np.where(keep, ids, -1), ids + (nxt % level.size - coord) * stride))
        attrs.append(_attrs(level))
        stride *= level.size
    if ends:
        us = np.stack([u for u, _ in ends], axis=1).reshape(-1)  # device-major, level-minor
        vs = np.stack([v for _, v in ends], axis=1).reshape(-1)
        which = np.tile(np.arange(len(ends)), topology.num_devices)
        keep = us >= 0
        _add_edges(graph, us[keep].tolist(), vs[keep].tolist(), [attrs[k] for k in which[keep].tolist()])
    k = topology.slice_level
    if k is not None and topology.levels[k].size > 1:  # every chip's own link to the data-center switch
        switch = slice_switch(topology)
        graph.add_node(switch, kind="switch", level=topology.levels[k].name)
        _add_edges(graph, ids.tolist(), [switch] * topology.num_devices,
                   [_attrs(topology.levels[k])] * topology.num_devices)


def _add_levels(graph: nx.Graph, topology: Topology) -> None:
    """A hierarchy's switches, level by level, each linked to the devices or switches one level below."""
    ids = np.arange(topology.num_devices, dtype=np.int64)
    block = 1
    for k, level in enumerate(topology.levels):
        inner_block = block
        block *= level.size
        switches = [f"{level.name}{j}" for j in range(topology.num_devices // block)]
        graph.add_nodes_from(switches, kind="switch", level=level.name)
        attr = _attrs(level)
        if level.attach == "device" or k == 0:
            lower, upper = ids.tolist(), [switches[j] for j in (ids // block).tolist()]
        else:
            below = topology.levels[k - 1].name
            lower = [f"{below}{j}" for j in range(topology.num_devices // inner_block)]
            upper = [switches[j * inner_block // block] for j in range(len(lower))]
        _add_edges(graph, lower, upper, [attr] * len(lower))


def _add_links(graph: nx.Graph, topology: Topology) -> None:
    """An explicit graph's switches and links, each link end checked against the devices and switches."""
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
        if level.switched:  # across slices: up to the data-center switch and down (the last level)
            switch = slice_switch(topology)
            hops += [(here, switch), (switch, dst)]
            here = dst
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
