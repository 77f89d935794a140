"""Which sequence-parallel reduce-scatters XLA:TPU compiles to all-reduces of the whole activation (recorded probes).

A row-parallel matmul's output under sequence parallelism is reduce-scattered over the tensor axis along the
sequence (testbed.runner.parallel: ``psum_scatter(y, "tensor", scatter_dimension=1)``). ``--collect`` (libtpu
needed; seconds a probe) compiles that alone, deviceless (``jax.experimental.topologies.get_topology_desc``): an
``einsum("bsk,kd->bsd")`` of a sequence batch ``[b, s, k]`` split over ``fsdp`` and a weight split over ``tensor``
on ``k``, the product reduce-scattered over ``tensor`` along ``s``, for a grid of slices, meshes and batches
(:data:`PROBES`), and records each compiled collective as testbed.runner.hlo_schedule reads it
(``benchmarks/xla_tpu_probes/sequence_scatters.json``, with the date, the versions and the command).

Without ``--collect`` it reads the record (no JAX) and prints ONE JSON object: per probe its compiled kind beside
testbed's rule (testbed.sim.xla.xla_tpu.scatters_whole_sequence: one sequence a device, or a tensor axis over every
chip of a slice testbed.sim.xla.xla_tpu.scatters_as_allreduce names) and ``agree``: how many the rule says.

    PYTHONPATH=<libtpu site>:. python benchmarks/xla_tpu_sequence_scatters.py --collect
    python benchmarks/xla_tpu_sequence_scatters.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from xla_tpu_collectives import probe_main, record_probes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "xla_tpu_probes" / "sequence_scatters.json"
#: (slice, mesh (fsdp, tensor), sequences a device b, sequence s, model width d).
PROBES = [(s, m, b, n, n) for s, m, n in (("v5e:2x2", (1, 4), 2048), ("v5e:4x4", (4, 4), 2048),
                                           ("v5e:8x8", (16, 4), 2048), ("v5e:16x16", (64, 4), 4096),
                                           ("v5p:4x4x4", (8, 8), 2048)) for b in (1, 2)] + \
         [(s, m, 2, 2048, 2048) for s, m in (("v5p:2x2x2", (1, 8)), ("v5e:4x4", (1, 16)), ("v5e:2x4", (1, 8)))]


def _compile(slice_: str, mesh_shape: tuple[int, int], b: int, s: int, d: int) -> list[dict]:
    """The collectives of the probe's compiled program (kind, mesh axes, bytes per device)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, PartitionSpec as P

    from testbed.runner import hlo_schedule

    devices = sorted(topologies.get_topology_desc(topology_name=slice_, platform="tpu").devices, key=lambda x: x.id)
    mesh = Mesh(np.array(devices).reshape(mesh_shape), ("fsdp", "tensor"))
    k = 512 * mesh_shape[1]

    def body(x, w):
        return jax.lax.psum_scatter(jnp.einsum("bsk,kd->bsd", x, w), "tensor", scatter_dimension=1, tiled=True)

    args = [jax.ShapeDtypeStruct((b * mesh_shape[0], s, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, d), jnp.bfloat16)]
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp", None, "tensor"), P("tensor", None)),
                           out_specs=P("fsdp", "tensor"), check_vma=False)
    text = jax.jit(mapped).lower(*args).compile().as_text()
    return [{"kind": c.kind, "axes": c.axes, "bytes": c.bytes}
            for c in hlo_schedule.collectives(text, mesh_shape, ("fsdp", "tensor"))]


def collect() -> dict:
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    probes = [{"slice": s, "mesh": list(m), "b": b, "s": n, "d": d, "compiled": _compile(s, m, b, n, d)}
              for s, m, b, n, d in PROBES]
    return record_probes(DATA, "python benchmarks/xla_tpu_sequence_scatters.py --collect", probes)


def predicted(probe: dict) -> str:
    """The kind testbed's rule says the probe compiles to (testbed.sim.xla.xla_tpu.scatters_whole_sequence)."""
    from testbed.plan.io import plan_from_dict
    from testbed.sim.xla.xla_tpu import scatters_as_allreduce, scatters_whole_sequence
    from testbed.topology.compile_target import parse_target, target_topology

    fsdp, tensor = probe["mesh"]
    d = probe["d"]
    plan = plan_from_dict({"model": {"kind": "gpt", "layers": 1, "d_model": d, "heads": 16, "d_ff": 4 * d,
                                     "seq_len": probe["s"], "vocab": 32000},
                           "batch": {"global_batch": probe["b"] * fsdp}, "mesh": {"fsdp": fsdp, "tensor": tensor},
                           "sequence_parallel": True})
    topology = target_topology(parse_target(f"tpu:{probe['slice']}"))  # every probe's mesh spans the whole slice
    return "all-reduce" if scatters_whole_sequence(plan, True, scatters_as_allreduce(topology)) else "reduce-scatter"


def compare(record: dict) -> dict:
    rows = []
    for p in record["probes"]:
        kinds = sorted({c["kind"] for c in p["compiled"] if c["axes"] == "tensor"})
        rows.append({"slice": p["slice"], "mesh": p["mesh"], "b": p["b"], "s": p["s"], "d": p["d"],
                     "compiled": kinds, "predicted": predicted(p)})
    agree = sum(r["compiled"] == [r["predicted"]] for r in rows)
    return {"date": record["date"], "versions": record["versions"], "probes": rows, "agree": agree,
            "count": len(rows)}


def main(argv: list[str] | None = None) -> int:
    return probe_main(argv, __doc__, DATA, collect, compare)


if __name__ == "__main__":
    raise SystemExit(main())
