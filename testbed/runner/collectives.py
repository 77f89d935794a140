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

Checking and timing (:func:`execute_and_check`, for ``testbed collective
--execute``). A program runs on random fp32 data next to JAX's own collective
on the same devices; copies must be bit-exact and sums may differ only by the
rounding of two summation orders, at most ``2 gamma(n-1) max sum |x_i|``
(``gamma(k) = k u / (1 - k u)``, ``u = 2**-24``; Higham, *Accuracy and
Stability of Numerical Algorithms*, 2nd ed., sec. 4.2), so the tolerance is a
bound, not a fudge. Both are timed alternately after a warm-up: the median of
``repeats`` calls, each waited for with ``block_until_ready``.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from testbed.collectives.algorithms import step_program
from testbed.collectives.ops import (Op, StepProgram, Transfer, block_length, input_blocks, output_blocks,
                                     output_shape, parse_op, piece_sizes)
from testbed.errors import InputError

__all__ = ["waves", "execute_program", "builtin_collective", "run_collective", "collective_mesh", "BUILTIN_OPS",
           "Execution", "execution_elements", "execute_and_check"]

AXIS = "ranks"

#: Ops JAX has a collective for (the reference :func:`execute_and_check` compares against).
BUILTIN_OPS: tuple[Op, ...] = (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL)


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


# -- checking and timing a program on devices ---------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class Execution:
    """A step program run on devices: its check against JAX's collective and both median times.

    ``elements``: fp32 elements of each rank's input; ``bytes``: the executed
    size in the nccl-tests convention (docs/design.md), so it is comparable
    with the simulator's ``bytes``. ``ok``: ``max_abs_error <= tolerance``
    (a non-finite error is never ok and is reported as None).
    """

    op: str
    algorithm: str
    ranks: int
    platform: str
    device_kind: str
    elements: int
    bytes: int
    repeats: int
    max_abs_error: float | None
    tolerance: float
    ok: bool
    program_time_s: float
    builtin_time_s: float

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.elements < 1 or self.bytes < 1 or self.repeats < 1:
            raise ValueError(f"ranks, elements, bytes and repeats must be positive: {self}")
        if self.tolerance < 0 or self.program_time_s < 0 or self.builtin_time_s < 0:
            raise ValueError(f"tolerance and times must be non-negative: {self}")
        if self.ok and (self.max_abs_error is None or self.max_abs_error > self.tolerance):
            raise ValueError(f"ok needs a finite error within the tolerance: {self}")


def execution_elements(program: StepProgram, nbytes: float, itemsize: int = 4) -> tuple[int, int]:
    """(elements of each rank's input, executed bytes) for a collective of about ``nbytes``.

    ``nbytes`` counts ``program.data_blocks`` blocks (nccl-tests); each block
    gets ``nbytes // (itemsize * data_blocks)`` elements, so the executed size
    is ``nbytes`` rounded down to whole blocks of whole elements.
    """
    n, op = program.n, program.op
    block = int(nbytes) // (itemsize * program.data_blocks)
    if block < 1:
        raise InputError(f"{op} on {n} ranks needs at least {itemsize * program.data_blocks} bytes to execute "
                         f"(one {itemsize}-byte element per block of {program.data_blocks}), got {int(nbytes)}",
                         field="bytes")
    return block * len(input_blocks(op, n, 0)), block * program.data_blocks * itemsize


def _gamma(k: int) -> float:
    """Higham's gamma_k = k u / (1 - k u) for fp32 (u = 2**-24): the relative error bound of k additions."""
    u = float(np.finfo(np.float32).eps) / 2
    return k * u / (1 - k * u)


def _median_times(fns: Sequence, x: jax.Array, repeats: int, warmup: int) -> list[float]:
    """Median seconds of each function on ``x``, called alternately (so drift hits both alike)."""
    for _ in range(warmup):
        for fn in fns:
            jax.block_until_ready(fn(x))
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            jax.block_until_ready(fn(x))
            out.append(time.perf_counter() - start)
    return [float(np.median(t)) for t in times]


def execute_and_check(program: StepProgram, nbytes: float, *, repeats: int = 10, warmup: int = 2,
                      seed: int = 0) -> Execution:
    """Run ``program`` on the first ``program.n`` devices, check it against JAX's collective, time both.

    The input is standard-normal fp32, ``nbytes`` as :func:`execution_elements`
    rounds it. Raises InputError for ops without a JAX collective, too few
    devices, or a size too small.
    """
    op, n = program.op, program.n
    if op not in BUILTIN_OPS:
        raise InputError(f"{op} has no JAX collective to check a step program against; executable ops: "
                         f"{', '.join(BUILTIN_OPS)}", field="op")
    if repeats < 1 or warmup < 0:
        raise InputError(f"repeats must be at least 1 and warm-up calls at least 0, got {repeats} and {warmup}",
                         field="repeats")
    elements, executed = execution_elements(program, nbytes)
    x = np.random.default_rng(seed).standard_normal((n, elements), dtype=np.float32)
    mine, _ = _compiled(program, op, n)
    builtin, mesh = _compiled(None, op, n)
    sharded = jax.device_put(jnp.asarray(x), jax.NamedSharding(mesh, jax.P(AXIS)))
    got = np.asarray(mine(sharded), dtype=np.float64)
    want = np.asarray(builtin(sharded), dtype=np.float64)
    error = float(np.max(np.abs(got - want))) if got.shape == want.shape else math.inf
    tolerance = 0.0
    if op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER):
        tolerance = 2 * _gamma(n - 1) * float(np.abs(x.astype(np.float64)).sum(axis=0).max())
    ok = math.isfinite(error) and error <= tolerance
    program_s, builtin_s = _median_times((mine, builtin), sharded, repeats, warmup)
    device = mesh.devices.flat[0]
    return Execution(op=str(op), algorithm=program.algorithm, ranks=n, platform=device.platform,
                     device_kind=device.device_kind, elements=elements, bytes=executed, repeats=repeats,
                     max_abs_error=error if math.isfinite(error) else None, tolerance=tolerance, ok=ok,
                     program_time_s=program_s, builtin_time_s=builtin_s)
