"""Step programs executed with ppermute on emulated CPU devices equal JAX's own collectives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from testbed.runner.collectives import AXIS, builtin_collective, collective_mesh, execute_program, run_collective, waves
from testbed.collectives.algorithms import SUPPORTED_OPS, step_program
from testbed.collectives.ops import Op, reference

BUILTIN_OPS = (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL)
SIZES = (2, 3, 4, 6, 8)


def _dims(algorithm: str, n: int) -> tuple[int, ...] | None:
    if algorithm not in ("torus", "hierarchical", "multidim"):
        return None
    return next(((a, n // a) for a in (2, 3) if n % a == 0 and n > a), (n,))


def _both(op: Op, algorithm: str, n: int, x: np.ndarray):
    """(program result, builtin result), compiled as one shard_map so each case compiles once."""
    program = step_program(op, algorithm, n, dims=_dims(algorithm, n))
    mesh = collective_mesh(n)

    def local(v):
        return execute_program(program, v[0], AXIS)[None], builtin_collective(op, v[0], AXIS)[None]

    spec = jax.P(AXIS)
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=(spec, spec)))
    got, want = fn(jax.device_put(jnp.asarray(x), jax.NamedSharding(mesh, spec)))
    return np.asarray(got), np.asarray(want)


RUNNABLE = [alg for alg, ops in SUPPORTED_OPS.items() if set(ops) & set(BUILTIN_OPS)]


@pytest.mark.parametrize("algorithm", RUNNABLE)
@settings(max_examples=max(1, settings().max_examples // 7))  # the profile's share: ci 2, thorough 42
@given(data=st.data(), n=st.sampled_from(SIZES), rows=st.integers(1, 3), cols=st.integers(1, 5),
       dtype=st.sampled_from(["float32", "int32", "bfloat16"]), seed=st.integers(0, 2**31 - 1))
def test_programs_equal_jax_collectives(algorithm, data, n, rows, cols, dtype, seed):
    op = data.draw(st.sampled_from([op for op in SUPPORTED_OPS[algorithm] if op in BUILTIN_OPS]))
    rows *= n if op in (Op.REDUCE_SCATTER, Op.ALL_TO_ALL) else 1
    rng = np.random.default_rng(seed)
    values = rng.integers(-8, 8, size=(n, rows, cols)) if dtype != "float32" else rng.normal(size=(n, rows, cols))
    x = jnp.asarray(values, dtype=dtype)
    got, want = _both(op, algorithm, n, x)
    assert got.shape == want.shape and got.dtype == want.dtype
    if op is Op.ALL_REDUCE or op is Op.REDUCE_SCATTER:
        # Sums in a different order: equal within fp32 rounding (small integers are exact).
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("algorithm,op,n", [("torus", Op.ALL_REDUCE, 6), ("halving_doubling", Op.ALL_REDUCE, 6),
                                            ("line", Op.ALL_REDUCE, 5), ("line", Op.REDUCE_SCATTER, 4),
                                            ("line", Op.ALL_GATHER, 4)])
def test_selected_algorithms_on_uneven_chunks(algorithm, op, n):
    rows = n if op in (Op.ALL_TO_ALL, Op.REDUCE_SCATTER) else 1
    x = np.random.default_rng(n).normal(size=(n, rows, 7)).astype(np.float32)
    got, want = _both(op, algorithm, n, x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op,algorithm", [(Op.BROADCAST, "bidir_ring"), (Op.SEND, "direct")])
def test_broadcast_and_send_match_the_interpreter(op, algorithm):
    n = 4
    x = np.arange(n * 5, dtype=np.float32).reshape(n, 5)
    got = np.asarray(run_collective(op, algorithm, x, root=2, peer=0))
    want = reference(op, list(x), root=2, peer=0)
    np.testing.assert_array_equal(got, np.stack(want))


def test_waves_are_permutations_and_cover_the_round():
    for algorithm in ("direct", "one_shot", "halving_doubling", "bidir_ring"):
        program = step_program("all_reduce", algorithm, 6)
        for round_ in program.rounds:
            split = waves(program, round_)
            moved = [t for wave in split for ts in wave.values() for t in ts]
            assert sorted(map(repr, moved)) == sorted(map(repr, round_))
            for wave in split:
                assert len({s for s, _ in wave}) == len(wave) == len({d for _, d in wave})
    ring = step_program("all_reduce", "ring", 8)
    assert all(len(waves(ring, r)) == 1 for r in ring.rounds)
