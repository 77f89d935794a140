"""Which gradient reduce-scatters of matrices XLA:TPU keeps as all-reduces, probed by deviceless compiles (recorded).

XLA:TPU's reduce-scatter decomposer rewrites a reduce-scatter as an all-reduce and a dynamic-slice; the all-reduce
scatter fusion emits most of those as one reduce-scatter again (padded, with collective-permutes completing the
shards), and the rest stay all-reduces (testbed.runner.hlo_schedule reads the fusion as the reduce-scatter it is).
``--collect`` (libtpu needed; about a second a probe) compiles the smallest program that reproduces the choice for
TPU slices without their chips (``jax.experimental.topologies.get_topology_desc``): a weight gradient, ``x.T @ dy``
of token-sharded ``x [tokens, R]`` and ``dy [tokens, C]``, reduce-scattered over a mesh axis along dim ``d``
(``jax.lax.psum_scatter``, as testbed.runner.param_shards reduces a gradient), for a grid of shapes and dtypes, for
few-row shapes (:data:`ROWS`), and for each recorded fsdp plan its matrices' gradients (their local shapes under
tensor parallelism, split along the fsdp shard dim: testbed.model.param_spec.shard_dim) in one program. It records,
per probe, each compiled reduction as the step's reader sees it (kind, the shape as compiled, whether an
all-reduce-scatter fusion) as ``benchmarks/xla_tpu_probes/scatter_shapes.json`` with the date, the versions and the
command.

Without ``--collect`` it reads that record (no JAX) and prints ONE JSON object: per slice and group, the probed
shapes XLA:TPU keeps as all-reduces (and how many compiled to fusions), per recorded plan the matrices its program
all-reduces, and ``predicates``: candidate predicates over the shard's shape, layout and dtype (:func:`candidates`)
as classifiers over the probes (confusion counts), ``tiles`` among them the rule testbed models
(testbed.model.scatter_lowering).

    PYTHONPATH=<libtpu site>:. python benchmarks/xla_tpu_scatter_shapes.py --collect
    python benchmarks/xla_tpu_scatter_shapes.py
"""

from __future__ import annotations

import itertools
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from xla_tpu_collectives import probe_main, record_probes  # noqa: E402

from testbed.model.scatter_lowering import LANES  # noqa: E402  (a tile's minor extent)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "xla_tpu_probes" / "scatter_shapes.json"
#: (slice, mesh shape, the axis reduced over: the mesh's last, consecutive devices).
MESHES = {"v5e:2x2": (4,), "v5p:4x4x4": (8, 8), "v5e:8x8": (4, 16)}
#: The grid: rows R, columns C, the split dim, bytes per element (fp32 on the 2x2 slice only).
GRID = [(r, c, d, b) for r, c, d, b in itertools.product((1024, 2048, 3072, 4096, 5376, 8192), (512, 1024, 2048, 4096),
                                                           (0, 1), (2, 4))]
#: The rows probes (slice, rows R, columns C, the split dim, bytes per element): shards of few rows, split along the
#: lanes (dim 1) and along the sublanes (dim 0), where the tiles run out (testbed.model.scatter_lowering).
ROWS = ([("v5e:2x2", r, 1024, 1, b) for r in (1, 2, 3, 4, 5, 6, 8) for b in (2, 4)]
        + [("v5e:2x2", r, 1024, 0, b) for r in (16, 32, 48, 64) for b in (2, 4)]
        + [(s, r, 2048, 1, 2) for s in ("v5p:4x4x4", "v5e:8x8") for r in (3, 4, 5, 8)]
        + [(s, MESHES[s][-1] * k, 2048, 0, 2) for s in ("v5p:4x4x4", "v5e:8x8") for k in (4, 8, 12, 16)])
#: Rows of the contraction (tokens) each device holds; the choice does not depend on it (probed 512 to 8192).
TOKENS = 2048
_FOUND = re.compile(r"=\s*(\S+)\s.*?\b(all-reduce|reduce-scatter|collective-permute)(-start)?\(")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_SHAPE = re.compile(r"=\s*(\S+)\s")


def _compile(slice_: str, shape: tuple[int, ...], axis: int, mats: list) -> list[dict]:
    """Compile one program of the gradients ``mats`` ((R, C, dim, bytes each) each) reduce-scattered over mesh axis
    ``axis`` of a mesh of ``shape`` (the slice's devices in id order) on ``slice_``; the compiled reductions (kind,
    the shape as compiled)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, PartitionSpec as P

    devices = sorted(topologies.get_topology_desc(topology_name=slice_, platform="tpu").devices, key=lambda d: d.id)
    names = tuple("a" if i == axis else f"m{i}" for i in range(len(shape)))
    mesh = Mesh(np.array(devices).reshape(shape), names)
    n = mesh.shape["a"]

    def body(*xs):
        return tuple(jax.lax.psum_scatter(x.T @ y, "a", scatter_dimension=d, tiled=True)
                     for (*_, d, _), x, y in zip(mats, xs[0::2], xs[1::2]))

    args = [jax.ShapeDtypeStruct((TOKENS * n, k), jnp.bfloat16 if b == 2 else jnp.float32)
            for *_, r, c, _, b in mats for k in (r, c)]
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("a"),) * len(args),
                           out_specs=tuple(P("a") if d == 0 else P(None, "a") for *_, d, _ in mats), check_vma=False)
    text = jax.jit(mapped).lower(*args).compile().as_text()
    return compiled_reductions(text, mesh.devices.shape, mesh.axis_names)


def compiled_reductions(text: str, shape: tuple[int, ...], names: tuple[str, ...]) -> list[dict]:
    """The reductions of a compiled probe as testbed.runner.hlo_schedule reads them (an all-reduce-scatter fusion a
    reduce-scatter, ``fused``; its fix-up permutes left out): kind, the instruction's shape as compiled."""
    from testbed.runner import hlo_schedule

    lines = {}
    for comp in hlo_schedule.computations(text).values():
        for line in comp.lines:
            if (name := _NAME.match(line)) is not None:
                lines[name.group(1)] = line
    out = []
    for c in hlo_schedule.collectives(text, tuple(shape), tuple(names)):
        if c.fixes is None:
            fused = c.kind == "reduce-scatter" and not _FOUND.search(lines.get(c.name, ""))
            out.append({"kind": c.kind, "shape": _SHAPE.search(lines.get(c.name, "")).group(1), "fused": fused})
    return out


def plan_matrices() -> dict[str, tuple[str, tuple[int, ...], int, list]]:
    """Per recorded fsdp plan over part of a slice or a whole 2x2 one: its slice, its mesh's shape (the axes of
    degree 2+ in mesh order), the fsdp axis's index and its matrices' gradients as (name, R, C, dim, bytes) (local
    shapes under tensor parallelism; a rank-3 leaf as the matrix of its dims up to the shard dim and the rest)."""
    import math

    sys.path.insert(0, str(ROOT))
    from memory_vs_xla_tpu import _plans
    from testbed.model import layout
    from testbed.plan.io import plan_from_dict
    from testbed.plan.spec import MESH_AXES, Axis

    out = {}
    for entry in _plans():
        plan = plan_from_dict(entry["plan"])
        ways, t = plan.mesh.fsdp, plan.mesh.tensor
        slice_ = entry["target"].split(":", 1)[1]
        if ways < 2 or plan.mesh.stage > 1 or (ways == plan.mesh.size and slice_ != "v5e:2x2"):
            continue
        mats = []
        for p in (*layout.embedding_params(plan.model), *layout.layer_params(plan.model, 0),
                  *layout.head_params(plan.model)):
            dim = p.shard_dim(t, ways)
            if len(p.shape) < 2 or dim is None:
                continue
            local = [n // (t if i in p.tensor_dims(t) else 1) for i, n in enumerate(p.shape)]
            rows = local[0] if dim == 0 else math.prod(local[:dim])
            mats.append((p.name, rows, math.prod(local) // rows, 0 if dim == 0 else 1, plan.precision.compute_bytes))
        axes = [a for a in MESH_AXES if plan.mesh.degree(a) > 1]
        out[plan.name] = (slice_, tuple(plan.mesh.degree(a) for a in axes), axes.index(Axis.FSDP), mats)
    return out


def collect() -> dict:
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    probes = []
    for slice_, shape in MESHES.items():
        for r, c, d, b in GRID:
            if b == 4 and slice_ != "v5e:2x2":
                continue
            compiled = _compile(slice_, shape, len(shape) - 1, [("grid", r, c, d, b)])
            probes.append({"slice": slice_, "mesh": "x".join(map(str, shape)), "group": shape[-1], "rows": r,
                           "cols": c, "dim": d, "bytes": b, "compiled": compiled})
    for slice_, r, c, d, b in ROWS:
        shape = MESHES[slice_]
        compiled = _compile(slice_, shape, len(shape) - 1, [("rows", r, c, d, b)])
        probes.append({"slice": slice_, "mesh": "x".join(map(str, shape)), "group": shape[-1], "rows": r,
                       "cols": c, "dim": d, "bytes": b, "compiled": compiled, "set": "rows"})
    for name, (slice_, shape, axis, mats) in plan_matrices().items():
        probes.append({"plan": name, "slice": slice_, "mesh": "x".join(map(str, shape)), "group": shape[axis],
                       "matrices": mats, "compiled": _compile(slice_, shape, axis, mats)})
    return record_probes(DATA, "python benchmarks/xla_tpu_scatter_shapes.py --collect", probes)


def _kinds(compiled: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in compiled:
        out[c["kind"]] = out.get(c["kind"], 0) + 1
    return out


def compare(record: dict) -> dict:
    """The recorded probes summarized (module docstring): per slice and group, the grid's shapes (``RxC dim bytes``)
    whose reduce-scatter XLA:TPU compiled to an all-reduce, of how many probed; per plan, its program's reductions by
    kind and the all-reduced ones' shapes as compiled (padded)."""
    grid: dict[str, dict] = {}
    plans = {}
    for p in record["probes"]:
        if "plan" in p:
            plans[p["plan"]] = {"slice": p["slice"], "group": p["group"], "matrices": len(p["matrices"]),
                                "compiled": _kinds(p["compiled"]),
                                "all_reduced": [c["shape"] for c in p["compiled"] if c["kind"] == "all-reduce"]}
            continue
        row = grid.setdefault(f"{p['slice']} over {p['group']}", {"probed": 0, "fused": 0, "all_reduced": []})
        row["probed"] += 1
        row["fused"] += any(c.get("fused") for c in p["compiled"])
        if any(c["kind"] == "all-reduce" for c in p["compiled"]):
            row["all_reduced"].append(f"{p['rows']}x{p['cols']} d{p['dim']} {p['bytes']}B")
    return {"date": record["date"], "versions": record["versions"], "grid": grid, "plans": plans,
            "predicates": classify(record)}


#: The candidate predicates' shard bound (elements a device; the best of 2^17 .. 2^23 on the grid).
SHARD_ELEMENTS = 2 ** 20


def split_layout(rows: int, cols: int, dim: int, group: int) -> tuple[bool, int, int]:
    """(whether the split dim is the layout's major one, its extent, the other's) of a ``rows x cols`` gradient
    reduce-scattered ``group`` ways along ``dim``: XLA:TPU lays a column split out column-major (``{0,1}``) where the
    shard is not whole 128-lane rows (every recorded probe: 96 of 96 column splits)."""
    if dim == 0:
        return True, rows, cols
    return (cols // group) % LANES != 0, cols, rows


def candidates(p: dict) -> dict[str, bool]:
    """The candidate predicates of whether probe ``p``'s reduce-scatter is compiled to an all-reduce, by the shard's
    shape against the 8x128 tiles and its layout: ``lanes`` (a minor split all-reduced iff its shard is exactly one
    128-lane row of bf16; a major split never), ``shard`` (that, and a major split all-reduced iff its shard holds
    SHARD_ELEMENTS or more), ``shard_pow2`` (that, and its shard's rows a power of two), ``tiles`` (the rule
    testbed models: testbed.model.scatter_lowering.lowered_shape, row-major)."""
    from testbed.model.scatter_lowering import lowered_shape

    major, split, other = split_layout(p["rows"], p["cols"], p["dim"], p["group"])
    rows = split // p["group"]
    minor = not major and p["bytes"] == 2 and rows == LANES
    big = major and rows * other >= SHARD_ELEMENTS
    return {"lanes": minor, "shard": minor or big, "shard_pow2": minor or (big and rows & (rows - 1) == 0),
            "tiles": lowered_shape((p["rows"], p["cols"]), p["dim"], p["group"], p["bytes"])}


def classify(record: dict) -> dict:
    """Each candidate predicate (:func:`candidates`) as a classifier over the grid's probes: its confusion counts
    (``tp``: all-reduced and predicted so, ...) over all of them and over the major splits alone."""
    out: dict[str, dict] = {}
    for p in record["probes"]:
        if "plan" in p:
            continue
        lowered = any(c["kind"] == "all-reduce" for c in p["compiled"])
        major = split_layout(p["rows"], p["cols"], p["dim"], p["group"])[0]
        for name, said in candidates(p).items():
            for scope in ("all", "major") if major else ("all",):
                row = out.setdefault(name, {}).setdefault(scope, {"tp": 0, "fp": 0, "fn": 0, "tn": 0})
                row[("t" if said == lowered else "f") + ("p" if said else "n")] += 1
    for scopes in out.values():
        for row in scopes.values():
            row["explained"] = round((row["tp"] + row["tn"]) / sum(row[k] for k in ("tp", "fp", "fn", "tn")), 4)
    return out


def main(argv: list[str] | None = None) -> int:
    return probe_main(argv, __doc__, DATA, collect, compare)


if __name__ == "__main__":
    raise SystemExit(main())
