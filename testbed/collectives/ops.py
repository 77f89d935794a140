"""Collective ops as step programs, and the numpy interpreter that defines them.

A collective algorithm is written once, as a frozen :class:`StepProgram`:
rounds of :class:`Transfer` (source rank, destination rank, which chunk, reduce
or copy). The simulator times a program on a topology
(:mod:`testbed.collectives.timing`); ``testbed/runner/collectives.py`` executes the
same program on devices with ``lax.ppermute`` and checks it against JAX's own
collective (training steps use the collectives XLA inserts, not these
programs); :func:`interpret` executes it with numpy and is the executable
specification both are tested against.

Buffer layout. Every rank holds ``blocks`` blocks of equal length; each block
is cut into ``pieces`` chunks with ``numpy.array_split`` sizes (the first
``length % pieces`` chunks are one element longer, so lengths that do not
divide evenly work). Chunk ``c`` is piece ``c % pieces`` of block
``c // pieces``; a transfer keeps the piece index (``src_chunk % pieces ==
dst_chunk % pieces``) so both chunks have the same length. Which blocks an
op's input fills and its output reads (:func:`input_blocks`,
:func:`output_blocks`):

=============== ======== ======================= =========================
op              blocks   input of rank r         output of rank r
=============== ======== ======================= =========================
all_reduce      1        block 0 (whole buffer)  block 0
broadcast, send 1        block 0                 block 0
all_gather      n        block r                 blocks 0..n-1
reduce_scatter  n        blocks 0..n-1           block r
all_to_all      2n       blocks 0..n-1           blocks n..2n-1
=============== ======== ======================= =========================

Round semantics: every transfer of a round reads the state at the start of
the round; a copy overwrites its destination chunk, reduces add into it (all
reduces into one chunk in one round are summed). A chunk may not receive a
copy and anything else in the same round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from testbed.errors import InputError, unknown_key_message

__all__ = [
    "Op", "OPS", "BUS_FACTOR", "parse_op", "Transfer", "StepProgram", "num_blocks", "input_blocks",
    "output_blocks", "block_length", "output_shape", "piece_sizes", "chunk_bounds", "interpret", "reference",
]


class Op(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND = "send"


OPS: tuple[str, ...] = tuple(op.value for op in Op)

#: nccl-tests bus-bandwidth factors: busbw = algbw * factor(n).
BUS_FACTOR = {
    Op.ALL_REDUCE: lambda n: 2.0 * (n - 1) / n,
    Op.ALL_GATHER: lambda n: (n - 1) / n,
    Op.REDUCE_SCATTER: lambda n: (n - 1) / n,
    Op.ALL_TO_ALL: lambda n: (n - 1) / n,
    Op.BROADCAST: lambda n: 1.0,
    Op.SEND: lambda n: 1.0,
}

_ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
            "alltoall": "all_to_all", "recv": "send", "sendrecv": "send", "send_recv": "send"}


def parse_op(name: str | Op) -> Op:
    """The op called ``name`` (``all-reduce`` and ``allreduce`` spellings too)."""
    if isinstance(name, Op):
        return name
    key = str(name).strip().lower().replace("-", "_")
    key = _ALIASES.get(key.replace("_", ""), _ALIASES.get(key, key))
    if key not in OPS:
        raise InputError(unknown_key_message(str(name), OPS, what="collective op"), field="op")
    return Op(key)


@dataclass(frozen=True, slots=True, kw_only=True)
class Transfer:
    """Rank ``src`` sends its chunk ``src_chunk`` to rank ``dst``'s chunk ``dst_chunk``.

    ``reduce``: the destination adds the chunk to its own; otherwise it copies.
    ``src == dst`` is a local copy (no network traffic).
    """

    src: int
    dst: int
    src_chunk: int
    dst_chunk: int
    reduce: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class StepProgram:
    """A collective algorithm on ``n`` ranks: rounds of transfers over a chunked buffer.

    ``root`` is the broadcast root or the sender of ``send``; ``peer`` the receiver of ``send``.
    """

    op: Op
    algorithm: str
    n: int
    blocks: int
    pieces: int
    rounds: tuple[tuple[Transfer, ...], ...]
    root: int = 0
    peer: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "op", parse_op(self.op))
        object.__setattr__(self, "rounds", tuple(tuple(r) for r in self.rounds))
        if not isinstance(self.n, int) or self.n < 1:
            raise InputError(f"needs at least one rank, got {self.n!r}", field="n")
        if self.blocks != num_blocks(self.op, self.n):
            raise InputError(f"{self.op} on {self.n} ranks uses {num_blocks(self.op, self.n)} blocks, got {self.blocks}",
                             field="blocks")
        if self.pieces < 1:
            raise InputError(f"must be at least 1, got {self.pieces}", field="pieces")
        for name in ("root", "peer"):
            if not 0 <= getattr(self, name) < self.n:
                raise InputError(f"must be a rank 0..{self.n - 1}, got {getattr(self, name)}", field=name)
        chunks = self.chunks
        for k, round_ in enumerate(self.rounds):
            copies: set[tuple[int, int]] = set()
            reduces: set[tuple[int, int]] = set()
            for t in round_:
                if not (0 <= t.src < self.n and 0 <= t.dst < self.n):
                    raise InputError(f"round {k}: rank out of range 0..{self.n - 1} in {t}", field="rounds")
                if not (0 <= t.src_chunk < chunks and 0 <= t.dst_chunk < chunks):
                    raise InputError(f"round {k}: chunk out of range 0..{chunks - 1} in {t}", field="rounds")
                if t.src_chunk % self.pieces != t.dst_chunk % self.pieces:
                    raise InputError(f"round {k}: a transfer must keep its piece index, got {t}", field="rounds")
                slot = (t.dst, t.dst_chunk)
                if slot in copies or (not t.reduce and slot in reduces):
                    raise InputError(f"round {k}: chunk {t.dst_chunk} of rank {t.dst} is written twice, once by a copy",
                                     field="rounds")
                (reduces if t.reduce else copies).add(slot)

    @property
    def chunks(self) -> int:
        """Chunks per rank buffer (blocks x pieces)."""
        return self.blocks * self.pieces

    @property
    def data_blocks(self) -> int:
        """How many blocks make up the op's ``bytes`` (nccl-tests convention)."""
        return 1 if self.op in (Op.ALL_REDUCE, Op.BROADCAST, Op.SEND) else self.n

    def chunk_bytes(self, nbytes: float) -> float:
        """Bytes of one chunk when the collective moves ``nbytes`` (the nccl-tests convention, docs/design.md)."""
        return float(nbytes) / (self.data_blocks * self.pieces)


# -- layout --------------------------------------------------------------------------

def num_blocks(op: Op | str, n: int) -> int:
    op = parse_op(op)
    if op in (Op.ALL_GATHER, Op.REDUCE_SCATTER):
        return n
    if op is Op.ALL_TO_ALL:
        return 2 * n
    return 1


def input_blocks(op: Op | str, n: int, rank: int) -> tuple[int, ...]:
    """Blocks that rank ``rank``'s input fills, in order."""
    op = parse_op(op)
    if op is Op.ALL_GATHER:
        return (rank,)
    if op in (Op.REDUCE_SCATTER, Op.ALL_TO_ALL):
        return tuple(range(n))
    return (0,)


def output_blocks(op: Op | str, n: int, rank: int) -> tuple[int, ...]:
    """Blocks concatenated into rank ``rank``'s output, in order."""
    op = parse_op(op)
    if op is Op.ALL_GATHER:
        return tuple(range(n))
    if op is Op.REDUCE_SCATTER:
        return (rank,)
    if op is Op.ALL_TO_ALL:
        return tuple(range(n, 2 * n))
    return (0,)


def block_length(op: Op | str, n: int, shape: Sequence[int]) -> int:
    """Elements per block for a per-rank input of ``shape``.

    reduce_scatter and all_to_all split the input's first dimension into n
    blocks (as ``lax.psum_scatter``/``lax.all_to_all`` do), so it must divide.
    """
    op = parse_op(op)
    size = int(np.prod(shape, dtype=np.int64))
    if op in (Op.REDUCE_SCATTER, Op.ALL_TO_ALL):
        if len(shape) == 0 or shape[0] % n:
            raise InputError(f"{op} on {n} ranks needs the first dimension divisible by {n}, got shape {tuple(shape)}",
                             field="shape")
        return size // n
    return size


def output_shape(op: Op | str, n: int, shape: Sequence[int]) -> tuple[int, ...]:
    """Per-rank output shape (all_gather and reduce_scatter act on the first dimension)."""
    op = parse_op(op)
    shape = tuple(int(s) for s in shape)
    if op is Op.ALL_GATHER:
        return (n * shape[0], *shape[1:]) if shape else (n,)
    if op is Op.REDUCE_SCATTER:
        block_length(op, n, shape)
        return (shape[0] // n, *shape[1:])
    return shape


def piece_sizes(length: int, pieces: int) -> tuple[int, ...]:
    """``numpy.array_split`` sizes of ``length`` elements in ``pieces``."""
    q, r = divmod(int(length), pieces)
    return tuple(q + 1 if i < r else q for i in range(pieces))


def chunk_bounds(program: StepProgram, length: int) -> tuple[tuple[int, int], ...]:
    """(start, stop) of each chunk in the flat buffer of ``blocks * length`` elements."""
    sizes = piece_sizes(length, program.pieces)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return tuple((b * length + int(offsets[p]), b * length + int(offsets[p + 1]))
                 for b in range(program.blocks) for p in range(program.pieces))


# -- interpreter ---------------------------------------------------------------------------

def interpret(program: StepProgram, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Execute ``program`` with numpy: rank i's input is ``inputs[i]``; returns every rank's output.

    Broadcast outputs the root's input everywhere; send outputs the root's
    input on the peer and leaves every other rank's input unchanged.
    """
    n = program.n
    if len(inputs) != n:
        raise InputError(f"needs one input per rank ({n}), got {len(inputs)}", field="inputs")
    arrays = [np.asarray(x) for x in inputs]
    shape, dtype = arrays[0].shape, arrays[0].dtype
    if any(a.shape != shape or a.dtype != dtype for a in arrays):
        raise InputError("every rank's input needs the same shape and dtype", field="inputs")
    op = program.op
    length = block_length(op, n, shape)
    bounds = chunk_bounds(program, length)
    state = []
    for rank, a in enumerate(arrays):
        buf = np.zeros(program.blocks * length, dtype=dtype)
        flat = a.reshape(-1)
        for i, b in enumerate(input_blocks(op, n, rank)):
            buf[b * length:(b + 1) * length] = flat[i * length:(i + 1) * length]
        state.append(buf)
    for round_ in program.rounds:
        before = [buf.copy() for buf in state]
        for t in round_:
            s0, s1 = bounds[t.src_chunk]
            d0, d1 = bounds[t.dst_chunk]
            if t.reduce:
                state[t.dst][d0:d1] += before[t.src][s0:s1]
            else:
                state[t.dst][d0:d1] = before[t.src][s0:s1]
    outputs = []
    out_shape = output_shape(op, n, shape)
    for rank, buf in enumerate(state):
        if op is Op.SEND and rank != program.peer:
            outputs.append(arrays[rank].copy())
            continue
        parts = [buf[b * length:(b + 1) * length] for b in output_blocks(op, n, rank)]
        outputs.append(np.concatenate(parts).reshape(out_shape))
    return outputs


def reference(op: Op | str, inputs: Sequence[np.ndarray], *, root: int = 0, peer: int = 0) -> list[np.ndarray]:
    """The op's definition, directly in numpy (what every algorithm must reproduce)."""
    op = parse_op(op)
    arrays = [np.asarray(x) for x in inputs]
    n = len(arrays)
    if op is Op.ALL_REDUCE:
        total = arrays[0].copy()
        for a in arrays[1:]:
            total = total + a
        return [total.copy() for _ in arrays]
    if op is Op.ALL_GATHER:
        gathered = np.concatenate(arrays, axis=0) if arrays[0].ndim else np.stack(arrays)
        return [gathered.copy() for _ in arrays]
    if op is Op.REDUCE_SCATTER:
        total = arrays[0].copy()
        for a in arrays[1:]:
            total = total + a
        return [part.copy() for part in np.split(total, n, axis=0)]
    if op is Op.ALL_TO_ALL:
        split = [np.split(a, n, axis=0) for a in arrays]
        return [np.concatenate([split[j][r] for j in range(n)], axis=0) for r in range(n)]
    if op is Op.BROADCAST:
        return [arrays[root].copy() for _ in arrays]
    return [arrays[root].copy() if r == peer else a.copy() for r, a in enumerate(arrays)]
