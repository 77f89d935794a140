"""NCCL's model of collectives on GPU hierarchies: declared in-network reduction, bounds, monotone bandwidth."""

from __future__ import annotations

import pytest

from testbed.collectives.bounds import lower_bound
from testbed.collectives.timing import applicable_algorithms, collective_time
from testbed.errors import InputError
from testbed.topology import Level, LinkKind
from testbed.topology.io import load_topology, topology_from_dict


@pytest.fixture(scope="module")
def h100():
    return load_topology("dgx-h100-x4")


def test_in_network_reduction_is_validated_and_round_trips():
    with pytest.raises(InputError, match="in_network_reduction"):
        Level(name="node", size=8, bandwidth=1e9, kind=LinkKind.INFINIBAND, in_network_reduction="nvls")
    with pytest.raises(InputError):
        topology_from_dict({"device": {"flops": {"bf16": 1e12}, "memory": "1GB", "memory_bandwidth": "1GB/s"},
                            "levels": [{"name": "node", "size": 8, "bandwidth": "1GB/s", "in_network_reduction": "x"}]})
    from testbed.topology.io import topology_to_dict

    t = load_topology("dgx-h100")
    assert topology_to_dict(t)["levels"][0]["in_network_reduction"] == "nvls"
    assert topology_from_dict(topology_to_dict(t)) == t


def test_nvls_only_where_declared():
    a100 = load_topology("dgx-a100-superpod")
    assert "nvls" not in applicable_algorithms(a100, "all_reduce", tuple(range(8)))
    assert "nvls" in applicable_algorithms(load_topology("dgx-h100"), "all_reduce", tuple(range(8)))
    assert "sharp" not in applicable_algorithms(a100, "all_reduce", tuple(range(16)))
    # not an NVIDIA GPU: only routed programs
    assert not [a for a in applicable_algorithms(load_topology("host-cpu-8"), "all_reduce", tuple(range(8)))
                if a.startswith("nccl") or a in ("nvls", "nvls_tree", "sharp")]


@pytest.mark.parametrize("ranks", [8, 16, 32])
@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
def test_nccl_algorithms_never_beat_the_bound_and_busbw_grows_with_size(h100, op, ranks):
    group = tuple(range(ranks))
    for algorithm in applicable_algorithms(h100, op, group):
        if not (algorithm.startswith("nccl") or algorithm in ("nvls", "nvls_tree", "sharp")):
            continue
        previous = 0.0
        for k in range(10, 35):
            t = collective_time(h100, op, group, 2.0**k, algorithm)
            assert t.time_s >= lower_bound(h100, op, group, 2.0**k) * (1 - 1e-12), (algorithm, k)
            assert t.busbw >= previous * (1 - 1e-9), (algorithm, k)
            previous = t.busbw


def test_protocols_as_nccl_picks_them(h100):
    group = tuple(range(8))
    assert collective_time(h100, "all_gather", group, 2.0**12).protocol == "LL"
    assert collective_time(h100, "all_gather", group, 2.0**33).protocol == "Simple"
    assert collective_time(h100, "all_reduce", group, 2.0**33).algorithm == "nvls"


def _published_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "published" / "collectives.py"
    spec = importlib.util.spec_from_file_location("published_collectives", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_published_collectives_within_goal():
    # The single published bandwidths (the sweeps are reported by size band by the benchmark itself).
    module = _published_module()
    rows = [r for r in module.evaluate() if "-sweep-" not in r["case"]]
    summary = module.summary(rows)
    assert summary["median_abs_error"] <= 0.10 and summary["max_abs_error"] <= 0.20, summary


def test_shipped_multinode_fit_is_the_fit_over_its_category():
    import dataclasses

    from testbed.collectives.nccl import MULTINODE_FIT

    module = _published_module()
    cases, topologies = module.load_cases()
    points = module._multinode(cases, topologies)
    assert len({p[0]["sweep"] for p in points}) >= 5 and len(points) >= 70
    # approximate cases (rounded figures, unstated sizes) are reported, never fitted
    assert any(c.get("approximate") for c in cases) and not any(p[0].get("approximate") for p in points)
    assert module.fit_multinode(points) == MULTINODE_FIT, dataclasses.asdict(module.fit_multinode(points))


def test_shared_errors_refit_equals_a_refit_over_the_kept_points_alone():
    # fit() shares one memo of every point's error between its leave-out refits: a refit over the kept indices
    # must be the refit over those points alone (same start, grids and summation order).
    module = _published_module()
    cases, topologies = module.load_cases()
    points = module._multinode(cases, topologies)[::9]
    errors = module._Errors(points)
    for i in (0, len(points) - 1):
        rest = [j for j in range(len(points)) if j != i]
        shared = module.fit_multinode(points, rounds=1, steps=4, keep=rest, errors=errors)
        alone = module.fit_multinode([points[j] for j in rest], rounds=1, steps=4)
        assert shared == alone
    assert module.fit_multinode(points, rounds=1, steps=4, errors=errors) == module.fit_multinode(points, 1, 4)


def test_multinode_fit_leaves_one_node_alone_and_slows_many():
    from testbed.collectives.nccl import MULTINODE_FIT, MultiNodeFit, nccl_best
    from testbed.collectives.ops import Op

    superpod = load_topology("dgx-h100-superpod")
    one, four = tuple(range(8)), tuple(range(32))
    assert nccl_best(superpod, Op.ALL_REDUCE, one, 2.0**30, fit=MultiNodeFit()) == \
        nccl_best(superpod, Op.ALL_REDUCE, one, 2.0**30, fit=MULTINODE_FIT)
    for size in (2.0**20, 2.0**25, 2.0**33):
        own = nccl_best(superpod, Op.ALL_REDUCE, four, size, fit=MultiNodeFit())
        fitted = nccl_best(superpod, Op.ALL_REDUCE, four, size)
        assert fitted[2] >= own[2]
    with pytest.raises(ValueError):
        MultiNodeFit(nvls_tree_efficiency=1.5)


def test_ll128_cap_is_by_nccls_node_class_two_nodes_or_more():
    """LL128's rate across nodes is one per NCCL node class (tuning.cc's index2: two nodes, three or more), lower
    in the deeper class, and the classes are what the cap reads."""
    from testbed.collectives.nccl import MULTINODE_FIT, MultiNodeFit

    assert MULTINODE_FIT.ll128_cap(2) == pytest.approx(MULTINODE_FIT.ll128_busbw * 1e9)
    deep = [MULTINODE_FIT.ll128_cap(nodes) for nodes in (3, 4, 8, 16, 128)]
    assert all(c == pytest.approx(MULTINODE_FIT.ll128_busbw_deep * 1e9) for c in deep)
    assert MULTINODE_FIT.ll128_busbw_deep < MULTINODE_FIT.ll128_busbw
    fit = MultiNodeFit(ll128_busbw=100.0, ll128_busbw_deep=40.0)
    assert (fit.ll128_cap(2), fit.ll128_cap(4)) == (100e9, 40e9)
    with pytest.raises(ValueError):
        MultiNodeFit(ll128_busbw_deep=0.0)


def test_multinode_busbw_grows_with_size_and_protocols_go_ll_ll128_simple():
    """Across nodes the pick's bus bandwidth never falls as messages grow, and its protocol never steps back
    (NCCL's cost model: LL has the lowest latency and rate, Simple the highest of both)."""
    superpod = load_topology("dgx-h100-superpod")
    order = {"LL": 0, "LL128": 1, "Simple": 2}
    for nodes in (2, 4, 8, 16):
        group = tuple(range(8 * nodes))
        picks = [collective_time(superpod, "all_reduce", group, 2.0 ** k) for k in range(10, 34)]
        assert all(a.busbw <= b.busbw * (1 + 1e-9) for a, b in zip(picks, picks[1:])), nodes
        assert all(order[a.protocol] <= order[b.protocol] for a, b in zip(picks, picks[1:])), nodes
