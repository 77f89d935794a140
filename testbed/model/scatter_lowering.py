"""Which weight matrices' gradient reduce-scatters XLA:TPU compiles to all-reduces: the shard's tile, by layout.

XLA:TPU's reduce-scatter decomposer (after layout assignment) rewrites a reduce-scatter as an all-reduce of the
whole buffer and a dynamic-slice; where the all-reduce-scatter fusion takes the pair back it is emitted as one
reduce-scatter (testbed.runner.hlo_schedule), else it stays an all-reduce, which the all-reduce combiner merges
with the rank-1 gradients' (testbed.model.block_scatters: one all-reduce at the backward's end). It stays an
all-reduce where the shard is not whole tiles of the layout's two minor dims (libtpu 0.0.42's deviceless
compiles, ``benchmarks/xla_tpu_scatter_shapes.py``'s grid and row probes over v5e 2x2, v5p 4x4x4 and v5e 8x8
slices, ``benchmarks/xla_tpu_probes/scatter_shapes.json``):

- split along the layout's minor dim (the lanes): a bf16 shard of exactly one 128-lane row
  (``[1024, 512]`` over 4 chips, ``[R, 1024]`` over 8, ``[R, 2048]`` over 16; fp32 and 256+ lanes stay
  reduce-scatters), or any shard of at most :data:`FEW_ROWS` rows in the second-minor dim (``[3, 1024]``,
  ``[4, 2048]``; 5 rows and more stay);
- split along the second-minor dim (the sublanes): a shard of at most :data:`FEW_SHARD_ROWS` rows
  (``[16, 1024]`` over 4 chips, ``[32, 2048]`` over 8, ``[64, 2048]`` over 16; 8 rows stay over 8 and 16 chips,
  12 and 16 over 4; over 4 chips 8 rows are all-reduced too, bf16 and fp32, the rule's two misses of 230 probes).

Read as a classifier over the probes the benchmark prints its confusion counts (``predicates``, ``tiles``).

A weight's gradient is laid out row-major (its last dim minor) but the head's: its gradient ``h^T @ dlogits`` is
laid out column-major (``bf16[1024,32000]{0,1}`` in the recorded compiles of benchmarks/xla_tpu/), so its
model dim is the lanes. These are the rules of a reduce-scatter over part of a slice or a whole v5e 2x2 one; over
every chip of a larger slice each is an all-reduce anyway (testbed.sim.xla.xla_tpu.scatters_as_allreduce).
The merge with the rank-1 gradients is one all-reduce whatever its size, where XLA's combiner would split one over
its 120 MiB bound (the recorded ones stay under it: gpt2k-fsdp16-tensor4-sp's 86.6 MB). Pure.
"""

from __future__ import annotations

from testbed.model.flash_kernel import LANES
from testbed.model.param_spec import ParamSpec
from testbed.plan.spec import MeshSpec

__all__ = ["lowered_matrix", "lowered_shape", "LANES", "FEW_ROWS", "FEW_SHARD_ROWS", "COLUMN_MAJOR"]

#: The most second-minor rows a lane-split shard has that is all-reduced (4 and under in the probes; 5 stays).
FEW_ROWS = 4
#: The most rows a sublane-split shard has that is all-reduced (4 in the probes over 4, 8 and 16 chips; 8 stay over
#: 8 and 16, not over 4).
FEW_SHARD_ROWS = 4
#: The leaves whose gradient XLA:TPU lays out column-major (the head's ``h^T @ dlogits``).
COLUMN_MAJOR = frozenset({"head/w"})


def lowered_matrix(q: ParamSpec, mesh: MeshSpec, ways: int, element_bytes: float) -> bool:
    """Whether ``q``'s gradient (``element_bytes`` a value), reduce-scattered ``ways`` ways along its fsdp shard dim
    (ParamSpec.shard_dim on its shape under tensor and expert parallelism), is an all-reduce (module docstring).
    Rank-1 and flat-padded leaves are testbed.model.block_scatters' own rule; False for them."""
    if ways <= 1 or len(q.shape) < 2:
        return False
    dim = q.shard_dim(mesh.tensor, ways, mesh.expert, mesh.expert_tensor)
    if dim is None:
        return False
    local = list(q.shape)
    for d, degree, _ in q.splits(mesh.tensor, mesh.expert, mesh.expert_tensor):
        local[d] //= degree
    return lowered_shape(tuple(local), dim, ways, element_bytes, q.name in COLUMN_MAJOR)


def lowered_shape(shape: tuple[int, ...], dim: int, ways: int, element_bytes: float,
                  column_major: bool = False) -> bool:
    """Whether a reduce-scatter of a ``shape`` buffer (rank 2+, ``element_bytes`` a value) ``ways`` ways along
    ``dim`` is an all-reduce (module docstring); laid out row-major, or ``column_major`` (its last two dims
    swapped in the layout)."""
    order = list(range(len(shape)))  # dims from major to minor
    if column_major:
        order[-2:] = order[-1], order[-2]
    minor, second = order[-1], order[-2]
    if dim == minor:
        return (element_bytes == 2 and shape[dim] // ways == LANES) or shape[second] <= FEW_ROWS
    return dim == second and shape[dim] // ways <= FEW_SHARD_ROWS
