"""The gradient reduce-scatter probes (benchmarks/xla_tpu_scatter_shapes.py, recorded deviceless compiles): which
reduce-scatters XLA:TPU keeps as all-reduces, read as testbed.runner.hlo_schedule reads a step (an all-reduce-scatter
fusion a reduce-scatter), against testbed.model.scatter_lowering's rule."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from helpers import benchmark_module

ROOT = Path(__file__).resolve().parent.parent
RECORD = json.loads((ROOT / "benchmarks" / "xla_tpu_probes" / "scatter_shapes.json").read_text())
#: Bytes of a buffer above which an all-reduce is a matrix's (the vectors' and the loss's are KiBs).
MATRIX_BYTES = 2 ** 20


def _benchmark():
    return benchmark_module("xla_tpu_scatter_shapes")


def _bytes(shape: str) -> int:
    """Bytes of one compiled buffer's shape (``bf16[4224,1024]{...}``; a tuple's first)."""
    dtype, dims = re.search(r"(bf16|f32)\[([\d,]+)\]", shape).groups()
    return math.prod(int(x) for x in dims.split(",")) * (2 if dtype == "bf16" else 4)


def _grid() -> list[dict]:
    return [p for p in RECORD["probes"] if "plan" not in p]


def _lowered(p: dict) -> bool:
    return any(c["kind"] == "all-reduce" for c in p["compiled"])


def test_probes_are_recorded_with_their_provenance():
    module = _benchmark()
    grid = [p for p in _grid() if p.get("set") != "rows"]
    assert RECORD["versions"]["libtpu"] and RECORD["command"].endswith("--collect")
    expected = sum(1 for s in module.MESHES for *_, b in module.GRID if b == 2 or s == "v5e:2x2")
    assert len(grid) == expected and all(p["compiled"] for p in RECORD["probes"])
    assert len([p for p in _grid() if p.get("set") == "rows"]) == len(module.ROWS)


def test_an_all_reduce_scatter_fusion_is_a_reduce_scatter_not_an_all_reduce():
    """Over a whole v5e 2x2 slice a ``[4096, 1024]`` bf16 gradient split along its rows compiles to an all-reduce-scatter
    fusion (a reduce-scatter, padded), where ``[1024, 512]`` split along its columns (one 128-lane row a device) is an
    all-reduce and in fp32 a reduce-scatter."""
    def probe(rows: int, cols: int, dim: int, nbytes: int) -> dict:
        return next(p for p in _grid() if p["slice"] == "v5e:2x2" and
                    (p["rows"], p["cols"], p["dim"], p["bytes"]) == (rows, cols, dim, nbytes))
    fused = probe(4096, 1024, 0, 2)
    assert not _lowered(fused) and any(c["fused"] for c in fused["compiled"])
    assert _lowered(probe(1024, 512, 1, 2)) and not _lowered(probe(1024, 512, 1, 4))


def test_a_column_split_not_whole_lanes_is_laid_out_split_major():
    """A gradient split along its columns whose shard is not whole 128-lane rows is compiled column-major
    (layout ``{0,1}``: the split dim major, as a row split is), one whose shard is whole rows row-major."""
    module = _benchmark()
    for p in (p for p in _grid() if p["dim"] == 1 and p["rows"] >= 1024):
        layout = re.search(r"\{([\d,]+)", p["compiled"][0]["shape"]).group(1)
        major = module.split_layout(p["rows"], p["cols"], p["dim"], p["group"])[0]
        assert layout == ("0,1" if major else "1,0"), p


def test_the_tiles_rule_explains_every_probe_but_two():
    """testbed.model.scatter_lowering's rule (``tiles``) says which reduce-scatter stays an all-reduce on every probe
    of the grid and the few-row shapes over the three slices but the 8-row sublane shards over 4 chips (bf16 and
    fp32: all-reduced, where over 8 and 16 chips 8 rows stay reduce-scatters); the 128-lane rule alone misses the
    few-row ones."""
    from testbed.model.scatter_lowering import lowered_shape

    result = _benchmark().classify(RECORD)
    tiles, lanes = result["tiles"]["all"], result["lanes"]["all"]
    assert tiles["tp"] + tiles["fp"] + tiles["fn"] + tiles["tn"] == len(_grid())
    missed = {(p["slice"], p["rows"], p["cols"], p["dim"], p["bytes"]) for p in _grid()
              if lowered_shape((p["rows"], p["cols"]), p["dim"], p["group"], p["bytes"]) != _lowered(p)}
    assert missed == {("v5e:2x2", 32, 1024, 0, 2), ("v5e:2x2", 32, 1024, 0, 4)}
    assert lanes["fn"] > tiles["fn"] and lanes["fp"] == 0
