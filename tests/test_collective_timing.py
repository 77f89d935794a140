"""Collective timing on topologies: lower bounds, monotonicity, published formulas, closed forms."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings, strategies as st

from testbed.topology import generators
from testbed.collectives.algorithms import GRID_ALGORITHMS, NCCL_ALGORITHMS, SUPPORTED_OPS, step_program
from testbed.collectives.routed import group_grid
from testbed.collectives.closed_form import closed_form_time, symmetry
from testbed.collectives.timing import (applicable_algorithms, collective_time, groups_time, link_loads,
                                       program_time, send_time)
from testbed.collectives.ops import OPS, Op
from testbed.errors import InputError
from testbed.topology import Calibration, CollectiveCalibration, DeviceSpec, Level, LinkKind
from testbed.topology.io import load_topology

DEVICE = DeviceSpec(name="d", peak_flops={"fp32": 1e12}, memory_bytes=1e9, memory_bandwidth=1e11)
COLLECTIVE_OPS = [op for op in OPS if op != "send"]

CASES = [("dgx-h100", "node"), ("dgx-h100-x4", "all"), ("dgx-h100-x4", "node"), ("tpu-v5e-4x4", "all"),
         ("tpu-v5e-4x4", "x"), ("tpu-v5p-2x4x4", "y,z"), ("eth-100g-8", "all"), ("a100-pcie-8", "all")]


@pytest.fixture(scope="module")
def topologies():
    return {name: load_topology(name) for name in {c[0] for c in CASES}}


def _case_groups(topologies, name, over):
    topology = topologies[name]
    return topology, topology.groups(over)


@pytest.mark.parametrize("name,over", CASES)
def test_no_algorithm_beats_the_lower_bound(topologies, name, over):
    topology, groups = _case_groups(topologies, name, over)
    for op in COLLECTIVE_OPS:
        for algorithm in applicable_algorithms(topology, op, groups[0]):
            for nbytes in (1.0, 3e5, 2.0**30):
                t = groups_time(topology, op, groups, nbytes, algorithm)
                assert t.bound_s > 0
                assert t.time_s >= t.bound_s * (1 - 1e-12), (name, over, op, algorithm, nbytes)


@pytest.mark.parametrize("name,over", CASES)
def test_time_grows_with_bytes_and_shrinks_with_bandwidth(topologies, name, over):
    topology, groups = _case_groups(topologies, name, over)
    faster = topology.with_bandwidth_scaled(2)
    sizes = [2.0**k for k in range(0, 34, 3)]
    for op in ("all_reduce", "all_gather", "all_to_all"):
        for algorithm in applicable_algorithms(topology, op, groups[0]):
            times = [groups_time(topology, op, groups, s, algorithm).time_s for s in sizes]
            assert all(a <= b for a, b in zip(times, times[1:])), (op, algorithm, times)
            for s, slow in zip(sizes, times):
                assert groups_time(faster, op, groups, s, algorithm).time_s <= slow


@pytest.mark.parametrize("name,over", CASES)
def test_tiny_messages_are_latency_dominated(topologies, name, over):
    topology, groups = _case_groups(topologies, name, over)
    t = groups_time(topology, "all_reduce", groups, 8.0)
    latency_only = groups_time(topology, "all_reduce", groups, 1e-9, t.algorithm)
    assert latency_only.time_s > 0
    assert t.time_s == pytest.approx(latency_only.time_s, rel=1e-3)
    big = groups_time(topology, "all_reduce", groups, 2.0**32, t.algorithm)
    assert big.time_s > 10 * t.time_s


@given(n=st.integers(2, 12), bandwidth=st.floats(1e9, 1e12), latency=st.floats(0, 1e-5),
       nbytes=st.floats(1.0, 1e10))
def test_ring_all_reduce_matches_the_textbook_formula(n, bandwidth, latency, nbytes):
    ring = generators.ring(n, device=DEVICE, bandwidth=bandwidth, latency=latency)
    group = tuple(range(n))
    want = 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency
    fast = collective_time(ring, "all_reduce", group, nbytes, "ring")
    routed, rounds = program_time(ring, "all_reduce", "ring", [group], nbytes)
    assert rounds == 2 * (n - 1)
    assert routed == pytest.approx(want, rel=1e-9)
    assert fast.time_s == pytest.approx(want, rel=1e-9)
    bidir, _ = program_time(ring, "all_reduce", "bidir_ring", [group], nbytes)
    if n > 2:  # two ranks share one link each way, so there is nothing to halve
        assert bidir == pytest.approx(want - (n - 1) / n * nbytes / bandwidth, rel=1e-9)


def test_torus_all_gather_slower_without_wraparound():
    open_, closed = (generators.torus([4, 4], device=DEVICE, bandwidth=5e10, latency=1e-6, wraparound=w)
                     for w in (False, True))
    for algorithm in ("torus", "ring", "bidir_ring"):
        slow = collective_time(open_, "all_gather", tuple(range(16)), 2.0**28, algorithm)
        fast = collective_time(closed, "all_gather", tuple(range(16)), 2.0**28, algorithm)
        assert slow.time_s > fast.time_s, algorithm


def _symmetric_cases():
    switch = generators.hierarchical(
        [Level(name="node", size=8, bandwidth=4.5e11, latency=1e-6, kind=LinkKind.NVSWITCH),
         Level(name="cluster", size=4, bandwidth=5e10, latency=3e-6, kind=LinkKind.INFINIBAND)],
        device=DEVICE, calibration=Calibration(collectives=CollectiveCalibration(overhead_s=5e-6)))
    ring = generators.ring(7, device=DEVICE, bandwidth=1e11, latency=2e-6,
                           calibration=Calibration(collectives=CollectiveCalibration(overhead_s=1e-6)))
    return [(switch, tuple(range(8))), (switch, tuple(range(5))), (switch, (3, 11, 19, 27)),
            (switch, (0, 8, 16)), (ring, tuple(range(7)))]


@pytest.mark.parametrize("index", range(5))
def test_closed_form_agrees_with_routed_program(index):
    topology, group = _symmetric_cases()[index]
    assert symmetry(topology, group) is not None
    covered = 0
    for op in OPS:
        for algorithm in applicable_algorithms(topology, op, group):
            for nbytes in (64.0, 2.0**20, 2.0**31):
                closed = closed_form_time(topology, op, algorithm, group, nbytes)
                if closed is None:
                    continue
                covered += 1
                routed, rounds = program_time(topology, op, algorithm, [group], nbytes)
                assert closed[1] == rounds, (op, algorithm)
                assert closed[0] == pytest.approx(routed, rel=0.02), (op, algorithm, nbytes)
    assert covered >= 3 * (6 if topology.form == "torus" else 12)


def test_asymmetric_groups_have_no_closed_form():
    topology = _symmetric_cases()[0][0]
    assert symmetry(topology, (0, 1, 8)) is None  # two share a node switch, one does not
    assert closed_form_time(topology, "all_reduce", "ring", tuple(range(32)), 1e6) is None


def test_memoized_results_equal_fresh_ones():
    a = load_topology("dgx-h100-x4")
    b = load_topology("dgx-h100-x4")
    group = tuple(range(32))
    first = collective_time(a, "all_reduce", group, 1e8)
    again = collective_time(a, "all_reduce", group, 1e8)
    assert again is first
    assert collective_time(b, "all_reduce", group, 1e8) == first
    assert groups_time(b, "all_reduce", [group], 1e8, use_closed_form=False).time_s == pytest.approx(first.time_s)


def test_auto_picks_the_fastest_applicable(topologies):
    topology = topologies["dgx-h100-x4"]
    group = tuple(range(32))
    auto = collective_time(topology, "all_reduce", group, 2.0**30)
    times = {a: collective_time(topology, "all_reduce", group, 2.0**30, a).time_s
             for a in applicable_algorithms(topology, "all_reduce", group)}
    nccl = {a: t for a, t in times.items() if a in NCCL_ALGORITHMS}
    # NCCL runs it: the algorithm its own model picks (NVLS inside the node, tree across the 50 GB/s NICs),
    # timed with the measured multi-node shortfall (which may make another of its algorithms faster).
    assert auto.algorithm == "nvls_tree" and auto.time_s == nccl["nvls_tree"]
    assert auto.time_s < min(t for a, t in times.items() if a not in NCCL_ALGORITHMS)
    generic = dataclasses.replace(topology, device=DEVICE)  # not an NVIDIA GPU: the routed programs
    auto = collective_time(generic, "all_reduce", group, 2.0**30)
    assert auto.algorithm == "hierarchical"  # NVSwitch inside, 50 GB/s NICs across
    assert auto.time_s == min(collective_time(generic, "all_reduce", group, 2.0**30, a).time_s
                              for a in applicable_algorithms(generic, "all_reduce", group))


def test_bus_bandwidth_is_plausible_on_dgx(topologies):
    node = collective_time(topologies["dgx-h100"], "all_reduce", tuple(range(8)), 2.0**30)
    assert node.algorithm == "nvls"
    assert 4.3e11 < node.busbw <= 5.3e11  # published ~480 GB/s (NVIDIA/nccl-tests#212)
    assert node.busbw == pytest.approx(node.algbw * 2 * 7 / 8)
    cluster = groups_time(topologies["dgx-h100-x4"], "all_reduce", [tuple(range(32))], 2.0**30)
    assert 5e10 < cluster.busbw < node.busbw


def test_concurrent_groups_share_links_and_report_the_slowest(topologies):
    topology = topologies["dgx-h100-x4"]
    nodes = topology.groups("node")
    assert len(nodes) == 4
    alone = groups_time(topology, "all_reduce", nodes[:1], 2.0**26, "ring", use_closed_form=False)
    together = groups_time(topology, "all_reduce", nodes, 2.0**26, "ring")
    assert together.groups == 4 and together.time_s == pytest.approx(alone.time_s)
    # Lines along y of a 4x4 mesh route over disjoint links; rings across x then share the wrap path.
    mesh = topologies["tpu-v5e-4x4"]
    rows = mesh.groups("x")
    one = groups_time(mesh, "all_reduce", rows[:1], 2.0**24, "ring")
    every = groups_time(mesh, "all_reduce", rows, 2.0**24, "ring")
    assert every.time_s >= one.time_s


def test_link_loads_conserve_bytes(topologies):
    topology = topologies["dgx-h100"]
    group = tuple(range(8))
    nbytes = 2.0**24
    for algorithm in applicable_algorithms(topology, "all_reduce", group):
        loads = link_loads(topology, "all_reduce", group, nbytes, algorithm)
        if algorithm in NCCL_ALGORITHMS:  # NCCL's traffic per GPU, symmetric, at least the injection bound
            ups = [loads[(device, "node0")] for device in group]
            assert min(ups) == pytest.approx(max(ups)) and ups[0] >= 7 / 8 * nbytes * (1 - 1e-12)
            assert loads[("node0", 0)] == pytest.approx(ups[0])
            continue
        program = step_program("all_reduce", algorithm, 8)
        sent = program.chunk_bytes(nbytes) * sum(t.src != t.dst for r in program.rounds for t in r)
        out_of_devices = sum(v for (u, _), v in loads.items() if isinstance(u, int))
        into_devices = sum(v for (_, w), v in loads.items() if isinstance(w, int))
        assert out_of_devices == pytest.approx(sent) and into_devices == pytest.approx(sent)
        # Every rank must send at least (n-1)/n of the buffer.
        for device in group:
            assert loads[(device, "node0")] >= 7 / 8 * nbytes * (1 - 1e-12)


def test_send_time_is_latency_plus_bottleneck(topologies):
    topology = topologies["dgx-h100-x4"]
    t = send_time(topology, 0, 9, 1e9)
    assert t == pytest.approx(2 * 3e-6 + 1e9 / 5e10 + topology.calibration.collectives.overhead_s)
    assert send_time(topology, 3, 3, 1e9) == 0.0
    assert collective_time(topology, "send", (0, 9), 1e9).time_s == pytest.approx(t)


def test_inapplicable_algorithms_say_which_apply(topologies):
    with pytest.raises(InputError, match="algorithms that apply: ring"):
        collective_time(topologies["dgx-h100"], "all_reduce", tuple(range(8)), 1e6, "torus")
    with pytest.raises(InputError, match="does not implement all_to_all"):
        collective_time(topologies["dgx-h100"], "all_to_all", tuple(range(8)), 1e6, "ring")
    assert "torus" in applicable_algorithms(topologies["tpu-v5e-4x4"], "all_reduce", tuple(range(16)))
    assert "hierarchical" not in applicable_algorithms(topologies["dgx-h100"], "all_reduce", tuple(range(8)))
    torus_group = tuple(range(16))
    assert "direct" not in applicable_algorithms(topologies["tpu-v5e-4x4"], "all_reduce", torus_group)
    assert "direct" in applicable_algorithms(topologies["tpu-v5e-4x4"], "all_to_all", torus_group)
    for algorithm, ops in SUPPORTED_OPS.items():
        assert ops and all(isinstance(op, Op) for op in ops)


@settings(max_examples=max(1, settings().max_examples * 2 // 3))  # the profile's share: ci 10, thorough 200
@given(op=st.sampled_from(COLLECTIVE_OPS), n=st.integers(2, 9), nbytes=st.floats(1.0, 1e10),
       seed=st.integers(0, 10**6))
def test_bound_holds_on_random_groups_of_a_cluster(op, n, nbytes, seed):
    import random

    topology = load_topology("dgx-h100-x4")
    group = tuple(random.Random(seed).sample(range(32), n))
    for algorithm in applicable_algorithms(topology, op, group):
        t = collective_time(topology, op, group, nbytes, algorithm)
        assert t.time_s >= t.bound_s * (1 - 1e-12) and math.isfinite(t.time_s)


def test_bounds_are_the_expected_cuts(topologies):
    ring = generators.ring(8, device=DEVICE, bandwidth=1e10)
    nbytes = 2.0**30
    # Bisection of a ring: two links each way, S / (2B) -- but only ranks add on a torus, so together they send
    # every element 2(n-1) times (one-way gossip) over 2B each: 2 * 7/8 * S / (2B), what a bidirectional ring takes.
    ring_bound = collective_time(ring, "all_reduce", tuple(range(8)), nbytes, "bidir_ring")
    assert ring_bound.bound_s == pytest.approx(7 / 8 * nbytes / 1e10)
    assert ring_bound.time_s == pytest.approx(ring_bound.bound_s, rel=1e-3)  # the bound is reached
    # All-gather: each rank receives 7/8 * S over its two links.
    assert collective_time(ring, "all_gather", tuple(range(8)), nbytes).bound_s == pytest.approx(7 / 8 * nbytes / 2e10)
    # Across DGX nodes: each node's 8 NICs at 50 GB/s carry the whole buffer in.
    cluster = collective_time(topologies["dgx-h100-x4"], "all_reduce", tuple(range(32)), nbytes)
    assert cluster.bound_s == pytest.approx(nbytes / (8 * 5e10))
    # Inside one node only injection limits: (n-1)/n * S over 450 + 50 GB/s of links.
    node = collective_time(topologies["dgx-h100-x4"], "all_reduce", tuple(range(8)), nbytes)
    assert node.bound_s == pytest.approx(7 / 8 * nbytes / 5e11)


def test_routed_programs_too_large_to_time_are_refused_at_once() -> None:
    """A 16,384-rank ring would be 1e9 routed transfers (minutes, gigabytes): refused before it is built."""
    from testbed.collectives.routed import MAX_ROUTED_TRANSFERS, routed_transfers
    from testbed.topology import DeviceSpec, generators

    topo = generators.torus([32, 32, 16], device=DeviceSpec(name="chip", peak_flops={"bf16": 1e14},
                                                            memory_bytes=1 << 34, memory_bandwidth=1e12),
                            bandwidth=9e10, latency=1e-6)
    group = tuple(range(topo.num_devices))
    assert routed_transfers(topo, "ring", group) > MAX_ROUTED_TRANSFERS
    with pytest.raises(InputError, match="routed step program of about"):
        collective_time(topo, "all_reduce", group, 1 << 30, "ring")


# -- tori: the all-dims algorithm, closed forms on sub-tori, scale -----------------------------

TORUS_CAL = Calibration(collectives=CollectiveCalibration(overhead_s=2e-6))


def _torus(dims, wraparound=True):
    return generators.torus(list(dims), device=DEVICE, bandwidth=5e10, latency=1e-6, wraparound=wraparound,
                            calibration=TORUS_CAL)


@pytest.mark.parametrize("dims", [(2, 2, 2), (4, 4), (3, 4), (4, 4, 4), (5,), (4, 2, 3)])
def test_torus_closed_forms_equal_the_routed_programs(dims):
    """torus, multidim (and rings on one line) over a whole torus: formula == routed program, time and links."""
    from testbed.collectives.torus import torus_link_loads

    topology = _torus(dims)
    group = tuple(range(topology.num_devices))
    covered = 0
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        for algorithm in applicable_algorithms(topology, op, group):
            closed = closed_form_time(topology, op, algorithm, group, 1.0)
            if closed is None:
                continue
            covered += 1
            for nbytes in (64.0, 2.0**20, 2.0**31):
                time_s, rounds = closed_form_time(topology, op, algorithm, group, nbytes)
                routed, routed_rounds = program_time(topology, op, algorithm, [group], nbytes)
                assert rounds == routed_rounds, (op, algorithm)
                assert time_s == pytest.approx(routed, rel=1e-9), (op, algorithm, nbytes)
            closed_loads = torus_link_loads(topology, op, algorithm, group, 1e6)
            routed_loads = {k: v for k, v in link_loads(topology, op, group, 1e6, algorithm).items()}
            assert closed_loads.keys() == routed_loads.keys()
            assert all(closed_loads[k] == pytest.approx(routed_loads[k], rel=1e-12) for k in routed_loads)
    assert covered >= 3 * (3 if len(dims) == 1 else 2)


@pytest.mark.parametrize("dims", [(2, 2, 2), (4, 4), (3, 4), (4, 4, 4), (4, 4, 2)])
def test_no_torus_algorithm_beats_the_bound(dims):
    for wraparound in (True, False):
        topology = _torus(dims, wraparound)
        group = tuple(range(topology.num_devices))
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            for algorithm in applicable_algorithms(topology, op, group):
                for nbytes in (1.0, 3e5, 2.0**30):
                    t = collective_time(topology, op, group, nbytes, algorithm)
                    assert t.time_s >= t.bound_s * (1 - 1e-12), (dims, wraparound, op, algorithm, nbytes)


def test_multidim_all_reduce_lands_near_the_bound_on_a_cube():
    """TPU v4 4x4x4, 256 MiB: every link direction busy, within 4% of the bound (dim-ordered torus: 3x)."""
    topology = load_topology("tpu-v4-4x4x4")
    group = tuple(range(64))
    best = collective_time(topology, "all_reduce", group, 2.0**28)
    assert best.algorithm == "multidim" and best.closed_form
    assert best.time_s <= 1.04 * best.bound_s
    dim_ordered = collective_time(topology, "all_reduce", group, 2.0**28, "torus")
    assert dim_ordered.time_s > 2.5 * best.time_s


def test_sub_tori_are_recognised_and_disjoint_ones_timed_together():
    from testbed.collectives.torus import disjoint_sub_tori, sub_torus

    topology = _torus((4, 4, 3))
    planes = topology.groups("x,y")  # three whole 4x4 sub-tori, one per z
    assert all(sub_torus(topology, g) is not None for g in planes)
    assert disjoint_sub_tori(topology, planes)
    assert sub_torus(topology, (0, 1, 2)) is None  # part of a line
    assert sub_torus(_torus((4, 4), wraparound=False), tuple(range(16))) is None  # no wraparound
    assert sub_torus(topology, (1, 0, 2, 3)) is None  # ranks out of device order
    for algorithm in ("torus", "multidim"):
        together = groups_time(topology, "all_reduce", planes, 2.0**24, algorithm)
        routed, _ = program_time(topology, "all_reduce", algorithm, planes, 2.0**24)
        assert together.closed_form and together.time_s == pytest.approx(routed, rel=1e-9)


def test_a_16k_rank_all_reduce_is_timed_without_routing(monkeypatch):
    """16x16x16 and 32x32x16 tori: auto times every algorithm that applies by formula, never routing or
    building a program (the routed path raises), and refuses the routed ones by their estimated size."""
    from testbed.collectives import routed, timing

    def refuse(*args, **kwargs):
        raise AssertionError("routed or built a program")

    monkeypatch.setattr(timing, "_cached_profile", refuse)
    monkeypatch.setattr(routed, "step_program", refuse)
    monkeypatch.setattr(timing, "placed_program", refuse)
    for dims in ((16, 16, 16), (32, 32, 16)):
        topology = _torus(dims)
        group = tuple(range(topology.num_devices))
        able = applicable_algorithms(topology, "all_reduce", group)
        assert set(able) == {"torus", "multidim"}  # rings, trees, halving-doubling: too large to route
        best = collective_time(topology, "all_reduce", group, 2.0**30)
        assert best.algorithm == "multidim" and best.closed_form
        assert best.bound_s <= best.time_s < 2 * best.bound_s
        with pytest.raises(InputError, match="transfer-hops"):
            collective_time(topology, "all_reduce", group, 2.0**30, "double_binary_tree")


def _torus_plan(data=1, fsdp=1, tensor=1, stage=1):
    from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec

    return Plan(model=ModelSpec(layers=4, d_model=64, heads=4, d_ff=128, seq_len=16, vocab=64),
                batch=BatchSpec(global_batch=data * fsdp * 4, microbatches=4),
                mesh=MeshSpec(data=data, fsdp=fsdp, tensor=tensor, stage=stage), schedule=ScheduleSpec(name="1f1b"),
                precision="fp32")


@pytest.mark.parametrize("dims,mesh", [((8, 2, 2), dict(data=4, fsdp=4, tensor=2)),
                                       ((4, 4, 4), dict(data=4, fsdp=2, tensor=2, stage=4))])
def test_torus_translation_symmetry_is_exact(monkeypatch, dims, mesh):
    """Plans on tori whose links are contended (fsdp groups interleaved on the x lines, 0.1 GB/s): pricing
    one group at the origin and counting only the groups sharing the representative's fixed coordinates
    gives the step that checking every group as it is gives (shifting loads wrongly, or dropping a
    contending group, changes it by 10-80%)."""
    from testbed.collectives import torus
    from testbed.sim.graph.engine import simulate

    device = DeviceSpec(name="d", peak_flops={"fp32": 1e12}, memory_bytes=1e9, memory_bandwidth=1e11)

    def topology():
        return generators.torus(list(dims), device=device, bandwidth=1e8, latency=1e-6, calibration=TORUS_CAL)

    fast = simulate(_torus_plan(**mesh), topology()).report.step_time_s
    monkeypatch.setattr(torus, "translatable", lambda topology: False)
    assert fast == pytest.approx(simulate(_torus_plan(**mesh), topology()).report.step_time_s, rel=1e-9)


def test_data_parallel_on_a_whole_torus_simulates_without_routing(monkeypatch):
    """4,096 data-parallel replicas on a 16x16x16 torus: the gradient all-reduce is one whole-torus group,
    timed and loaded by formula (the routed path raises; trees and rings are too large to try)."""
    from testbed.collectives import routed, timing
    from testbed.sim.graph.engine import simulate

    def refuse(*args, **kwargs):
        raise AssertionError("routed or built a program")

    monkeypatch.setattr(timing, "_cached_profile", refuse)
    monkeypatch.setattr(routed, "step_program", refuse)
    topology = _torus((16, 16, 16))
    sim = simulate(_torus_plan(data=4096), topology)
    assert sim.report.step_time_s > 0 and sim.report.exposed_comm_s > 0


def _hierarchy(*levels):
    return generators.hierarchical([Level(name=name, size=size, bandwidth=bw, latency=lat, kind=LinkKind.ETHERNET,
                                          attach=attach) for name, size, bw, lat, attach in levels],
                                   device=DEVICE, calibration=TORUS_CAL)


HIERARCHIES = [
    (("node", 4, 4e11, 1e-6, "device"), ("cluster", 4, 5e10, 3e-6, "device")),
    (("node", 4, 4e11, 1e-6, "device"), ("cluster", 3, 5e10, 3e-6, "switch")),
    (("node", 2, 4e11, 1e-6, "device"), ("rack", 3, 1e11, 2e-6, "switch"), ("cluster", 2, 5e10, 3e-6, "switch")),
    (("node", 2, 4e11, 1e-6, "device"), ("rack", 3, 1e11, 2e-6, "device"), ("cluster", 2, 5e10, 3e-6, "switch")),
    (("node", 3, 4e11, 1e-6, "device"), ("rack", 1, 1e11, 2e-6, "switch"), ("cluster", 2, 5e10, 3e-6, "switch")),
]


@pytest.mark.parametrize("index", range(len(HIERARCHIES)))
def test_hierarchical_closed_form_equals_the_routed_program(index):
    """Every device under one switch (the whole hierarchy, or one rack): formula == routed, time and links."""
    from testbed.collectives import timing
    from testbed.collectives.hierarchy import hierarchical_link_loads, under_one_switch

    topology = _hierarchy(*HIERARCHIES[index])
    inner = topology.levels[0].size * topology.levels[1].size
    candidates = [tuple(range(topology.num_devices))]
    if 2 * inner <= topology.num_devices:
        candidates.append(tuple(range(inner, 2 * inner)))  # the second rack
    groups = [g for g in candidates if under_one_switch(topology, g) is not None]
    assert groups
    for group in groups:
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            for nbytes in (64.0, 2.0**30):
                closed = closed_form_time(topology, op, "hierarchical", group, nbytes)
                routed, rounds = program_time(topology, op, "hierarchical", [group], nbytes)
                assert closed[1] == rounds and closed[0] == pytest.approx(routed, rel=1e-9), (op, nbytes)
            closed_loads = hierarchical_link_loads(topology, op, group, 1e6)
            chunks, _, totals, _ = timing._cached_profile(topology, Op(op), "hierarchical", (group,), 0, 1)
            routed_loads = {link: c * 1e6 / chunks for link, c in totals.items()}
            assert closed_loads.keys() == routed_loads.keys()
            assert all(closed_loads[k] == pytest.approx(routed_loads[k], rel=1e-12) for k in routed_loads)


def test_a_16k_device_hierarchy_is_timed_without_routing(monkeypatch):
    """16,384 devices, 8 per node on a switch, nodes on Ethernet, not an NVIDIA GPU: the all-reduce and a
    data-parallel step use the hierarchical closed form (the routed path raises)."""
    from testbed.collectives import routed, timing
    from testbed.sim.graph.engine import simulate

    def refuse(*args, **kwargs):
        raise AssertionError("routed or built a program")

    monkeypatch.setattr(timing, "_cached_profile", refuse)
    monkeypatch.setattr(routed, "step_program", refuse)
    topology = _hierarchy(("node", 8, 1e11, 1e-6, "device"), ("cluster", 2048, 1.25e10, 5e-6, "switch"))
    group = tuple(range(topology.num_devices))
    best = collective_time(topology, "all_reduce", group, 2.0**30)
    assert best.algorithm == "hierarchical" and best.closed_form and best.time_s >= best.bound_s
    assert simulate(_torus_plan(data=16384), topology).report.exposed_comm_s > 0


@pytest.mark.parametrize("name,over", [("tpu-v5e-4x4", "x"), ("tpu-v5e-4x4", "y"), ("tpu-v5p-2x4x4", "y,z"),
                                       ("three-level", "node"), ("three-level", "rack")])
def test_parallel_copies_take_one_groups_time(name, over):
    """Groups that are translates on disjoint links (torus lines or planes, one per switch of a hierarchy) are
    timed as one representative group, and that equals routing them all together."""
    from testbed.collectives.routed import parallel_copies

    if name == "three-level":
        topology = _hierarchy(("node", 4, 1e11, 1e-6, "device"), ("rack", 3, 5e10, 2e-6, "switch"),
                              ("cluster", 2, 1e10, 5e-6, "switch"))
    else:
        topology = load_topology(name)
    groups = topology.groups(over)
    assert len(groups) > 1 and parallel_copies(topology, groups)
    for op in ("all_reduce", "all_gather"):
        for algorithm in applicable_algorithms(topology, op, groups[0]):
            together = groups_time(topology, op, groups, 2.0**26, algorithm, use_closed_form=False)
            routed, _ = program_time(topology, op, algorithm, groups, 2.0**26)
            c = topology.calibration.collectives  # groups_time adds a collective's own cost to its program's
            routed += c.launch_s + c.rendezvous_s * (len(groups[0]) - 1)
            assert together.groups == len(groups)
            assert together.time_s == pytest.approx(routed, rel=1e-9), (op, algorithm)
    assert not parallel_copies(load_topology("tpu-v5e-4x4"), [(0, 2), (1, 3)])  # 0 -> 2 crosses 1's link


def test_many_small_groups_of_a_16k_hierarchy_are_one_group(monkeypatch):
    """--over node on 2,048 nodes: every algorithm that applies is timed once, on one node, without routing
    2,048 groups (the 8-rank program is routed once at most)."""
    from testbed.collectives import routed

    calls = []
    original = routed.place_program
    monkeypatch.setattr(routed, "place_program", lambda *a, **k: calls.append(a[3]) or original(*a, **k))
    topology = _hierarchy(("node", 8, 1e11, 1e-6, "device"), ("cluster", 2048, 1.25e10, 5e-6, "switch"))
    groups = topology.groups("node")
    for algorithm in applicable_algorithms(topology, "all_reduce", groups[0]):
        assert groups_time(topology, "all_reduce", groups, 2.0**30, algorithm).groups == 2048
    assert all(group == groups[0] for group in calls)


@pytest.mark.parametrize("name,over", CASES + [("host-cpu-8", "all")])
def test_rendezvous_adds_its_cost_per_rank_beyond_the_first_to_every_algorithm(topologies, name, over):
    """``collectives.rendezvous_s`` is per collective and per participant beyond the first, whatever the
    algorithm (routed, closed form, NCCL's); a send has none."""
    topology = topologies.get(name) or load_topology(name)
    r = 3.7e-5
    with_r = dataclasses.replace(topology, calibration=topology.calibration.updated(collectives={"rendezvous_s": r}))
    groups = topology.groups(over)
    n = len(groups[0])
    for op in COLLECTIVE_OPS:
        for algorithm in applicable_algorithms(topology, op, groups[0]):
            for nbytes in (4096.0, 2.0 ** 24):
                plain = groups_time(topology, op, groups, nbytes, algorithm).time_s
                assert groups_time(with_r, op, groups, nbytes, algorithm).time_s == pytest.approx(
                    plain + r * (n - 1), rel=1e-12, abs=1e-15)
    assert send_time(with_r, 0, 1, 4096.0) == send_time(topology, 0, 1, 4096.0)
    with pytest.raises(InputError, match=r"calibration\.collectives\.rendezvous_s"):
        CollectiveCalibration(rendezvous_s=-1e-6)


@pytest.mark.parametrize("name,over", [("tpu-v5e-4x4", "x"), ("tpu-v5e-8x4", "y")])
def test_launch_is_paid_once_per_collective_and_per_send_whatever_the_rounds(name, over):
    """``collectives.launch_s`` adds once to every algorithm's time (however many rounds) and to a send."""
    topology = load_topology(name)
    zero = dataclasses.replace(topology, calibration=topology.calibration.updated(collectives={"launch_s": 0.0}))
    launch = topology.calibration.collectives.launch_s
    assert launch > 0
    group = topology.groups(over)[0]
    for op in COLLECTIVE_OPS:
        for algorithm in applicable_algorithms(topology, op, group):
            with_launch = groups_time(topology, op, [group], 2.0 ** 20, algorithm)
            assert with_launch.rounds >= 1
            assert with_launch.time_s == pytest.approx(
                groups_time(zero, op, [group], 2.0 ** 20, algorithm).time_s + launch, rel=1e-12)
    assert send_time(topology, 0, 1, 4096.0) == pytest.approx(send_time(zero, 0, 1, 4096.0) + launch)
    with pytest.raises(InputError, match=r"calibration\.collectives\.launch_s"):
        CollectiveCalibration(launch_s=-1e-6)


def test_an_open_ici_line_all_gathers_both_ways_without_a_wrap_step():
    # TPU v5e 8x4: Y (4 chips) has no wraparound. Every ring-family program pays for a wrap step across the
    # whole line and halving-doubling puts two flows on the middle link; `line` moves one block per link
    # and direction a round: 4 us launch + 3 rounds of (1 us hop + 32 KiB at 45 GB/s).
    topology = load_topology("tpu-v5e-8x4")
    group = (0, 8, 16, 24)
    assert "line" in applicable_algorithms(topology, "all_gather", group)
    line = collective_time(topology, "all_gather", group, 2.0**17, "line")
    assert line.time_s == pytest.approx(4e-6 + 3 * (1e-6 + 2**15 / 45e9), rel=1e-6)
    picked = collective_time(topology, "all_gather", group, 2.0**17)
    assert picked.algorithm == "line"
    assert picked.time_s < collective_time(topology, "all_gather", group, 2.0**17, "halving_doubling").time_s


@pytest.mark.parametrize("group", [tuple(range(8)), (0, 2, 4, 6)])
def test_gloo_rings_hide_a_rounds_host_cost_under_its_wire(group):
    """Where gloo runs (``eth-4x2``: CPU hosts across Ethernet) its rings keep a second segment on the wire while
    the host works: each round lasts the longer of ``collectives.overhead_s`` and its wire, not the sum; other
    algorithms and topologies still add the two. One device a node is a closed form, every device a routed
    program: both priced alike."""
    from testbed.collectives.gloo import gloo_pipelined

    base = load_topology("eth-4x2")

    def with_overhead(topology, overhead, overlap=True):
        return dataclasses.replace(topology, calibration=topology.calibration.updated(
            collectives={"overhead_s": overhead, "launch_s": 0.0, "rendezvous_s": 0.0, "rounds_overlap": overlap}))

    bare, slow, summed = with_overhead(base, 0.0), with_overhead(base, 1e-3), with_overhead(base, 1e-3, False)
    # Only a calibration fitted in that form says so (calibrate --cluster); a linear fit's rounds stay added.
    assert not gloo_pipelined(base, "all_reduce", "ring") and not gloo_pipelined(summed, "all_reduce", "ring")
    for op, rounds in (("all_reduce", 2 * (len(group) - 1)), ("all_gather", len(group) - 1)):
        assert gloo_pipelined(slow, op, "ring") and not gloo_pipelined(slow, op, "hierarchical")
        for nbytes in (4096.0, 2.0 ** 30):
            wire = groups_time(bare, op, [group], nbytes, "ring")
            timed = groups_time(slow, op, [group], nbytes, "ring")
            assert timed.rounds == wire.rounds == rounds
            assert timed.time_s == pytest.approx(rounds * max(1e-3, wire.time_s / rounds), rel=1e-9)
            assert groups_time(summed, op, [group], nbytes, "ring").time_s == pytest.approx(
                wire.time_s + rounds * 1e-3, rel=1e-9)
        # A round's wire far over its host cost: the host cost is hidden whole.
        assert groups_time(slow, op, [group], 2.0 ** 30, "ring").time_s == pytest.approx(
            groups_time(bare, op, [group], 2.0 ** 30, "ring").time_s, rel=1e-9)
    assert not gloo_pipelined(slow, "reduce_scatter", "halving_doubling")
    # NVLink GPUs (NCCL) and a lone CPU host: rounds still add their host cost, whatever the flag.
    for name in ("eth-100g-8", "host-cpu-8"):
        assert not gloo_pipelined(with_overhead(load_topology(name), 1e-3), "all_reduce", "ring")
    # The flag travels through a topology file, and is refused when not true or false.
    from testbed.topology.io import dump_topology, topology_from_text

    assert topology_from_text("t", dump_topology(slow)).calibration.collectives.rounds_overlap is True
    with pytest.raises(InputError, match="rounds_overlap"):
        CollectiveCalibration(rounds_overlap="yes")


def test_groups_of_which_one_is_no_grid_are_timed_by_programs_that_fit_every_group() -> None:
    """On a torus a group along one dimension is a grid and a group across a row's end is not: the automatic pick
    times them together with programs every group can run (a grid program needs every group a grid), not a grid
    program it cannot lay out (a TypeError; a search on a v4 slice of 384 chips meets such groups)."""
    torus = load_topology("tpu-v4-4x4x4")
    along, across = (0, 1, 2, 3), (3, 4, 5, 6)
    assert group_grid(torus, along) is not None and group_grid(torus, across) is None
    timed = groups_time(torus, "all_gather", (along, across), 1e6)
    assert timed.time_s > 0 and timed.algorithm not in GRID_ALGORITHMS and timed.groups == 2
