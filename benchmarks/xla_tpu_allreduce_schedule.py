"""Where XLA:TPU schedules a data-parallel step's gradient all-reduces, probed by deviceless compiles (recorded), and
testbed's rule.

``--collect`` (libtpu needed; about a minute per probe on a quiet CPU host) compiles a data-parallel training step
for TPU slices without their chips (``jax.experimental.topologies.get_topology_desc``), with libtpu's default flags,
as the runner compiles: a chain of ``LAYERS`` fp32 weights of ``D x D`` (bf16 matmuls, tanh between them), the batch
sharded over every device, the gradients summed by the partitioner and the weights updated by SGD. It records each
all-reduce of the compiled module's entry computation in schedule order: its MiB, its members (gradients the
all-reduce combiner merged), whether it is asynchronous (an ``all-reduce-start``/``-done`` pair or an async collective
fusion chain, testbed.runner.hlo_schedule) and the matmul kernels scheduled before and after it, as
``benchmarks/xla_tpu_probes/allreduce_schedule.json`` with the date, the versions and the command.

Without ``--collect`` it reads that record and the recorded plan compiles (benchmarks/xla_tpu/, no JAX) and prints
ONE JSON object: per probe the all-reduces, the ones that are asynchronous and the ones scheduled among the backward's
matmuls; over the recorded compiles the all-reduce instructions and the asynchronous ones; and testbed's rule
(testbed.topology.parts.DeviceSpec.blocking_collectives of the bundled v5e slice: all-reduces block the compute).

    PYTHONPATH=<libtpu site> python benchmarks/xla_tpu_allreduce_schedule.py --collect
    python benchmarks/xla_tpu_allreduce_schedule.py
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from xla_tpu_collectives import probe_main, record_probes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "xla_tpu_probes" / "allreduce_schedule.json"
RECORDS = ROOT / "benchmarks" / "xla_tpu"
#: (slice, layers, d): 16 gradients of 8 MiB in bf16, more than one 120 MiB bucket.
PROBES = [("v5e:2x2", 16, 2048), ("v5e:4x4", 16, 2048)]
_ALL_REDUCE = re.compile(r"\ball-reduce(-start)?\(")
_ARRAY = re.compile(r"\b(bf16|f32)\[([\d,]*)\]")
_MATMUL = re.compile(r"\b(convolution|dot)\(")


def _compile(topo: str, layers: int, d: int) -> str:
    """The compiled text of the probe's step on ``topo`` (libtpu)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = sorted(topologies.get_topology_desc(topology_name=topo, platform="tpu").devices, key=lambda x: x.id)
    mesh = Mesh(np.array(devices), ("data",))

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w.astype(x.dtype))
        return jnp.mean(x.astype(jnp.float32) ** 2)

    def step(ws, x):
        return [w - 0.01 * g for w, g in zip(ws, jax.grad(loss)(ws, x))]

    ws = [jax.ShapeDtypeStruct((d, d), jnp.float32, sharding=NamedSharding(mesh, P())) for _ in range(layers)]
    x = jax.ShapeDtypeStruct((len(devices) * 2048, d), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    return jax.jit(step, donate_argnums=0).lower(ws, x).compile().as_text()


def schedule(text: str) -> list[dict]:
    """The entry computation's all-reduces in schedule order (MiB, members, async, matmul kernels before and after)."""
    from testbed.runner.hlo_schedule import computations

    comps = computations(text)
    entry = next(c for c in comps.values() if c.entry)

    def matmul(name: str, seen: frozenset = frozenset()) -> bool:
        lines = comps[name].lines if name in comps else ()
        return any(_MATMUL.search(ln) for ln in lines) or any(
            matmul(c, seen | {name}) for ln in lines for c in re.findall(r"calls=%?([\w.\-]+)", ln) if c not in seen)

    kernels = [bool(_MATMUL.search(ln)) or any(matmul(c) for c in re.findall(r"calls=%?([\w.\-]+)", ln))
               for ln in entry.lines]
    rows = []
    for i, line in enumerate(entry.lines):
        found = _ALL_REDUCE.search(line)
        if not found:
            continue
        arrays = _ARRAY.findall(line[line.index("=") + 1:found.start()])
        size = sum((2 if t == "bf16" else 4) * eval("*".join(dims.split(",")) or "1") for t, dims in arrays)
        rows.append({"position": i, "mib": round(size / 2 ** 20, 3), "members": len(arrays),
                     "async": bool(found.group(1)) or "AsyncCollectiveStart" in line,
                     "matmuls_before": sum(kernels[:i]), "matmuls_after": sum(kernels[i + 1:])})
    return rows


def collect() -> dict:
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    probes = []
    for topo, layers, d in PROBES:
        text = _compile(topo, layers, d)
        probes.append({"slice": topo, "layers": layers, "d": d, "async_pairs": len(re.findall(r"all-reduce-start\(", text)),
                       "async_chains": text.count("AsyncCollectiveStart"), "all_reduces": schedule(text)})
    return record_probes(DATA, "python benchmarks/xla_tpu_allreduce_schedule.py --collect", probes)


def recorded_all_reduces() -> dict:
    """Over the recorded plan compiles (benchmarks/xla_tpu/): the all-reduce instructions and the asynchronous ones."""
    plans = instructions = asynchronous = 0
    for path in sorted(RECORDS.glob("*.json")):
        programs = (json.loads(path.read_text()).get("report") or {}).get("programs", ())
        rows = [c for p in programs for c in p.get("collectives", ()) if c["kind"] == "all-reduce"]
        plans += bool(rows)
        instructions += sum(c["instructions"] for c in rows)
        asynchronous += sum(c["async"] for c in rows)
    return {"plans": plans, "instructions": instructions, "asynchronous": asynchronous}


def compare(record: dict) -> dict:
    """Each probe's all-reduces beside testbed's rule (module docstring)."""
    from testbed.topology.io import load_topology

    blocking = sorted(load_topology(ROOT / "topologies" / "tpu-v5e-16x16.yaml").device.blocking_collectives())
    rows = [{"slice": p["slice"], "all_reduces": len(p["all_reduces"]),
             "asynchronous": sum(r["async"] for r in p["all_reduces"]) + p["async_pairs"] + p["async_chains"],
             "among_backward_matmuls": sum(r["matmuls_after"] > 0 for r in p["all_reduces"]),
             "schedule": p["all_reduces"]} for p in record["probes"]]
    return {"versions": record["versions"], "date": record["date"], "probes": rows,
            "recorded_plan_compiles": recorded_all_reduces(), "testbed_blocking_kinds_tpu": blocking,
            "agree": all(r["asynchronous"] == 0 for r in rows) and "all_reduce" in blocking}


def main(argv: list[str] | None = None) -> int:
    return probe_main(argv, __doc__, DATA, collect, compare)


if __name__ == "__main__":
    raise SystemExit(main())
