"""The collective library of CPU hosts across a network: gloo, and the algorithm it runs for each op.

A JAX job of several CPU processes runs its cross-process collectives through
XLA:CPU's gloo communicator (openxla/xla
``xla/backends/cpu/collectives/gloo_communicator.cc``), which fixes the
algorithm per op rather than choosing one by size or topology:

- all-reduce: ``gloo::allreduce`` with ``AllreduceOptions::Algorithm::RING``
  (``gloo/allreduce.cc``: a ring reduce-scatter then a ring all-gather over
  the ranks in order, every rank sending to rank - 1, each rank's chunk cut
  into two or more segments so one is on the wire while the other is
  reduced);
- all-gather: ``gloo::allgather``, a ring (``gloo/allgather.cc``);
- reduce-scatter: ``gloo::ReduceScatterHalvingDoubling`` (``gloo/reduce_scatter.h``;
  XLA's ``GlooCommunicator::ReduceScatter`` copies the input to a temporary
  buffer and runs it with every rank receiving an equal block), which is not
  the textbook recursive halving (``halving_doubling``, farthest partner
  first): it exchanges with the nearest partner first (rank ^ 1, then ^ 2,
  ^ 4, ...; "sending large messages to nearby ranks"), halving the data each
  step (S/2, S/4, ...), so each rank ends holding the block of its
  bit-reversed rank, and a last *distribution* step sends every block to its
  rank (rank r to bitrev(r), where they differ). On 8 ranks: 3 halving steps
  and the distribution, 4 rounds, each a single send waited for (then
  the reduction and a notification), so a round's host cost adds to its wire.
  :func:`gloo_reduce_scatter` is that program (``gloo_halving_doubling``);
  on 4 nodes x 2 devices its first step stays inside each node and 7/8 S
  crosses each node's link (the textbook order sends 3/2 S across).

Ranks are the job's devices in order, so on a cluster of nodes a ring crosses
each node's link once each way, whatever faster algorithm the topology would
allow (the simulator's ``hierarchical`` moves 1.5 S over each node's link of
a 4 x 2 cluster's all-reduce where gloo's ring moves 1.75 S). The simulator
prices that algorithm where gloo runs (:func:`gloo_algorithm`), as it prices
NCCL's own choice on an NVIDIA GPU hierarchy (:mod:`testbed.collectives.nccl`).

Where gloo runs: a levels topology whose innermost level is ``host`` (CPU
devices, a process's ranks talking over its loopback) under one or more
network levels (Ethernet, InfiniBand, DCN: processes on separate nodes).
One process on its own (``host-cpu-8``: no network level) uses XLA's
in-process collectives instead, and the simulator picks its fastest.

How a round's host cost meets its wire (:func:`gloo_pipelined`): both rings
keep two sends in flight. ``gloo/allreduce.cc`` cuts each rank's chunk into
two or more segments ("we split up a chunk into multiple segments (>= 2),
and ensure we have one segment in flight while computing a reduction on the
other"; segments of at most ``kMaxSegmentSize`` = 1 MiB, ``gloo/allreduce.h``,
which XLA:CPU leaves as is), and ``gloo/allgather.cc`` sends each chunk as
two halves, waiting only on the next-to-last operation. So while a rank does
its host work for one segment (the wake-up, the reduction, the next send)
the other is on the wire: a round takes the longer of the two, not their
sum. The simulator prices gloo's own ring that way, each round ``max(host
cost, wire)`` (``collectives.overhead_s`` being the host cost of a round,
:func:`round_s`), where the calibration's per-round cost was fitted in that
form (``collectives.rounds_overlap``: an emulated cluster's topology and
``calibrate --cluster``; the linear fits of ``calibrate --processes`` assume
the sum, and keep it). Counted in segments the ring has twice the rounds at half
the wire each (``max(o/2, w/2)`` twice is ``max(o, w)``); above 16 MiB an
all-reduce has more segments than two per rank, each a full 1 MiB, whose wire
outlasts any host cost measured (tens of microseconds to a millisecond), so
the round form holds at every size. Every other algorithm, and reduce-scatter
(``ReduceScatterHalvingDoubling``, one exchange per step), adds the two.
"""

from __future__ import annotations

from testbed.collectives.lines import Rounds, transfer
from testbed.collectives.ops import Op, parse_op
from testbed.topology import Topology
from testbed.topology.parts import Form, LinkKind

__all__ = ["GLOO_ALGORITHMS", "NETWORK_KINDS", "PIPELINED_OPS", "gloo_runs", "gloo_algorithm", "gloo_pipelined",
           "round_s", "gloo_reduce_scatter", "bit_reversed"]

#: The algorithm gloo runs for each op, as XLA:CPU calls it (the module's docstring has the sources).
GLOO_ALGORITHMS: dict[str, str] = {"all_reduce": "ring", "all_gather": "ring",
                                   "reduce_scatter": "gloo_halving_doubling"}
#: The ops whose gloo algorithm keeps two segments in flight (the module's docstring has the sources).
PIPELINED_OPS = frozenset({"all_reduce", "all_gather"})
#: Link kinds that are a network between nodes; all others are inside a node.
NETWORK_KINDS = frozenset({LinkKind.ETHERNET, LinkKind.INFINIBAND, LinkKind.DCN})


def gloo_runs(topology: Topology) -> bool:
    """Whether a job on ``topology`` runs its collectives through gloo: CPU hosts (an innermost ``host``
    level) joined by a network level."""
    if topology.form is not Form.LEVELS or not topology.levels:
        return False
    levels = topology.levels
    return levels[0].kind is LinkKind.HOST and any(level.kind in NETWORK_KINDS for level in levels[1:])


def gloo_algorithm(topology: Topology, op: Op | str) -> str | None:
    """The algorithm gloo runs for ``op`` on ``topology``, or None where gloo does not run it (another
    library, or an op XLA:CPU does not hand to one of gloo's algorithms: all-to-all, send)."""
    if not gloo_runs(topology):
        return None
    return GLOO_ALGORITHMS.get(str(parse_op(op)))


def gloo_pipelined(topology: Topology, op: Op | str, algorithm: str) -> bool:
    """Whether ``algorithm`` for ``op`` on ``topology`` is gloo's own two-in-flight ring priced so: its rounds
    last the longer of their host cost and their wire (:func:`round_s`) rather than the sum, where the
    topology's calibration was fitted in that form (``calibration.collectives.rounds_overlap``, set by
    ``calibrate --cluster``; a linear fit's per-round cost stays added)."""
    if not topology.calibration.collectives.rounds_overlap:
        return False
    name = str(parse_op(op))
    return name in PIPELINED_OPS and algorithm == gloo_algorithm(topology, name)


def round_s(wire_s: float, overhead_s: float, pipelined: bool) -> float:
    """One round of a collective: its wire (latency and bytes) and the host's cost of a round
    (``collectives.overhead_s``), overlapped where the algorithm keeps a segment in flight while the host works
    (``pipelined``, :func:`gloo_pipelined`), else added."""
    return max(wire_s, overhead_s) if pipelined else wire_s + overhead_s


def bit_reversed(value: int, bits: int) -> int:
    """``value``'s lowest ``bits`` bits in reverse order (gloo's ``reverseLastNBits``)."""
    return int(format(value, f"0{bits}b")[::-1], 2) if bits else 0


def gloo_reduce_scatter(n: int) -> tuple[int, Rounds]:
    """(pieces, rounds) of gloo's ``ReduceScatterHalvingDoubling`` on ``n`` ranks, ``n`` a power of two (the
    module's docstring): step k exchanges with rank ^ 2^k the half of what it still reduces that the partner's
    side ends with (rank r ends with block bitrev(r)), then each block goes to its own rank. Chunk c is block c."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"gloo's halving-doubling program is modelled for a power-of-two number of ranks, got {n}")
    bits = n.bit_length() - 1
    holder = [bit_reversed(c, bits) for c in range(n)]  # who holds block c at the end of the halving steps
    held = [set(range(n)) for _ in range(n)]
    rounds: Rounds = []
    for k in range(bits):
        d = 1 << k
        round_ = []
        for r in range(n):
            give = sorted(c for c in held[r] if holder[c] & d == (r ^ d) & d)
            round_.extend(transfer(r, r ^ d, c, True) for c in give)
            held[r] -= set(give)
        rounds.append(round_)
    spread = [transfer(r, holder[r], holder[r], False) for r in range(n) if holder[r] != r]
    return 1, rounds + ([spread] if spread else [])
