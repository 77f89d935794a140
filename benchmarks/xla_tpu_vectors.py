"""Which rank-1 all-gathers and reduce-scatters XLA:TPU compiles to all-reduces, probed by deviceless compiles (recorded).

``--collect`` (libtpu needed; a second or so per probe) compiles small ``shard_map`` programs for TPU slices
without their chips (``jax.experimental.topologies.get_topology_desc``): two independent rank-1 all-gathers (or
reduce-scatters) of a vector whose shard per device is 64, 96, 128 or 256 elements, over a whole v5e 2x2, 4x4 or
v5p 2x2x2 slice, over 4 of a v5e 4x4's 16 chips and over 16 of a v5e 8x8's 64, in bf16 and fp32; it records the
compiled collectives (kind, and how many operands each merges) as ``benchmarks/xla_tpu_probes/vectors.json`` with
the date, the versions and the command. These are the plans' norms' scales and biases under fsdp.

Without ``--collect`` it reads that record (no JAX) and prints ONE JSON object: per probe the compiled collectives
beside testbed's rules (testbed.sim.xla.xla_tpu.vector_gather_lowers: a rank-1 gather whose shard is not a whole
number of 128-lane rows is an all-reduce of the zero-padded vector, the two merged; vector_scatters_as_allreduce:
every rank-1 reduce-scatter is an all-reduce of the whole vector, the two merged).

    PYTHONPATH=<libtpu site> python benchmarks/xla_tpu_vectors.py --collect
    python benchmarks/xla_tpu_vectors.py
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from xla_tpu_collectives import probe_main  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "xla_tpu_probes" / "vectors.json"
#: (slice, mesh shape, the axis collected over): whole slices, and part of a slice.
MESHES = [("v5e:2x2", (4,), "a"), ("v5e:4x4", (16,), "a"), ("v5p:2x2x2", (8,), "a"), ("v5e:4x4", (4, 4), "a"),
          ("v5e:8x8", (4, 16), "b")]
KINDS = ("all-gather", "reduce-scatter")
SHARDS = (64, 96, 128, 256)
DTYPES = ("bfloat16", "float32")
#: Independent collectives per probe (whether XLA merges them).
K = 2
_FOUND = re.compile(r"=\s*(.*?)\s*\b(all-gather|all-reduce|reduce-scatter|collective-permute)(-start)?\(")


def _probe(slice_: str, shape: tuple[int, ...], axis: str, kind: str, shard: int, dtype: str) -> dict:
    """Compile one probe (libtpu) and return its record: each compiled collective's kind and operand count."""
    import jax
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, PartitionSpec as P

    devices = sorted(topologies.get_topology_desc(topology_name=slice_, platform="tpu").devices, key=lambda d: d.id)
    mesh = Mesh(np.array(devices).reshape(shape), ("a", "b")[:len(shape)])
    n = mesh.shape[axis]

    def body(*xs):
        if kind == "all-gather":
            return tuple(jax.lax.all_gather(x, axis, tiled=True) * 2 for x in xs)
        return tuple(jax.lax.psum_scatter(x * 2, axis, tiled=True) for x in xs)

    inner, outer = (P(axis), P()) if kind == "all-gather" else (P(), P(axis))
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(inner,) * K, out_specs=(outer,) * K, check_vma=False)
    args = [jax.ShapeDtypeStruct((shard * n,), getattr(jax.numpy, dtype)) for _ in range(K)]
    text = jax.jit(mapped).lower(*args).compile().as_text()
    # An async start's type is (operands, results): half its arrays are the operands.
    compiled = [{"kind": m.group(2), "members": m.group(1).count("[") // (2 if m.group(3) else 1)}
                for m in map(_FOUND.search, text.splitlines()) if m]
    return {"slice": slice_, "mesh": "x".join(map(str, shape)), "axis": axis, "group": n, "kind": kind,
            "shard_elements": shard, "dtype": dtype, "collectives": K, "compiled": compiled}


def collect() -> dict:
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax
    import jaxlib
    from importlib.metadata import version

    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python benchmarks/xla_tpu_vectors.py --collect",
              "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "libtpu": version("libtpu")},
              "probes": [_probe(*m, kind, shard, dtype) for m in MESHES for kind in KINDS for shard in SHARDS
                         for dtype in DTYPES]}
    DATA.parent.mkdir(parents=True, exist_ok=True)
    tmp = DATA.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, DATA)
    return {"collected": len(record["probes"]), "file": str(DATA.relative_to(ROOT))}


def predicted(probe: dict) -> list[dict]:
    """testbed's rule for one probe: its ``collectives`` merged into one all-reduce where the rule lowers them,
    else as many collectives of the probe's kind (no all-gather or reduce-scatter is merged)."""
    from testbed.sim.xla.xla_tpu import vector_gather_lowers

    k = probe["collectives"]
    lowered = vector_gather_lowers(probe["shard_elements"]) if probe["kind"] == "all-gather" else True
    return [{"kind": "all-reduce", "members": k}] if lowered else [{"kind": probe["kind"], "members": 1}] * k


def compare(record: dict) -> dict:
    """Each probe's compiled collectives beside testbed's rules (module docstring)."""
    rows = [{**p, "predicted": predicted(p), "agree": predicted(p) == p["compiled"]} for p in record["probes"]]
    return {"probes": len(rows), "agree": sum(r["agree"] for r in rows), "versions": record["versions"],
            "date": record["date"], "disagree": [r for r in rows if not r["agree"]]}


def main(argv: list[str] | None = None) -> int:
    return probe_main(argv, __doc__, DATA, collect, compare)


if __name__ == "__main__":
    raise SystemExit(main())
