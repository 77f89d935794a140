"""Which row-split gradient reduce-scatters XLA:TPU keeps as all-reduces over 256 of a v5p 8x8x16's chips, by the
gradient's width: probed by deviceless compiles (recorded), against testbed.model.scatter_lowering's tile rule.

The recorded plan llama4k-fsdp256-tensor4 (fsdp 256 x tensor 4 on a v5p 8x8x16) has its large weight gradients
all-reduced whole (benchmarks/xla_tpu/), where the tile rule (a sublane split of more than 4 rows a device stays a
reduce-scatter) says reduce-scatters. ``--collect`` (libtpu needed; about a second a probe) compiles the
scatter-shapes probe (benchmarks/xla_tpu_scatter_shapes.py's ``_compile``: ``x.T @ dy`` reduce-scattered along dim
0) of a bf16 gradient ``[256 r, 128 t]``, ``r`` rows a device (16, 32, 64) and ``t`` 128-lane columns (1 to 32),
over the fsdp axis of that plan's mesh, and at 16 rows a device over groups of 64, 128 and 512 of the slice's
chips too (meshes of 64 x 16, 128 x 8, 512 x 2), and records the compiled reductions as
``benchmarks/xla_tpu_probes/scatter_lanes.json`` with the date, the versions and the command. Pass dumps
(``--xla_dump_hlo_pass_re``) show the kept all-reduces as the work of XLA:TPU's reduce-scatter decomposer, which
leaves the others native.

Without ``--collect`` it reads that record (no JAX) and prints ONE JSON object: per group and rows a device, the
widths ``t`` XLA:TPU all-reduces, and the tile rule's confusion counts over the probes. The widths depend on the
group without an order a size or divisibility predicate gives (16 rows a device: over 512 chips every width but the
3-smooth ones, over 64 only 27, 29 and 31).

    PYTHONPATH=<libtpu site>:. python benchmarks/xla_tpu_scatter_lanes.py --collect
    python benchmarks/xla_tpu_scatter_lanes.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from xla_tpu_collectives import probe_main, record_probes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "xla_tpu_probes" / "scatter_lanes.json"
#: The slice, the mesh (fsdp x tensor, llama4k-fsdp256-tensor4's) and the axis reduced over.
SLICE, MESH, AXIS = "v5p:8x8x16", (256, 4), 0
#: Rows a device and 128-lane columns of the probed gradients.
ROWS, WIDTHS = (16, 32, 64), tuple(range(1, 33))
#: The other meshes (the axis reduced over first) probed at 16 rows a device.
GROUPS = ((64, 16), (128, 8), (512, 2))
LANES = 128


def collect() -> dict:
    from xla_tpu_scatter_shapes import _compile

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    probes = []
    for mesh, r in [(MESH, r) for r in ROWS] + [(mesh, ROWS[0]) for mesh in GROUPS]:
        for t in WIDTHS:
            rows, cols = mesh[AXIS] * r, LANES * t
            compiled = _compile(SLICE, mesh, AXIS, [("lanes", rows, cols, 0, 2)])
            probes.append({"slice": SLICE, "mesh": "x".join(map(str, mesh)), "group": mesh[AXIS], "rows": rows,
                           "cols": cols, "dim": 0, "bytes": 2, "compiled": compiled})
    return record_probes(DATA, "python benchmarks/xla_tpu_scatter_lanes.py --collect", probes)


def compare(record: dict) -> dict:
    """Per rows a device and group, the widths (128-lane columns) all-reduced; the tile rule's confusion counts
    (``tp``: all-reduced and said so)."""
    from testbed.model.scatter_lowering import lowered_shape

    widths: dict[str, list[int]] = {}
    confusion = {"tp": 0, "fp": 0, "fn": 0, "tn": 0}
    for p in record["probes"]:
        lowered = any(c["kind"] == "all-reduce" for c in p["compiled"])
        said = lowered_shape((p["rows"], p["cols"]), p["dim"], p["group"], p["bytes"])
        confusion[("t" if said == lowered else "f") + ("p" if said else "n")] += 1
        row = widths.setdefault(f"{p['rows'] // p['group']} rows over {p['group']}", [])
        if lowered:
            row.append(p["cols"] // LANES)
    return {"date": record["date"], "versions": record["versions"], "probes": len(record["probes"]),
            "all_reduced_widths": widths, "tile_rule": confusion}


def main(argv: list[str] | None = None) -> int:
    return probe_main(argv, __doc__, DATA, collect, compare)


if __name__ == "__main__":
    raise SystemExit(main())
