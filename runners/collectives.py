"""Execute testbed step programs on devices with ``lax.ppermute`` inside ``jax.shard_map``.

The algorithm (which rank sends which chunk where, reduce or copy) comes
from :mod:`testbed.collectives.algorithms`; this module only decides how to run it. Each
rank keeps its buffer as a ``(chunks + 1, max_chunk_length)`` array (chunks of
uneven ``array_split`` length are zero-padded; the extra row is a scratch row
that masked-out writes go to).

Rounds and ppermutes. A round's transfers are grouped by (source, destination)
pair; all chunks one pair moves in a round travel in one message. The pairs of
a round are split into *waves*, each a partial permutation (every rank sends
at most one message and receives at most one), found greedily in order of
shift ``(dst - src) mod n``. Rings, pairwise and trees give one wave per
direction; a round where a rank talks to several peers (direct, one_shot)
needs one wave per peer, because ``ppermute`` takes a permutation. Each wave
is one ``lax.ppermute``: a rank gathers the chunks it sends (a per-rank table
indexed by ``lax.axis_index``), and the receiver adds (reduce) or writes
(copy) them into its chunks; every wave of a round reads the state from the
start of the round, as :func:`testbed.collectives.ops.interpret` defines.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from testbed.collectives.algorithms import step_program
from testbed.collectives.ops import (Op, StepProgram, Transfer, block_length, input_blocks, output_blocks,
                                 output_shape, parse_op, piece_sizes)
from testbed.errors import InputError

__all__ = ["waves", "execute_program", "builtin_collective", "run_collective", "collective_mesh"]

AXIS = "ranks"


def waves(program: StepProgram, round_: Sequence[Transfer]) -> list[dict[tuple[int, int], list[Transfer]]]:
    """Split a round into partial permutations of (src, dst) pairs, each pair with all its transfers."""
    pairs: dict[tuple[int, int], list[Transfer]] = {}
    for t in round_:
        pairs.setdefault((t.src, t.dst), []).append(t)
    out: list[tuple[set[int], set[int], dict]] = []
    for pair in sorted(pairs, key=lambda p: ((p[1] - p[0]) % program.n, p[0])):
        src, dst = pair
        for senders, receivers, wave in out:
            if src not in senders and dst not in receivers:
                break
        else:
            senders, receivers, wave = set(), set(), {}
            out.append((senders, receivers, wave))
        senders.add(src)
        receivers.add(dst)
        wave[pair] = pairs[pair]
    return [wave for _, _, wave in out]


def _wave_tables(program: StepProgram, wave: dict[tuple[int, int], list[Transfer]]):
    """Per-rank tables (n, K): chunk sent, chunk written, valid, reduce; and the ppermute pairs."""
    n, scratch = program.n, program.chunks
    k = max(len(ts) for ts in wave.values())
    send = np.zeros((n, k), np.int32)
    dest = np.full((n, k), scratch, np.int32)
    valid = np.zeros((n, k), bool)
    reduce = np.zeros((n, k), bool)
    for (src, dst), ts in wave.items():
        for i, t in enumerate(ts):
            send[src, i] = t.src_chunk
            dest[dst, i] = t.dst_chunk
            valid[dst, i] = True
            reduce[dst, i] = t.reduce
    return send, dest, valid, reduce, sorted(wave)


def _split_indices(length: int, pieces: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Gather indices (pieces, width) of a flat block into padded pieces, their mask, and width."""
    sizes = piece_sizes(length, pieces)
    width = max(sizes) if sizes else 0
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    cols = np.arange(width)
    mask = cols[None, :] < np.asarray(sizes)[:, None]
    index = np.where(mask, offsets[:-1, None] + cols[None, :], 0)
    return index, mask, width


def execute_program(program: StepProgram, x: jax.Array, axis_name: str) -> jax.Array:
    """Run ``program`` inside ``shard_map`` on this rank's input ``x`` (mesh axis ``axis_name`` has n ranks).

    Returns this rank's output (shapes as :func:`testbed.collectives.ops.output_shape`).
    """
    n, op, pieces = program.n, program.op, program.pieces
    length = block_length(op, n, x.shape)
    index, mask, width = _split_indices(length, pieces)
    rank = lax.axis_index(axis_name)
    flat = x.reshape(-1)

    def to_pieces(block: jax.Array) -> jax.Array:
        return jnp.where(jnp.asarray(mask), block[jnp.asarray(index)], jnp.zeros((), x.dtype))

    buf = jnp.zeros((program.blocks, pieces, width), x.dtype)
    if op is Op.ALL_GATHER:
        buf = lax.dynamic_update_slice(buf, to_pieces(flat)[None], (rank, 0, 0))
    else:
        for i, b in enumerate(input_blocks(op, n, 0)):
            buf = buf.at[b].set(to_pieces(flat[i * length:(i + 1) * length]))
    buf = jnp.concatenate([buf.reshape(program.chunks, width), jnp.zeros((1, width), x.dtype)])
    for round_ in program.rounds:
        old = buf
        for wave in waves(program, round_):
            send, dest, valid, reduce, perm = _wave_tables(program, wave)
            message = old[jnp.asarray(send)[rank]]
            received = lax.ppermute(message, axis_name, perm)
            dst = jnp.asarray(dest)[rank]
            ok = jnp.asarray(valid)[rank][:, None]
            red = jnp.asarray(reduce)[rank][:, None]
            zero = jnp.zeros_like(received)
            buf = buf.at[dst].add(jnp.where(ok & red, received, zero))
            copy_to = jnp.where(jnp.asarray(valid & ~reduce)[rank], dst, program.chunks)
            buf = buf.at[copy_to].set(received)
    blocks = buf[: program.chunks].reshape(program.blocks, pieces, width)
    if op is Op.REDUCE_SCATTER:
        chosen = lax.dynamic_slice(blocks, (rank, 0, 0), (1, pieces, width))
    else:
        chosen = blocks[np.asarray(output_blocks(op, n, 0))]
    gather = (np.arange(pieces)[:, None] * width + np.arange(width)[None, :])[mask]
    flat_out = chosen.reshape(chosen.shape[0], pieces * width)[:, gather]
    return flat_out.reshape(output_shape(op, n, x.shape))


def builtin_collective(op: Op | str, x: jax.Array, axis_name: str) -> jax.Array:
    """JAX's own collective for ``op`` (the reference each step program must match)."""
    op = parse_op(op)
    if op is Op.ALL_REDUCE:
        return lax.psum(x, axis_name)
    if op is Op.ALL_GATHER:
        return lax.all_gather(x, axis_name, axis=0, tiled=True)
    if op is Op.REDUCE_SCATTER:
        return lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)
    if op is Op.ALL_TO_ALL:
        return lax.all_to_all(x, axis_name, 0, 0, tiled=True)
    raise InputError(f"no builtin JAX collective for {op}; use all_reduce, all_gather, reduce_scatter or all_to_all",
                     field="op")


def collective_mesh(n: int) -> jax.sharding.Mesh:
    """A one-axis mesh (``ranks``) over the first ``n`` devices."""
    devices = jax.devices()
    if not 1 <= n <= len(devices):
        raise InputError(f"needs 1..{len(devices)} devices (this process has {len(devices)}), got {n}", field="ranks")
    return jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices[:n])


@functools.lru_cache(maxsize=64)
def _compiled(program: StepProgram | None, op: Op, n: int):
    mesh = collective_mesh(n)

    def local(x):
        y = builtin_collective(op, x[0], AXIS) if program is None else execute_program(program, x[0], AXIS)
        return y[None]

    spec = jax.P(AXIS)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec)), mesh


def run_collective(op: Op | str, algorithm: str, x: np.ndarray | jax.Array, *, dims: Sequence[int] | None = None,
                   root: int = 0, peer: int | None = None) -> jax.Array:
    """Run ``op`` with ``algorithm`` over the first ``n = x.shape[0]`` devices; ``x[i]`` is rank i's input.

    ``algorithm='builtin'`` runs JAX's own collective instead. Returns the stacked outputs ``(n, ...)``.
    """
    op = parse_op(op)
    n = int(x.shape[0])
    program = None if algorithm == "builtin" else step_program(op, algorithm, n, dims=dims, root=root, peer=peer)
    fn, mesh = _compiled(program, op, n)
    sharded = jax.device_put(jnp.asarray(x), jax.NamedSharding(mesh, jax.P(AXIS)))
    return fn(sharded)
