"""Topology model, generators, routing and YAML round trips."""

from __future__ import annotations

import math

import networkx as nx
import pytest
from hypothesis import given, strategies as st

from testbed.topology import generators
from testbed.errors import InputError
from testbed.topology import (Calibration, DeviceSpec, ElementwiseCalibration, HostCalibration, Level, LinkKind,
                              LinkSpec)
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


# -- calibration groups ----------------------------------------------------------------

_DEVICE_YAML = {"flops": {"fp32": "1TFLOP/s"}, "memory": "1GB", "memory_bandwidth": "1GB/s"}


def _with_calibration(calibration):
    return {"device": _DEVICE_YAML, "levels": [{"name": "node", "size": 2, "bandwidth": "1GB/s"}],
            "calibration": calibration}


def test_nested_calibration_round_trips_through_yaml(tmp_path):
    import yaml

    from testbed.topology import (Calibration, CollectiveCalibration, ComputeCalibration, ControllerCalibration,
                                  ElementwiseCalibration, HostCalibration, MemoryCalibration)
    from testbed.topology.io import dump_topology

    full = Calibration(
        compute=ComputeCalibration(efficiency=0.4, efficiency_half_flops=7e6, launch_overhead_s=2e-4),
        memory=MemoryCalibration(efficiency=0.9),
        elementwise=ElementwiseCalibration(replicated_passes=22.7, split_passes=3.5, cached_passes=6.66,
                                           cache_bytes=262144.0),
        collectives=CollectiveCalibration(overhead_s=1e-5),
        host=HostCalibration(cores=2, throughput=((1, 1.0), (2, 1.23), (8, 1.75))),
        controller=ControllerCalibration(overhead_s=3.9e-4, step_s=1.21e-3, pipeline_step_s=1.53e-3, buffer_s=1.24e-6))
    topo = generators.switch(2, device=DEV, bandwidth=1e9, calibration=full, name="cal")
    text = dump_topology(topo)
    data = yaml.safe_load(text)["calibration"]
    assert list(data) == ["compute", "memory", "elementwise", "collectives", "host", "controller"]
    assert data["controller"] == {"overhead_s": 3.9e-4, "step_s": 1.21e-3, "pipeline_step_s": 1.53e-3,
                                  "buffer_s": 1.24e-6}
    assert data["host"]["throughput"] == {1: 1.0, 2: 1.23, 8: 1.75}
    path = tmp_path / "cal.yaml"
    path.write_text(text)
    assert load_topology(str(path)).calibration == full
    # Groups every topology has are left out of the file when they are ideal; optional ones when absent.
    plain = generators.switch(2, device=DEV, bandwidth=1e9, calibration=Calibration(), name="plain")
    assert "calibration" not in topology_to_dict(plain)
    only = full.updated(memory={"efficiency": 1.0}, elementwise=None, host=None, controller=None)
    assert list(topology_to_dict(generators.switch(2, device=DEV, bandwidth=1e9, calibration=only))["calibration"]) \
        == ["compute", "collectives"]
    # Units in the nested fields: times and bytes.
    t = topology_from_dict(_with_calibration({"controller": {"buffer_s": "1.5us"}, "elementwise": {
        "cached_passes": 2, "cache_bytes": "256KiB"}}))
    assert t.calibration.controller.buffer_s == pytest.approx(1.5e-6)
    assert t.calibration.elementwise.cache_bytes == 262144.0
    assert t.calibration.compute == ComputeCalibration() and t.calibration.host is None


def test_gpu_and_tpu_topologies_have_no_host_or_controller_group():
    """... but the one-chip v5e's controller, measured on the chip's traces (benchmarks/tpu_chip_fit.py)."""
    from testbed.topology import CollectiveCalibration, ComputeCalibration, MemoryCalibration

    for name in bundled_names():
        c = load_topology(name).calibration
        if name == "host-cpu-8":  # the calibrated host: every group
            assert all(getattr(c, g) is not None for g in ("elementwise", "host", "controller"))
            assert c.shares_host and c.host.cores == 2 and c.controller.buffer_s == pytest.approx(1.31e-6)
            continue
        assert c.host is None and (c.controller is None) == (name != "tpu-v5e-1"), name
        # NVIDIA GPU topologies price memory-bound kernels (docs/validation.md, "Published runs"): 2 passes, no cache;
        # the one-chip v5e its passes fitted over the chip's suite (benchmarks/tpu_chip_fit.py; tests/test_tpu_chip.py
        # holds them equal to the fit), no cache either
        if name == "tpu-v5e-1":
            assert c.elementwise.replicated_passes > 0 and c.elementwise.cache_bytes == 0.0
        else:
            assert c.elementwise is None or (c.elementwise.replicated_passes, c.elementwise.split_passes,
                                             c.elementwise.cache_bytes) == (2.0, 2.0, 0.0), name
        assert not c.shares_host and c.host_share(8) == 1.0 and c.cached_fraction(1.0, 8) == 0.0
        assert isinstance(c.compute, ComputeCalibration) and isinstance(c.memory, MemoryCalibration)
        # a software cost per collective: per round (GPUs, NCCL) or per launch (TPUs: one op per collective)
        assert isinstance(c.collectives, CollectiveCalibration) and c.collectives.overhead_s + c.collectives.launch_s > 0
    h100 = load_topology("dgx-h100").calibration
    assert (h100.compute.efficiency, h100.compute.launch_overhead_s, h100.memory.efficiency) == (
        0.801, pytest.approx(5e-6), 1.0)


@pytest.mark.parametrize("calibration,field,message", [
    ({"controller": {"buffer_s": -1e-6}}, "calibration.controller.buffer_s", "non-negative"),
    ({"controller": {"buffer_s": "soon"}}, "calibration.controller.buffer_s", "as a time"),
    ({"controller": {"overhead_s": 0}}, "calibration.controller.overhead_s", "leave the `controller` group out"),
    ({"compute": {"efficiency": 2.0}}, "calibration.compute.efficiency", "(0, 1.5]"),
    ({"compute": {"efficiency": "fast"}}, "calibration.compute.efficiency", "a number"),
    ({"memory": {"efficiency": 0}}, "calibration.memory.efficiency", "(0, 1.5]"),
    ({"elementwise": {"split_passes": -1}}, "calibration.elementwise.split_passes", "non-negative"),
    ({"host": {"cores": 1.5}}, "calibration.host.cores", "whole number"),
    ({"host": {"throughput": {2: 1.0}}}, "calibration.host.throughput", "starting at 1"),
    ({"host": {}}, "calibration.host.cores", "`cores` or `throughput`"),
    ({"host": 2}, "calibration.host", "mapping"),
    ({"collectives": {"overhead": "1us"}}, "calibration.collectives.overhead", "did you mean `overhead_s`"),
    ({"controler": {"step_s": 1}}, "calibration.controler", "did you mean `controller`"),
    ({"controller_buffer_s": "1us"}, "calibration.controller_buffer_s", "`calibration.controller.buffer_s`"),
    ({"compute_efficiency": 0.5}, "calibration.compute_efficiency", "`calibration.compute.efficiency`"),
])
def test_calibration_errors_name_the_nested_field(calibration, field, message):
    with pytest.raises(InputError) as info:
        topology_from_dict(_with_calibration(calibration))
    assert info.value.field == field
    assert message in info.value.message


def test_calibration_groups_are_typed_and_updated_by_name():
    from testbed.topology import Calibration, HostCalibration

    with pytest.raises(TypeError, match="HostCalibration"):
        Calibration(host={"cores": 2})
    with pytest.raises(TypeError, match="ComputeCalibration"):
        Calibration(compute=None)
    cal = Calibration().updated(host={"cores": 2}, compute={"efficiency": 0.5})
    assert cal.host == HostCalibration(cores=2) and cal.compute.efficiency == 0.5
    assert cal.host_share(4) == 0.5 and cal.updated(host=None).host_share(4) == 1.0
    with pytest.raises(TypeError, match="unknown calibration group"):
        cal.updated(hosts={"cores": 2})


@given(cache=st.floats(1.0, 1e7), tensor=st.floats(1.0, 1e8), more=st.floats(1.0, 10.0),
       devices=st.integers(1, 64), cores=st.integers(1, 16))
def test_the_cached_fraction_is_the_share_of_the_cache_a_device_holds(cache, tensor, more, devices, cores):
    """A device's share of the cache is ``cache_bytes`` over the devices taking turns on a core; it makes its
    passes from cache for the part of its activation the share holds: 1 within it, falling with the size."""
    c = Calibration(elementwise=ElementwiseCalibration(cache_bytes=cache), host=HostCalibration(cores=cores))
    share = cache / max(1.0, devices / cores)
    f = c.cached_fraction(tensor, devices)
    assert 0.0 < f <= 1.0
    assert f == 1.0 if tensor <= share else f == pytest.approx(share / tensor)
    assert c.cached_fraction(tensor * more, devices) <= f
    assert c.cached_fraction(tensor, devices * 2) <= f
    assert Calibration(elementwise=ElementwiseCalibration(cache_bytes=0.0)).cached_fraction(tensor, devices) == 0.0
    assert c.cached_fraction(0.0, devices) == 0.0


def test_a_device_kind_names_its_chip():
    """JAX's device kinds against topologies' device names (testbed.topology.chips): TPUs by their chip's name."""
    from testbed.topology.chips import chip, is_chip, kind_chip

    assert [chip(n) for n in ("H100-SXM5-80GB", "TPU-v5e", "TPU-v5p")] == ["h100", "tpu v5e", "tpu v5p"]
    assert [kind_chip(k) for k in ("TPU v5 lite", "TPU v5", "TPU v6 lite", "TPU v4")] == \
        ["tpu v5e", "tpu v5p", "tpu v6e", "tpu v4"]
    assert is_chip("TPU-v5e", "TPU v5 lite") and not is_chip("TPU-v5p", "TPU v5 lite")
    assert is_chip("H100-SXM5-80GB", "NVIDIA H100 80GB HBM3") and not is_chip("A100-SXM4-80GB", "NVIDIA H100 80GB HBM3")
