"""What XLA:TPU's combiners and collective lowering do, probed by deviceless compiles (recorded), and testbed's rules.

``--collect`` (libtpu needed; seconds per probe on a quiet CPU host) compiles small
``shard_map`` programs for TPU slices without their chips
(``jax.experimental.topologies.get_topology_desc``): ``K`` independent collectives of one
kind, each of ``MiB`` per device, over a mesh axis of a slice, and records the compiled
HLO's collective instructions (kind, members merged, MiB) as
``benchmarks/xla_tpu_probes/collectives.json`` with the date, the versions and the command.

Without ``--collect`` it reads that record (no JAX) and prints ONE JSON object: per probe
the instructions XLA made beside what testbed's TPU rules say (all-reduces merged while the
merge stays within the topology's ``calibration.collectives.allreduce_combine_bytes``,
testbed.model.leaves.combined_sizes; all-gathers and reduce-scatters one per operand,
``combine_bytes: 0``; an all-gather over a whole slice of a buffer within the slice's bound an
all-reduce, merged as all-reduces are: testbed.sim.xla.xla_tpu.gather_allreduce_bytes), and the
probes where XLA lowered a reduce-scatter as an all-reduce (listed: testbed.sim.xla.xla_tpu models
the whole slices' among them).

    PYTHONPATH=<libtpu site> python benchmarks/xla_tpu_collectives.py --collect
    python benchmarks/xla_tpu_collectives.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "xla_tpu_probes" / "collectives.json"
MIB = 2 ** 20

#: (slice, mesh shape, axes, kind, K collectives, MiB each per device, trailing dim (1: rank-1 operands)).
PROBES = [
    *[("v5e:2x2", "4", "a", "ar", 16, mb, 1) for mb in (1, 8, 20, 40, 70)],
    *[("v5e:2x2", "4", "a", "ar", 2, mb, 1) for mb in (59.9, 60, 60.25, 62.5)],
    *[(t, m, "a", "ar", 16, 8, 1) for t, m in (("v5e:4x4", "16"), ("v5e:4x4", "4x4"), ("v5p:2x2x2", "8"),
                                               ("v5e:8x8", "64"))],
    *[("v5e:2x2", "4", "a", "ag", 16, mb, w) for mb in (1, 8) for w in (1, 1024)],
    ("v5e:4x4", "16", "a", "ag", 4, 1, 1024), ("v5p:2x2x2", "8", "a", "ag", 4, 1, 1024),
    *[("v5e:2x2", "4", "a", "rs", 8, mb, 1024) for mb in (1, 8)],
    ("v5e:2x2", "4", "a", "rs", 4, 1, 1), ("v5e:2x4", "8", "a", "rs", 4, 1, 1024),
    ("v5e:4x4", "4x4", "a", "rs", 4, 1, 1024), ("v5e:4x4", "4x4", "b", "rs", 4, 1, 1024),
    ("v5e:4x4", "2x8", "b", "rs", 4, 1, 1024), ("v5e:4x4", "4x4", "a,b", "rs", 4, 1, 1024),
    ("v5e:4x4", "16", "a", "rs", 4, 1, 1024), ("v5e:4x4", "16", "a", "rs", 4, 8, 1024),
    ("v5p:2x2x2", "2x4", "a", "rs", 4, 1, 1024), ("v5p:2x2x2", "8", "a", "rs", 4, 1, 1024),
    ("v5e:8x8", "64", "a", "rs", 4, 1, 1024), ("v5e:8x8", "4x16", "b", "rs", 4, 1, 1024),
    # All-gathers over a whole slice of a buffer of F MiB (F / group each; 128 lanes wide): lowered as all-reduces up
    # to a bound per slice (testbed.sim.xla.xla_tpu.gather_allreduce_bytes), pinned from both sides; none over part of a
    # slice. 32 wide, the buffer's tiles pad each row to 128 lanes: the bound holds for the padded bytes.
    *[(t, m, "a", "ag", k, f / int(m), w) for t, m, k, f, w in (
        ("v5e:8x8", "64", 2, 8, 128), ("v5e:8x8", "64", 1, 16, 128), ("v5e:8x8", "64", 1, 16.5, 128),
        ("v5e:16x16", "256", 1, 16, 128), ("v5e:16x16", "256", 1, 16.5, 128), ("v5e:8x16", "128", 1, 16, 128),
        ("v5e:8x16", "128", 1, 16.5, 128), ("v5e:8x16", "128", 1, 4, 32), ("v5e:8x16", "128", 1, 4.0625, 32),
        ("v5e:4x4", "16", 1, 0.25, 128), ("v5e:4x8", "32", 1, 0.25, 128), ("v5p:4x4x4", "64", 1, 128, 128),
        ("v5p:4x4x8", "128", 1, 64, 128), ("v5p:8x8x16", "1024", 1, 256, 128), ("v5p:2x4x4", "32", 1, 0.25, 128),
        ("v5p:2x2x4", "16", 1, 0.25, 128))],
    ("v5e:16x16", "64x4", "a", "ag", 1, 0.25 / 64, 128), ("v5p:4x4x4", "4x16", "b", "ag", 1, 0.25 / 16, 128),
]
_KINDS = {"ar": "all-reduce", "ag": "all-gather", "rs": "reduce-scatter"}
_INSTRUCTION = re.compile(r"=\s*(.*?)\s*\b(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)"
                          r"(-start)?\(")


def _probe(topo: str, shape: str, axes: str, kind: str, k: int, mib: float, width: int) -> dict:
    """Compile one probe for ``topo`` (libtpu) and return its record: the compiled collectives in order."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, PartitionSpec as P

    devices = sorted(topologies.get_topology_desc(topology_name=topo, platform="tpu").devices, key=lambda d: d.id)
    dims = tuple(int(x) for x in shape.split("x"))
    mesh = Mesh(np.array(devices).reshape(dims), tuple("abc"[:len(dims)]))
    ax = tuple(axes.split(","))
    group = int(np.prod([mesh.shape[a] for a in ax]))
    collective = {"ar": lambda y: jax.lax.psum(y, ax), "ag": lambda y: jax.lax.all_gather(y, ax, tiled=True),
                  "rs": lambda y: jax.lax.psum_scatter(y, ax, tiled=True)}[kind]
    specs = ({"ar": P(ax), "ag": P(ax), "rs": P()}[kind], {"ar": P(), "ag": P(), "rs": P(ax)}[kind])
    body = jax.shard_map(lambda *xs: tuple(collective(x * 2.0) for x in xs), mesh=mesh, in_specs=(specs[0],) * k,
                         out_specs=(specs[1],) * k, check_vma=False)
    rows = group * int(mib * MIB / 4) // width
    args = [jax.ShapeDtypeStruct((rows, width) if width > 1 else (rows,), jnp.float32) for _ in range(k)]
    text = jax.jit(body).lower(*args).compile().as_text()
    found = []
    for line in text.splitlines():
        m = _INSTRUCTION.search(line)
        if m:
            dims_found = re.findall(r"f32\[([\d,]+)\]", m.group(1))
            elements = sum(int(np.prod([int(x) for x in d.split(",")])) for d in dims_found)
            found.append({"kind": m.group(2), "members": len(dims_found), "mib": round(elements * 4 / MIB, 4)})
    return {"slice": topo, "mesh": shape, "axes": axes, "group": group, "kind": _KINDS[kind], "collectives": k,
            "mib_each": mib, "rank": 1 if width == 1 else 2, "width": width, "compiled": found}


def collect() -> dict:
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    probes = [_probe(*p) for p in PROBES]
    return record_probes(DATA, "python benchmarks/xla_tpu_collectives.py --collect", probes)


def record_probes(data: Path, command: str, probes: list) -> dict:
    """Write a probe benchmark's record atomically (date, the command, jax/jaxlib/libtpu versions, the probes)."""
    import jax
    import jaxlib
    from importlib.metadata import version

    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": command,
              "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "libtpu": version("libtpu")},
              "probes": probes}
    data.parent.mkdir(parents=True, exist_ok=True)
    tmp = data.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, data)
    return {"collected": len(probes), "file": str(data.relative_to(ROOT))}


def _expected_kind(p: dict) -> str:
    """The kind testbed's rules say a probe compiles to: an all-gather over a whole slice of at most the slice's
    bound an all-reduce (testbed.sim.xla.xla_tpu.gather_allreduce_bytes), else the probe's own kind."""
    from testbed.sim.xla.xla_tpu import gather_allreduce_bytes
    from testbed.topology.compile_target import parse_target, target_topology

    if p["kind"] != "all-gather":
        return p["kind"]
    topology = target_topology(parse_target(f"tpu:{p['slice']}"))
    whole = p["group"] == topology.num_devices
    lanes = 1 if p["rank"] == 1 else -(-p["width"] // 128) * 128 / p["width"]  # a tile's row: 128 lanes
    tiled = p["mib_each"] * p["group"] * MIB * lanes
    return "all-reduce" if whole and tiled <= gather_allreduce_bytes(topology) else p["kind"]


def compare(record: dict) -> dict:
    """Each probe's compiled instructions beside testbed's TPU rules (module docstring)."""
    from testbed.model.leaves import combined_sizes
    from testbed.topology.io import load_topology

    collectives = load_topology(ROOT / "topologies" / "tpu-v5e-4x4.yaml").calibration.collectives
    rows, agree = [], 0
    for p in record["probes"]:
        each = p["mib_each"] * MIB * (p["group"] if p["kind"] == "all-gather" else 1) \
            * (p["group"] if p["kind"] == "reduce-scatter" else 1)
        kind = _expected_kind(p)
        bound = collectives.allreduce_combine_bytes if kind == "all-reduce" else collectives.combine_bytes
        predicted = [round(s / MIB, 4) for s in combined_sizes((each,) * p["collectives"], bound)]
        compiled = [c["mib"] * (p["group"] if c["kind"] == "reduce-scatter" else 1) for c in p["compiled"]]
        lowered = sorted({c["kind"] for c in p["compiled"]} - {kind})
        same = not lowered and sorted(predicted) == sorted(round(c, 4) for c in compiled)
        agree += same
        rows.append({"probe": f"{p['slice']} mesh {p['mesh']} over {p['axes']}: {p['collectives']} x {p['kind']} "
                              f"of {p['mib_each']} MiB, rank {p['rank']}",
                     "compiled_mib": compiled, "predicted_mib": predicted, "lowered_as": lowered, "agree": same})
    return {"probes": len(rows), "agree": agree, "versions": record["versions"], "date": record["date"],
            "allreduce_combine_bytes": collectives.allreduce_combine_bytes,
            "combine_bytes": collectives.combine_bytes,
            "reduce_scatter_lowered_as_all_reduce": [r["probe"] for r, p in zip(rows, record["probes"])
                                                     if r["lowered_as"] and p["kind"] == "reduce-scatter"],
            "gathers_lowered_as_all_reduce": [r["probe"] for r, p in zip(rows, record["probes"])
                                              if p["kind"] == "all-gather" and _expected_kind(p) == "all-reduce"],
            "disagree": [r for r, p in zip(rows, record["probes"])
                         if not r["agree"] and not (r["lowered_as"] and p["kind"] == "reduce-scatter")], "rows": rows}


def probe_main(argv: list[str] | None, doc: str, data: Path, collect, compare) -> int:
    """A probe benchmark's command: ``--collect`` compiles the probes (``collect()``, needs libtpu) and prints
    them; else ``compare(record)`` over the recorded ``data`` is printed (exit 2, one line, when none is recorded)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--collect", action="store_true", help="compile the probes with XLA:TPU (needs libtpu)")
    args = parser.parse_args(argv)
    if args.collect:
        print(json.dumps(collect()))
        return 0
    if not data.exists():
        print(f"{data.relative_to(ROOT)}: no recorded probes; run with --collect on a host with libtpu",
              file=sys.stderr)
        return 2
    print(json.dumps(compare(json.loads(data.read_text()))))
    return 0


def main(argv: list[str] | None = None) -> int:
    return probe_main(argv, __doc__, DATA, collect, compare)


if __name__ == "__main__":
    raise SystemExit(main())
