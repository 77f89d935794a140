"""gloo's reduce-scatter as XLA:CPU runs it (testbed.collectives.gloo): ReduceScatterHalvingDoubling, nearest
partner first, then each block sent to its rank; priced with a round's host cost added to its wire (pure)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

from testbed.cluster import cluster_spec
from testbed.cluster.fit import HostProbe, emulated, link_goodput
from testbed.collectives.algorithms import step_program
from testbed.collectives.gloo import GLOO_ALGORITHMS, bit_reversed, gloo_pipelined, gloo_reduce_scatter
from testbed.collectives.ops import interpret, reference
from testbed.collectives.timing import applicable_algorithms, groups_time
from testbed.errors import InputError
from testbed.topology.io import load_topology

ALL8 = [tuple(range(8))]


def test_bit_reversal_is_gloos_reverse_last_n_bits():
    assert [bit_reversed(r, 3) for r in range(8)] == [0, 4, 2, 6, 1, 5, 3, 7]
    assert [bit_reversed(r, 2) for r in range(4)] == [0, 2, 1, 3]
    assert bit_reversed(0, 0) == 0


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_the_program_reduce_scatters(n):
    program = step_program("reduce_scatter", "gloo_halving_doubling", n)
    rng = np.random.default_rng(n)
    inputs = [rng.integers(-100, 100, size=(2 * n, 3)) for _ in range(n)]
    for got, want in zip(interpret(program, inputs), reference("reduce_scatter", inputs)):
        np.testing.assert_array_equal(got, want)


def test_rounds_and_bytes_on_8_ranks_follow_gloos_code():
    """gloo/reduce_scatter.h on 8 ranks: step k sends to rank ^ 2^k a half of what is left (S/2, S/4, S/8 of the
    buffer S: 4, 2 and 1 of its 8 blocks), each rank then holding block bitrev(rank); the distribution sends block
    bitrev(r) from rank r to rank bitrev(r) where they differ (1 <-> 4, 3 <-> 6). 4 rounds in all."""
    pieces, rounds = gloo_reduce_scatter(8)
    assert pieces == 1 and len(rounds) == 4
    for k, round_ in enumerate(rounds[:3]):
        sent = Counter((t.src, t.dst) for t in round_)
        assert sent == {(r, r ^ (1 << k)): 4 >> k for r in range(8)}
        assert all(t.reduce for t in round_)
    assert sorted((t.src, t.dst, t.src_chunk) for t in rounds[3]) == [(1, 4, 4), (3, 6, 6), (4, 1, 1), (6, 3, 3)]
    assert not any(t.reduce for t in rounds[3])
    # The first step (largest) stays with the nearest rank: rank 0 keeps blocks 0..3 and sends 4..7 to rank 1.
    assert sorted(t.src_chunk for t in rounds[0] if t.src == 0) == [4, 5, 6, 7]


def test_non_power_of_two_ranks_are_refused_by_the_gloo_program_and_priced_as_halving_doubling():
    with pytest.raises(ValueError, match="power-of-two"):
        gloo_reduce_scatter(6)
    assert step_program("reduce_scatter", "gloo_halving_doubling", 6).rounds == \
        step_program("reduce_scatter", "halving_doubling", 6).rounds


def test_on_4_nodes_x_2_seven_eighths_of_the_buffer_crosses_each_nodes_link():
    """Ranks are devices in order, two a node: the S/2 step stays in the node, then S/4 x 2 ranks, S/8 x 2 and one
    S/8 block of the distribution leave each node: 7/8 S, as much as a ring; the textbook order (farthest partner
    first) sends S/2 x 2 + S/4 x 2 = 3/2 S across."""
    def crossing(algorithm: str) -> Counter:
        out = Counter()
        for round_ in step_program("reduce_scatter", algorithm, 8).rounds:
            for t in round_:
                if t.src // 2 != t.dst // 2:
                    out[t.src // 2] += 1  # blocks of S/8
        return out

    assert crossing("gloo_halving_doubling") == {node: 7 for node in range(4)}
    assert crossing("halving_doubling") == {node: 12 for node in range(4)}


def _cluster(overhead_s: float):
    topology = load_topology("eth-4x2")
    return dataclasses.replace(topology, calibration=topology.calibration.updated(
        collectives={"overhead_s": overhead_s, "launch_s": 0.0, "rendezvous_s": 0.0, "rounds_overlap": True}))


def test_where_gloo_runs_its_reduce_scatter_is_priced_and_each_rounds_host_cost_added():
    bare, slow = _cluster(0.0), _cluster(1e-3)
    assert GLOO_ALGORITHMS["reduce_scatter"] == "gloo_halving_doubling"
    assert applicable_algorithms(bare, "reduce_scatter", ALL8[0]).count("gloo_halving_doubling") == 1
    for nbytes in (4096.0, 2.0**26):
        auto = groups_time(slow, "reduce_scatter", ALL8, nbytes)
        assert auto.algorithm == "gloo_halving_doubling" and auto.rounds == 4
        # One send a step, waited for: no second segment on the wire, so the host cost adds (rings hide it).
        assert not gloo_pipelined(slow, "reduce_scatter", "gloo_halving_doubling")
        wire = groups_time(bare, "reduce_scatter", ALL8, nbytes, "gloo_halving_doubling").time_s
        assert auto.time_s == pytest.approx(wire + 4 * 1e-3, rel=1e-9)


def test_on_the_emulated_cluster_64MiB_takes_seven_eighths_of_the_buffer_at_the_links_goodput():
    """The 4 x 2 cluster shaped to 100 Mb/s (loopback inside a node far faster): gloo's reduce-scatter is wire-bound
    by 7/8 S over a node's link, as the ring (plus its first step over loopback); the textbook order's 3/2 S would
    price it 1.6x slower."""
    topology = load_topology("eth-4x2")
    spec = cluster_spec(topology, name="t", scale=100e6 / (topology.levels[-1].bandwidth * 8))
    probe = HostProbe(loopback_bandwidth=5e8, loopback_latency_s=3e-6, across_latency_s=5e-6)
    bare = emulated(spec, probe)
    times = {a: groups_time(bare, "reduce_scatter", ALL8, 2.0**26, a).time_s
             for a in ("gloo_halving_doubling", "ring", "halving_doubling")}
    # Its first step (S/2) inside the node at loopback speed, the rest on the node's link: 7/8 S.
    assert times["gloo_halving_doubling"] == pytest.approx(7 / 8 * 2**26 / link_goodput(spec) + 2**25 / 5e8,
                                                           rel=1e-3)
    assert times["gloo_halving_doubling"] == pytest.approx(times["ring"], rel=0.02)
    assert times["halving_doubling"] > 1.6 * times["gloo_halving_doubling"]


def test_gloos_variant_is_no_candidate_where_gloo_does_not_run():
    """Elsewhere (NCCL GPUs, a lone CPU host, TPUs) it is neither picked by ``auto`` nor accepted by name."""
    for name in ("eth-100g-8", "host-cpu-8"):
        topology = load_topology(name)
        assert "gloo_halving_doubling" not in applicable_algorithms(topology, "reduce_scatter", ALL8[0])
        with pytest.raises(InputError, match="does not apply"):
            groups_time(topology, "reduce_scatter", ALL8, 4096.0, "gloo_halving_doubling")
