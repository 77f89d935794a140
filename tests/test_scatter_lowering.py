"""XLA:TPU's reduce-scatters of weight gradients kept as all-reduces (testbed.model.scatter_lowering): the shard's
tiles by layout, as the recorded probes and plans show (benchmarks/xla_tpu_probes/scatter_shapes.json,
benchmarks/xla_tpu/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.model import layout
from testbed.model.scatter_lowering import lowered_matrix, lowered_shape
from testbed.plan.io import plan_from_dict

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("shape", "dim", "ways", "element_bytes", "lowered"), [
    ((1024, 512), 1, 4, 2, True),     # one 128-lane row of bf16 a device
    ((1024, 512), 1, 4, 4, False),    # fp32: whole tiles
    ((1024, 1024), 1, 4, 2, False),   # 256 lanes
    ((1024, 512), 1, 16, 2, False),   # 32 lanes: padded, still a reduce-scatter
    ((3, 1024), 1, 4, 2, True),       # few rows
    ((4, 4096), 1, 4, 4, True),
    ((5, 1024), 1, 4, 2, False),
    ((16, 1024), 0, 4, 2, True),      # 4 rows a device
    ((64, 2048), 0, 16, 2, True),
    ((128, 2048), 0, 16, 2, False),   # 8
    ((48, 1024), 0, 4, 2, False),     # 12
    ((1024, 4096), 0, 4, 2, False),   # a major split of whole tiles
])
def test_lowered_shapes(shape, dim, ways, element_bytes, lowered):
    assert lowered_shape(shape, dim, ways, element_bytes) is lowered


def test_a_column_major_gradient_swaps_its_lanes():
    """The head's gradient is laid out column-major: its dim 0 is the lanes."""
    assert lowered_shape((2048, 8000), 0, 16, 2, column_major=True)
    assert not lowered_shape((2048, 8000), 0, 16, 2)


def _lowered(name: str) -> set[str]:
    plan = plan_from_dict(json.loads((ROOT / "benchmarks" / "xla_tpu" / f"{name}.json").read_text())["plan"])
    params = (*layout.embedding_params(plan.model), *layout.layer_params(plan.model, 0), *layout.head_params(plan.model))
    return {q.name for q in params if lowered_matrix(q, plan.mesh, plan.mesh.fsdp, plan.precision.compute_bytes)}


def test_the_recorded_plans_matrices():
    """gpt2k-fsdp16-tensor4-sp over 16 of a v5e 8x8's chips: the token table's, ``attn/wo``'s and ``mlp/w2``'s
    shards are one 128-lane column of their tensor shard, the head's one 128-lane row of its column-major gradient
    (the compiled step all-reduces the four, merged with the norms'); gpt1k-fsdp4-full: ``attn/bqkv``'s three rows;
    llama2k-fsdp4-fp32 (fp32): none."""
    assert _lowered("gpt2k-fsdp16-tensor4-sp") == {"embed/tokens", "layers/attn/wo", "layers/mlp/w2", "head/w"}
    assert _lowered("gpt1k-fsdp4-full") == {"layers/attn/bqkv"}
    assert _lowered("llama2k-fsdp4-fp32") == set()
