"""Step programs: the numpy interpreter reproduces each op's definition for every algorithm."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

from collections import Counter

from testbed.collectives.algorithms import ALGORITHMS, SUPPORTED_OPS, step_program
from testbed.collectives.routed import RING_FAMILY, flow_rounds
from testbed.collectives.ops import (OPS, Op, StepProgram, Transfer, chunk_bounds, interpret, output_shape, parse_op,
                                 piece_sizes, reference)
from testbed.errors import InputError

PAIRS = [(alg, op) for alg in ALGORITHMS for op in SUPPORTED_OPS[alg]]


def _divisors(n: int) -> list[tuple[int, ...]]:
    return [(n,)] + [(a, n // a) for a in range(2, n) if n % a == 0] + ([(2, 2, n // 4)] if n % 4 == 0 and n > 4 else [])


@st.composite
def cases(draw):
    algorithm, op = draw(st.sampled_from(PAIRS))
    n = draw(st.integers(2 if op is Op.SEND else 1, 12))
    dims = draw(st.sampled_from(_divisors(n))) if algorithm in ("torus", "hierarchical", "multidim") else None
    root = draw(st.integers(0, n - 1))
    peer = draw(st.integers(0, n - 1).filter(lambda p: p != root)) if op is Op.SEND else None
    rows = draw(st.integers(1, 4)) * (n if op in (Op.REDUCE_SCATTER, Op.ALL_TO_ALL) else 1)
    cols = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    return algorithm, op, n, dims, root, peer, (rows, cols), seed, dtype


@given(cases())
def test_interpreter_reproduces_definition(case):
    algorithm, op, n, dims, root, peer, shape, seed, dtype = case
    program = step_program(op, algorithm, n, dims=dims, root=root, peer=peer)
    rng = np.random.default_rng(seed)
    inputs = [rng.integers(-1000, 1000, size=shape).astype(dtype) for _ in range(n)]
    got = interpret(program, inputs)
    want = reference(op, inputs, root=root, peer=program.peer)
    assert len(got) == n
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape == output_shape(op, n, shape), (rank, g.shape, w.shape)
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w, err_msg=f"{algorithm} {op} n={n} dims={dims} rank={rank}")


@pytest.mark.parametrize("algorithm,op", PAIRS)
def test_every_algorithm_on_awkward_sizes(algorithm, op):
    """Non-power-of-two ranks and a buffer length that no chunk count divides."""
    for n in (2, 5, 7) if op is Op.SEND else (1, 5, 7):
        rng = np.random.default_rng(n)
        rows = n if op in (Op.REDUCE_SCATTER, Op.ALL_TO_ALL) else 1
        inputs = [rng.normal(size=(rows, 13)).round(3) for _ in range(n)]
        program = step_program(op, algorithm, n, root=n - 1)
        got = interpret(program, inputs)
        want = reference(op, inputs, root=n - 1, peer=program.peer)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def test_ring_all_reduce_shape_is_the_textbook_one():
    n = 6
    program = step_program("all_reduce", "ring", n)
    assert len(program.rounds) == 2 * (n - 1)
    assert program.chunks == n
    for round_ in program.rounds:
        assert sorted((t.src, t.dst) for t in round_) == [(r, (r + 1) % n) for r in range(n)]
    assert [t.reduce for t in program.rounds[0]] == [True] * n
    assert [t.reduce for t in program.rounds[-1]] == [False] * n


def test_halving_doubling_round_counts():
    assert len(step_program("all_reduce", "halving_doubling", 8).rounds) == 6
    assert len(step_program("all_reduce", "halving_doubling", 6).rounds) == 2 + 2 * 2  # fold in + RS/AG on 4 + serve
    assert len(step_program("broadcast", "halving_doubling", 5).rounds) == 3


def test_program_validation_names_the_problem():
    with pytest.raises(InputError, match="piece"):
        StepProgram(op="all_reduce", algorithm="x", n=2, blocks=1, pieces=2,
                    rounds=((Transfer(src=0, dst=1, src_chunk=0, dst_chunk=1),),))
    with pytest.raises(InputError, match="written twice"):
        StepProgram(op="all_reduce", algorithm="x", n=3, blocks=1, pieces=1,
                    rounds=((Transfer(src=0, dst=2, src_chunk=0, dst_chunk=0),
                             Transfer(src=1, dst=2, src_chunk=0, dst_chunk=0, reduce=True)),))
    with pytest.raises(InputError, match="rank out of range"):
        StepProgram(op="all_reduce", algorithm="x", n=2, blocks=1, pieces=1,
                    rounds=((Transfer(src=0, dst=2, src_chunk=0, dst_chunk=0),),))
    with pytest.raises(InputError, match="blocks"):
        StepProgram(op="all_gather", algorithm="x", n=2, blocks=1, pieces=1, rounds=())


def test_unknown_names_suggest_the_closest():
    with pytest.raises(InputError, match="did you mean `all_gather`"):
        parse_op("all_gathr")
    assert parse_op("all-reduce") is Op.ALL_REDUCE and parse_op("allgather") is Op.ALL_GATHER
    with pytest.raises(InputError, match="did you mean `ring`"):
        step_program("all_reduce", "rnig", 4)
    with pytest.raises(InputError, match="algorithms that do: .*direct"):
        step_program("all_to_all", "ring", 4)
    with pytest.raises(InputError, match="divisible"):
        interpret(step_program("reduce_scatter", "ring", 3), [np.zeros(4)] * 3)


def test_chunk_bounds_cover_the_buffer_once():
    program = step_program("all_gather", "bidir_ring", 3)
    bounds = chunk_bounds(program, 7)
    covered = [i for a, b in bounds for i in range(a, b)]
    assert covered == list(range(3 * 7))
    assert piece_sizes(7, 3) == (3, 2, 2) and sum(piece_sizes(5, 8)) == 5


def test_programs_are_memoized_and_frozen():
    a = step_program("all_reduce", "ring", 5)
    assert a is step_program("all_reduce", "ring", 5)
    with pytest.raises(AttributeError):
        a.n = 3  # type: ignore[misc]
    assert set(OPS) == {op.value for op in Op}


GRIDS = [(2, 2, 2), (4, 4), (3, 4), (4, 4, 4), (2, 3), (3, 1, 2), (5,), (2,), (1,)]


@pytest.mark.parametrize("dims", GRIDS)
def test_multidim_reduces_correctly_on_grids(dims):
    """The all-dims-at-once program reproduces every op's definition on each grid (data moved and summed)."""
    n = int(np.prod(dims))
    rng = np.random.default_rng(n)
    for op in SUPPORTED_OPS["multidim"]:
        rows = 2 * (n if op is Op.REDUCE_SCATTER else 1)
        inputs = [rng.integers(-99, 99, size=(rows, 3)) for _ in range(n)]
        program = step_program(op, "multidim", n, dims=dims)
        for g, w in zip(interpret(program, inputs), reference(op, inputs)):
            np.testing.assert_array_equal(g, w, err_msg=f"{op} dims={dims}")


def test_multidim_keeps_every_dim_busy():
    """4x4x4: from the first round every rank sends along all three dims, both ways (six neighbours)."""
    program = step_program("all_reduce", "multidim", 64, dims=(4, 4, 4))
    assert len(program.rounds) == 2 * 3 * 3  # reduce-scatter and all-gather, 3 rounds per dim, dims in lockstep
    for round_ in program.rounds:
        assert len({t.dst for t in round_ if t.src == 0}) == 6


@pytest.mark.parametrize("dims", GRIDS)
def test_flow_counts_equal_the_programs_transfers(dims):
    """flow_rounds (what routed timing uses for ring-family programs) counts exactly the program's transfers."""
    n = int(np.prod(dims))
    for algorithm in RING_FAMILY:
        grid = dims if algorithm in ("torus", "hierarchical", "multidim") else (n,)
        for op in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER):
            program = step_program(op, algorithm, n, dims=grid)
            want = [c for c in (Counter((t.src, t.dst) for t in r if t.src != t.dst) for r in program.rounds) if c]
            pieces, rounds = flow_rounds(op, algorithm, n, tuple(grid))
            assert pieces == program.pieces, (algorithm, op)
            assert [Counter({(a, b): c for a, b, c in r}) for r in rounds] == want, (algorithm, op, dims)


@pytest.mark.parametrize("op", [Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE])
def test_line_moves_one_hop_and_one_block_per_link_each_way_a_round(op):
    # `line` never wraps: every transfer is between neighbours, and no directed link carries more than one
    # block (or, for all_reduce, one rank's piece) a round; all-gather and reduce-scatter take n - 1 rounds.
    n = 5
    program = step_program(op, "line", n)
    assert len(program.rounds) == (2 if op is Op.ALL_REDUCE else 1) * (n - 1)
    for round_ in program.rounds:
        assert all(abs(t.src - t.dst) == 1 for t in round_)
        assert max(Counter((t.src, t.dst) for t in round_).values()) == 1
    x = [np.arange(n * 3).reshape(n, 3) * (r + 1) for r in range(n)]
    for got, want in zip(interpret(program, x), reference(op, x)):
        np.testing.assert_array_equal(got, want)
