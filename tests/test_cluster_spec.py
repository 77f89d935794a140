"""The emulated cluster's plan (testbed.cluster.spec): pure, no privilege needed."""

from __future__ import annotations

import pytest

from testbed.cluster import cluster_spec, goodput_fraction
from testbed.cluster.spec import namespace_name, parse_namespace
from testbed.collectives.timing import groups_time
from testbed.errors import InputError
from testbed.topology.generators import hierarchical
from testbed.topology.io import load_topology
from testbed.topology.parts import DeviceSpec, Level, LinkKind

DEVICE = DeviceSpec(name="d", peak_flops={"fp32": 1e11}, memory_bytes=2**31, memory_bandwidth=5e10)


def _three_levels(attach: str = "switch"):
    return hierarchical([Level(name="node", size=2, bandwidth=1e9, latency=1e-6, kind=LinkKind.HOST),
                         Level(name="rack", size=3, bandwidth=1.25e9, latency=2e-6, kind=LinkKind.ETHERNET,
                               attach=attach),
                         Level(name="cluster", size=2, bandwidth=2.5e9, latency=3e-6, kind=LinkKind.ETHERNET,
                               attach="switch")], device=DEVICE, name="three")


def test_nodes_bridges_and_rates_of_two_levels():
    spec = cluster_spec(load_topology("eth-4x2"), name="t", scale=0.01)
    assert [n.devices for n in spec.nodes] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert len({n.address for n in spec.nodes}) == 4
    assert all(n.address.startswith("198.18.0.") for n in spec.nodes)
    assert spec.bridges == ("b0x0",)
    assert [l.lower for l in spec.links] == ["n0", "n1", "n2", "n3"]
    assert [l.rate_bps for l in spec.links] == [pytest.approx(100e9 * 0.01)] * 4  # 100 Gb/s scaled to 1 Gb/s


def test_a_bridge_per_switch_and_uplinks_between_levels():
    spec = cluster_spec(_three_levels(), name="t", scale=0.1)
    assert len(spec.nodes) == 6
    assert spec.bridges == ("b0x0", "b0x1", "b1x0")
    uplinks = [l for l in spec.links if l.level == "cluster"]
    assert [(l.lower, l.bridge) for l in uplinks] == [("b0x0", "b1x0"), ("b0x1", "b1x0")]
    assert all(l.rate_bps == pytest.approx(2.5e9 * 8 * 0.1) for l in uplinks)
    names = [l.lower_dev for l in spec.links] + [l.upper_dev for l in spec.links] + list(spec.bridges)
    assert all(len(n) <= 15 for n in names)  # Linux interface names
    assert len(set(l.upper_dev for l in spec.links)) == len(spec.links)


def test_attach_device_carries_the_nodes_nics_together():
    one = cluster_spec(_three_levels("switch"), name="t", scale=1.0)
    per_device = cluster_spec(_three_levels("device"), name="t", scale=1.0)
    rate = {l.level: l.rate_bps for l in one.links}
    assert {l.level: l.rate_bps for l in per_device.links}["rack"] == pytest.approx(2 * rate["rack"])


def test_rates_scale_linearly():
    topology = load_topology("eth-4x2")
    slow, fast = (cluster_spec(topology, name="t", scale=s) for s in (0.001, 0.01))
    assert fast.links[0].rate_bps == pytest.approx(10 * slow.links[0].rate_bps)


def test_goodput_is_tcp_payload_per_wire_byte():
    assert goodput_fraction(1500) == pytest.approx(1448 / 1514)
    assert goodput_fraction(1500) < goodput_fraction(9000) < 1


def test_emulated_topology_prices_the_shaped_goodput():
    spec = cluster_spec(load_topology("eth-4x2"), name="t", scale=0.001)
    emulated = spec.emulated_topology(inner_bandwidth=5e8, inner_latency_s=2e-6, hop_latency_s=1e-5, overhead_s=0.0)
    assert emulated.num_devices == 8
    net = emulated.levels[1]
    assert net.bandwidth == pytest.approx(100e6 / 8 * 1448 / 1514) and net.attach == "switch"
    group = [tuple(range(8))]
    big = groups_time(emulated, "all_reduce", group, 64 * 2**20, "ring")
    # A ring's bus bandwidth tends to its slowest link's: the shaped goodput.
    assert big.busbw == pytest.approx(net.bandwidth, rel=0.01)
    slower = cluster_spec(load_topology("eth-4x2"), name="t", scale=0.0001).emulated_topology(
        inner_bandwidth=5e8, inner_latency_s=2e-6, hop_latency_s=1e-5, overhead_s=0.0)
    assert groups_time(slower, "all_reduce", group, 64 * 2**20, "ring").time_s > big.time_s


def test_namespace_names_round_trip():
    name = namespace_name("smoke", "123x456", "n0")
    assert name.startswith("tbc-") and parse_namespace(name) == ("smoke", "123x456", "n0")
    assert parse_namespace("other-ns") is None


@pytest.mark.parametrize("topology, field", [("tpu-v5e-4x4", "topology"), ("host-cpu-8", "topology"),
                                             ("dgx-h100", "topology")])
def test_topologies_without_a_network_between_nodes_are_refused(topology, field):
    with pytest.raises(InputError) as err:
        cluster_spec(load_topology(topology), name="t", scale=0.01)
    assert err.value.field == field


@pytest.mark.parametrize("kwargs, field", [({"name": "Bad-Name"}, "name"), ({"scale": 0.0}, "scale"),
                                           ({"scale": float("nan")}, "scale"), ({"mtu": 100}, "mtu")])
def test_bad_input_names_the_field(kwargs, field):
    args = {"name": "t", "scale": 0.01, **kwargs}
    with pytest.raises(InputError) as err:
        cluster_spec(load_topology("eth-4x2"), **args)
    assert err.value.field == field


@pytest.mark.parametrize("extra, field", [
    (["--execute", "cluster"], "scale"),                                   # a throwaway cluster needs a scale
    (["--execute", "cluster:nosuch"], "execute"),                          # no such cluster is up
    (["--execute", "cluster", "--scale", "0.01", "--over", "node"], "over"),  # one collective over every device
    (["--execute", "cluster", "--scale", "-1"], "scale"),
])
def test_collective_on_a_cluster_refuses_bad_input_with_exit_2(extra, field, capsys, tmp_path, monkeypatch):
    from testbed.cli.main import main

    monkeypatch.setenv("TESTBED_CLUSTER_STATE", str(tmp_path))
    assert main(["collective", "all_reduce", "--topology", "eth-4x2", "--bytes", "64KiB", *extra]) == 2
    assert f"field `{field}`" in capsys.readouterr().err


def test_collective_on_a_cluster_times_only_reductions_and_gathers(capsys):
    from testbed.cli.main import main

    assert main(["collective", "broadcast", "--topology", "eth-4x2", "--execute", "cluster", "--scale", "0.01"]) == 2
    assert "all_reduce" in capsys.readouterr().err


def test_link_efficiency_scales_only_the_network_and_is_checked():
    spec = cluster_spec(load_topology("eth-4x2"), name="t", scale=0.001)
    kwargs = {"inner_bandwidth": 5e8, "inner_latency_s": 2e-6, "hop_latency_s": 1e-5}
    full, part = spec.emulated_topology(**kwargs), spec.emulated_topology(**kwargs, link_efficiency=0.8)
    assert part.levels[1].bandwidth == pytest.approx(0.8 * full.levels[1].bandwidth)
    assert part.levels[0].bandwidth == full.levels[0].bandwidth
    with pytest.raises(InputError):
        spec.emulated_topology(**kwargs, link_efficiency=1.5)


def test_the_bucket_is_two_frames_at_the_emulated_rates():
    """tbf's bucket banks a link's idle time: two frames at 10-100 Mb/s at any MTU (the link as it is), 0.1 ms of the
    rate only where that is more (the links set unshaped, 10 Gb/s: 125 kB, not a timer per two frames)."""
    from testbed.cluster.netns import bucket_bytes

    assert [bucket_bytes(r, 1500) for r in (1e7, 3e7, 1e8)] == [3028] * 3
    assert bucket_bytes(1e8, 9000) == 2 * 9014
    assert bucket_bytes(1e10, 1500) == 125_000
