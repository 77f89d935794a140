"""What XLA:TPU does to a step's collectives that the plan's own program does not say: rules keyed by the compiler.

Each rule holds where the topology's device follows XLA:TPU (``device.buffer_rules: xla-tpu``) and is read from
XLA:TPU's own compiles (libtpu 0.0.42): the probes of benchmarks/xla_tpu_probes/collectives.json and the recorded
plans of benchmarks/xla_tpu/ (testbed.compiled.compare sets the task graph's collectives beside theirs).

- **A reduce-scatter over a whole slice is an all-reduce** (:func:`scatters_as_allreduce`): the probes' reduce-scatters
  over every chip of a v5e 4x4 or 8x8 slice (a 1-D or a 2-D mesh) and of a v5p 2x2x2 slice compile to all-reduces
  of the whole buffer (the same bytes per device), merged by the all-reduce combiner (four 16 MiB inputs over 16 chips
  into one; four 64 MiB inputs over 64 chips not); over part of a slice (4 or 8 of 16 chips, 16 of 64) and over
  every chip of a v5e 2x4 slice they stay reduce-scatters (a v5e 2x2 slice's choice depends on the operand: not
  modelled). The recorded fsdp plans over a whole slice agree: llama2k-fsdp8 (v5p 2x2x2), gpt2k-fsdp16-full
  (v5e 4x4), llama2k-fsdp64 (v5e 8x8), gpt2k-fsdp256-full and llama1b-fsdp256-flash (v5e 16x16),
  gpt2k-fsdp1024-full (v5p 8x8x16) reduce no gradient by a reduce-scatter, and llama2k-fsdp8's and
  gpt2k-fsdp16-full's four gradient all-reduces are their leaves merged within the combiner's 120 MiB.
- **Full remat gathers a layer's weights for its recomputation too** (:func:`regathers_for_recompute`): under
  ``remat: full`` the backward of a layer gathers the leaves its recomputed forward reads, apart from the gathers
  of the leaves its gradients read: every leaf of the layer but the MLP's output projection (``mlp/w2``,
  ``mlp/b2``), whose output only joins the residual sum (the recomputation stops before it). gpt1k-fsdp4-full and
  gpt2k-fsdp16-full: 63 fsdp all-gathers, 10 a layer more than the forward's and the backward's (the norms'
  scales and shifts, ``attn/*``, ``mlp/w1``, ``mlp/b1``); llama4k-fsdp256-tensor4 and llama4k-fsdp64-tensor4-sp:
  ``attn/wq``, ``attn/wkv``, ``attn/wo``, ``mlp/w1`` and ``mlp/w3`` once more a layer.

Pure: no JAX.
"""

from __future__ import annotations

import math
from dataclasses import replace

from testbed.model.leaves import RECOMPUTE_SKIPS
from testbed.plan.spec import MeshSpec
from testbed.topology.parts import Form, LinkKind
from testbed.topology.spec import Topology

__all__ = ["scatters_as_allreduce", "lowered_reductions", "merges_loss", "regathers_for_recompute",
           "RECOMPUTE_SKIPS"]

def scatters_as_allreduce(topology: Topology) -> bool:
    """Whether a reduce-scatter over every device of ``topology`` compiles to an all-reduce (module docstring): an
    XLA:TPU slice (one torus of ICI links) of a 3-D torus, or of 2-D one whose every dim spans 4+ chips."""
    if topology.device.buffer_rules != "xla-tpu" or topology.form is not Form.TORUS:
        return False
    levels = topology.levels
    if any(level.switched or level.kind is not LinkKind.ICI for level in levels):
        return False
    dims = [level.size for level in levels if level.size > 1]
    return len(dims) >= 3 or (len(dims) == 2 and min(dims) >= 4)


def lowered_reductions(reductions: tuple, mesh: MeshSpec, whole_slice: bool) -> tuple:
    """``reductions`` (testbed.sim.update_facts.Reduction) with ``scatter_op`` ``all_reduce`` where
    ``whole_slice`` (:func:`scatters_as_allreduce` of the topology) and the reduce-scatter spans every device of
    the mesh."""
    if not whole_slice:
        return reductions
    return tuple(replace(r, scatter_op="all_reduce")
                 if r.sharded and math.prod(mesh.degree(a) for a in r.sharded) == mesh.size else r
                 for r in reductions)


def merges_loss(reductions: tuple) -> bool:
    """Whether the dense gradients' sum is one all-reduce over the axes the loss sums over (:func:`lowered_reductions`:
    a whole slice's reduce-scatter, nothing summed after it), which the combiner lets an fp32 loss join
    (testbed.plan.sharding.loss_merged; llama2k-fsdp16-fp32-selective: the loss's 4 bytes in a gradient all-reduce)."""
    return any(r.scatter_op == "all_reduce" and not r.rest and not (r.expert or r.sequence) for r in reductions)


def regathers_for_recompute(topology: Topology) -> bool:
    """Whether a full-remat layer's backward gathers the leaves its recomputation reads apart from its gradients'
    (module docstring): XLA:TPU's rule."""
    return topology.device.buffer_rules == "xla-tpu"
