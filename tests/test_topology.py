"""Topology model, generators, routing and YAML round trips."""

from __future__ import annotations

import math

import networkx as nx
import pytest
from hypothesis import given, strategies as st

from testbed.topology import generators
from testbed.errors import InputError
from testbed.topology import DeviceSpec, Level, LinkKind, LinkSpec
from testbed.topology.io import bundled_names, load_topology, topology_from_dict, topology_to_dict
from testbed.units import parse_bandwidth, parse_bytes, parse_time

DEV = DeviceSpec(name="d", peak_flops={"bf16": 1e12, "fp32": 5e11}, memory_bytes=1e9, memory_bandwidth=1e11)


def test_units_reference_values():
    assert parse_bandwidth("450GB/s") == 450e9
    assert parse_bandwidth("100Gb/s") == 12.5e9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("2MB") == 2e6
    assert parse_time("1us") == 1e-6
    assert parse_time("2.5ms") == 2.5e-3
    with pytest.raises(InputError):
        parse_bandwidth("-5GB/s")
    with pytest.raises(InputError):
        parse_bytes("12 parsecs")


@given(st.integers(2, 12), st.integers(2, 12), st.booleans())
def test_torus_edge_counts_and_degrees(a, b, wrap):
    t = generators.torus([a, b], device=DEV, bandwidth=1e9, wraparound=wrap)
    g = t.graph
    assert g.number_of_nodes() == a * b
    def dim_edges(n, other):
        return (n if wrap and n > 2 else n - 1) * other
    assert g.number_of_edges() == dim_edges(a, b) + dim_edges(b, a)
    if wrap and a > 2 and b > 2:
        assert all(d == 4 for _, d in g.degree())


def test_torus_4x4_wraparound_is_networkx_periodic_grid():
    t = generators.torus([4, 4], device=DEV, bandwidth=1e9, wraparound=True)
    assert nx.is_isomorphic(t.graph, nx.grid_2d_graph(4, 4, periodic=True))
    open_ = generators.torus([4, 4], device=DEV, bandwidth=1e9, wraparound=False)
    assert nx.is_isomorphic(open_.graph, nx.grid_2d_graph(4, 4, periodic=False))


def test_ring_is_cycle():
    t = generators.ring(7, device=DEV, bandwidth=1e9)
    assert nx.is_isomorphic(t.graph, nx.cycle_graph(7))


def test_hierarchical_node_groups_are_cliques_through_their_switch():
    t = load_topology("dgx-h100-x4")
    assert t.num_devices == 32
    for group in t.groups("node"):
        assert len(group) == 8
        switches = {v for d in group for v in t.graph.neighbors(d) if t.graph.nodes[v]["kind"] == "switch"
                    and t.graph.nodes[v]["level"] == "node"}
        assert len(switches) == 1
        for a in group:
            for b in group:
                if a != b:
                    hops = t.route(a, b)
                    assert len(hops) == 2 and hops[0][1] in switches
                    assert t.path_bandwidth(a, b) == 450e9
    assert t.groups("cluster") == [tuple(range(32))]
    assert t.path_bandwidth(0, 8) == 50e9


def test_switch_star_degrees():
    t = generators.switch(5, device=DEV, bandwidth=1e9)
    degrees = dict(t.graph.degree())
    assert degrees["node0"] == 5 and all(degrees[d] == 1 for d in range(5))


@given(st.lists(st.integers(1, 5), min_size=1, max_size=3), st.data())
def test_torus_routes_are_paths_of_minimal_dimension_ordered_length(dims, data):
    wrap = data.draw(st.booleans())
    t = generators.torus(dims, device=DEV, bandwidth=1e9, wraparound=wrap)
    src = data.draw(st.integers(0, t.num_devices - 1))
    dst = data.draw(st.integers(0, t.num_devices - 1))
    hops = t.route(src, dst)
    node = src
    for u, v in hops:
        assert u == node and t.graph.has_edge(u, v)
        node = v
    assert node == dst
    expected = 0
    for a, b, level in zip(t.coords(src), t.coords(dst), t.levels):
        d = abs(a - b)
        expected += min(d, level.size - d) if wrap else d
    assert len(hops) == expected


def test_torus_groups_along_dims():
    t = load_topology("tpu-v4-4x4x4")
    assert len(t.groups("x")) == 16 and all(len(g) == 4 for g in t.groups("x"))
    assert len(t.groups("x,y")) == 4 and all(len(g) == 16 for g in t.groups("x,y"))
    assert t.groups("all") == [tuple(range(64))]
    with pytest.raises(InputError, match="did you mean `x`"):
        t.groups("xx")


def test_disconnected_graph_is_rejected():
    links = [LinkSpec(a=0, b=1, bandwidth=1e9), LinkSpec(a=2, b=3, bandwidth=1e9)]
    with pytest.raises(InputError, match="disconnected"):
        generators.explicit(4, links, device=DEV)


def test_explicit_graph_routes_by_hops():
    links = [LinkSpec(a=0, b="sw", bandwidth=1e9), LinkSpec(a=1, b="sw", bandwidth=1e9),
             LinkSpec(a=2, b="sw", bandwidth=1e9), LinkSpec(a=0, b=2, bandwidth=5e10, kind=LinkKind.NVLINK)]
    t = generators.explicit(3, links, device=DEV, switches=["sw"])
    assert t.route(0, 2) == ((0, 2),)
    assert t.route(0, 1) == ((0, "sw"), ("sw", 1))


@pytest.mark.parametrize("name", bundled_names())
def test_bundled_topology_yaml_round_trip(name):
    t = load_topology(name)
    again = topology_from_dict(topology_to_dict(t))
    assert again == t
    assert nx.utils.graphs_equal(again.graph, t.graph)
    assert t.device.memory_bytes > 1e9 and t.device.memory_bandwidth > 0
    assert math.prod(l.size for l in t.levels) == t.num_devices


def test_bundled_collection_is_complete():
    expected = {"host-cpu-8", "dgx-h100", "dgx-h100-x4", "a100-pcie-8", "eth-100g-8", "tpu-v4-4x4x4",
                "tpu-v5e-4x4", "tpu-v5e-8x4", "tpu-v5e-16x16", "tpu-v5p-2x4x4"}
    assert expected <= set(bundled_names())
    assert load_topology("tpu-v5e-16x16").levels[0].wraparound
    assert not load_topology("tpu-v5e-8x4").levels[0].wraparound


def test_scaling_helpers():
    t = load_topology("dgx-h100-x4")
    assert t.with_bandwidth_scaled(2).path_bandwidth(0, 9) == 100e9
    assert t.with_flops_scaled(0.5).device.flops("bf16") == pytest.approx(989e12 / 2)


def test_graph_levels_yaml():
    data = {"device": {"flops": {"fp32": "1TFLOP/s"}, "memory": "1GB", "memory_bandwidth": "1GB/s"},
            "graph": {"devices": 4, "switches": ["s"],
                      "links": [{"a": i, "b": "s", "bandwidth": "10GB/s"} for i in range(4)],
                      "levels": [{"name": "pair", "size": 2}]}}
    t = topology_from_dict(data)
    assert t.groups("pair") == [(0, 1), (2, 3)]
    assert topology_from_dict(topology_to_dict(t)) == t
