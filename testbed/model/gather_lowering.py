"""Which of an action's parameter all-gathers a compiler lowers as all-reduces, and how its all-reduce combiner
merges them: the merges testbed.model.blocks issues where ``lowered_bytes`` (testbed.sim.xla.xla_tpu.
gather_allreduce_bytes: XLA:TPU over a whole slice) is set.

An all-gather of a buffer of at most ``lowered_bytes`` (its gathered bytes per device) is an all-reduce of the
zero-padded whole buffer (the same bytes), and the all-reduce combiner merges those within its bound
(``allreduce_bytes``; one over it alone), in the order the program issues them, as far as the program's
dependences let it (XLA's combiner merges no all-reduce with one it depends on):

- the forward's gathers read only the parameters: all of an action's merge, in issue order;
- the backward's: the head's alone (its gradient's all-reduce comes between it and the layers'), then the
  layers' gather sets two at a time (a set: a layer's gathers for its gradients, and before them, under full
  remat on XLA:TPU, for its recomputation): a layer's backward gather waits for the cotangent one piece ahead
  (testbed.runner.param_shards' link), so two sets at a time are independent.

Read from the recorded compiles (benchmarks/xla_tpu/): llama2k-fsdp64 (v5e 8x8, full remat) lowers the
attention's weights and the norms (8 MiB and less; ``mlp/*`` 21 MiB stay gathers) into one forward all-reduce
of 41.96 MB (both layers and the final norm), the head's norm's backward gather alone (4 KB) and each layer's
recomputation and gradient sets together (two of 41.96 MB); gpt2k-fsdp256-full (v5e 16x16) the same (25.3 MB
with the position table; 4 KB; two of 16.8 MB); llama1b-fsdp256-flash (16 layers, no remat) three forward
merges of 335.7 MB and eight backward ones of two layers each (41.96 MB); gpt2k-fsdp1024-full (v5p 8x8x16, any
size lowered) 10 all-reduces of its gathers: the forward's token table and head alone (over the 120 MiB bound)
and two merges of the rest, the backward's head norm and table, and each layer's two sets split by the bound.
Pure: no JAX.
"""

from __future__ import annotations

__all__ = ["Lowering", "NO_LOWERING", "LoweredMerge", "lowered_merges", "backward_segments", "lowers"]

import math
from typing import Hashable, NamedTuple


class Lowering(NamedTuple):
    """What a compiler lowers of an action's parameter gathers: each of at most ``nbytes`` (gathered bytes per
    device; 0: none) an all-reduce, and each of a rank-1 leaf whose shard per device is not a whole number of
    ``lanes`` elements (0: none; testbed.sim.xla.xla_tpu.vector_gather_lowers), merged within ``allreduce_bytes``
    (its all-reduce combiner's bound)."""

    nbytes: float = 0.0
    allreduce_bytes: float = math.inf
    lanes: int = 0

    @property
    def active(self) -> bool:
        """Whether any gather is lowered."""
        return bool(self.nbytes or self.lanes)


#: No gather lowered (every compiler but XLA:TPU over a whole slice).
NO_LOWERING = Lowering()


def lowers(nbytes: float, lowering: Lowering) -> bool:
    """Whether an all-gather of ``nbytes`` (gathered bytes per device) is one ``lowering`` makes an all-reduce: any
    lowering at all (``lowering.nbytes`` > 0) and at most its bound. The plan's gathers (:func:`lowered_merges`)
    and a traced program's (testbed.sim.xla.xla_tpu.lowered_gathers) are lowered by this one test."""
    return 0 < lowering.nbytes and nbytes <= lowering.nbytes


class LoweredMerge(NamedTuple):
    """One all-reduce the lowered gathers are merged into: its bytes and its members (indices of the gathers)."""

    nbytes: float
    members: tuple[int, ...]


def lowered_merges(sizes: list[float], segments: list[int], lowered_bytes: float,
                   allreduce_bytes: float, vectors: frozenset[int] = frozenset()) -> tuple[set[int], list[LoweredMerge]]:
    """(the gathers lowered, their merged all-reduces) of an action's gathers ``sizes`` (bytes each, in issue
    order) where ``segments[i]`` is what gather ``i`` may merge with (module docstring: one for the forward; the
    head's, then a pair of sets each, for the backward): each gather of at most ``lowered_bytes``, and each of
    ``vectors`` (rank-1 leaves :class:`Lowering`'s ``lanes`` lowers), an all-reduce, merged with the open merge of
    its segment while within ``allreduce_bytes`` (over it: alone)."""
    lowered = {i for i, n in enumerate(sizes) if i in vectors or lowers(n, Lowering(lowered_bytes, allreduce_bytes))}
    merges: list[LoweredMerge] = []
    open_: dict[int, int] = {}  # segment -> index of its open merge in ``merges``
    for i in sorted(lowered):
        n, seg = sizes[i], segments[i]
        if n > allreduce_bytes:
            merges.append(LoweredMerge(n, (i,)))
            continue
        k = open_.get(seg)
        if k is not None and merges[k].nbytes + n <= allreduce_bytes:
            merges[k] = LoweredMerge(merges[k].nbytes + n, merges[k].members + (i,))
        else:
            open_[seg] = len(merges)
            merges.append(LoweredMerge(n, (i,)))
    return lowered, merges


def backward_segments(sets: list[tuple[bool, Hashable]]) -> list[int]:
    """Per backward gather, its segment from ``sets`` (per gather: whether its piece is the head, and its gather
    set's index in backward order, module docstring): the head's 0, the layers' sets two at a time from 1."""
    order: dict[int, int] = {}
    out = []
    for head, s in sets:
        if head:
            out.append(0)
            continue
        order.setdefault(s, len(order))
        out.append(1 + order[s] // 2)
    return out
