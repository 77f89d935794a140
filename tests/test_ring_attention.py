"""Ring attention (``testbed/runner/ring_attention.py``) against dense causal attention on the whole sequence.

The sequence is laid out in testbed.plan.context's zigzag order and split over a ``context`` mesh
axis of 2, 3 or 4 emulated devices; the ring's output and its gradients (the custom VJP sending
dK/dV around the ring), put back in sequence order, equal :func:`testbed.runner.attention.plain_attention`'s
on one device (fp32, 1e-5 relative), for multi-head and grouped-query heads, plain and blockwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st
from jax.sharding import PartitionSpec as P

from testbed.runner.attention import plain_attention
from testbed.runner.ring_attention import ring_attention, zigzag_positions
from testbed.plan.context import context_order, context_positions


def _close(expected: jax.Array, got: jax.Array) -> bool:
    return float(jnp.linalg.norm((expected - got).ravel())) <= 1e-5 * float(jnp.linalg.norm(expected.ravel()))


def _mesh(size: int) -> jax.sharding.Mesh:
    return jax.make_mesh((size,), ("context",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:size])


def _ring_vs_dense(size: int, batch: int, chunk: int, heads: int, kv_heads: int, head_dim: int,
                   block: int | None, seed: int) -> None:
    seq = 2 * size * chunk
    keys = jax.random.split(jax.random.key(seed), 4)
    q, w = (jax.random.normal(k, (batch, seq, heads, head_dim)) for k in (keys[0], keys[3]))
    k, v = (jax.random.normal(key, (batch, seq, kv_heads, head_dim)) for key in keys[1:3])
    order = context_order(seq, size)
    back = np.argsort(order)
    ring = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, "context", block), mesh=_mesh(size),
                         in_specs=(P(None, "context"),) * 3, out_specs=P(None, "context"), check_vma=False)

    def dense(q, k, v):
        out, pullback = jax.vjp(plain_attention, q, k, v)
        return (out, *pullback(w))

    def zigzag(q, k, v):
        out, pullback = jax.vjp(ring, q[:, order], k[:, order], v[:, order])
        return tuple(x[:, back] for x in (out, *pullback(w[:, order])))

    for expected, got in zip(jax.jit(dense)(q, k, v), jax.jit(zigzag)(q, k, v)):   # output, dq, dk, dv
        assert _close(expected, got)


@settings(max_examples=max(1, settings().max_examples // 15))  # each compiles a ring and its backward: ci 1
@given(st.sampled_from([2, 3, 4]), st.sampled_from([(4, 4), (4, 2), (4, 1), (2, 2)]), st.sampled_from([None, 1, 2]),
       st.integers(1, 3), st.integers(0, 2 ** 16))
@example(4, (4, 2), None, 2, 0)   # always: 4 ranks, grouped-query heads, plain
@example(2, (4, 4), 2, 2, 1)      # always: 2 ranks, multi-head, blockwise (flash)
@example(3, (2, 2), 1, 1, 2)      # always: 3 ranks, one-key blocks
def test_ring_equals_dense_attention(size: int, heads: tuple[int, int], block: int | None, chunk: int,
                                     seed: int) -> None:
    _ring_vs_dense(size, 2, chunk, *heads, 4, block, seed)


def test_positions_are_the_plans_zigzag() -> None:
    for size in (1, 2, 3, 4):
        for rank in range(size):
            np.testing.assert_array_equal(np.asarray(zigzag_positions(8, size, rank)),
                                          context_positions(8 * size, size, rank))


@pytest.mark.quick  # make test-quick's test of this module
def test_odd_local_rows_refused() -> None:
    q = jnp.zeros((1, 3, 2, 4))
    with pytest.raises(ValueError, match="even"):
        ring_attention(q, q, q)
