"""Which fp32 all-gathers XLA:TPU moves in bf16, probed by deviceless compiles (recorded), and testbed's rule.

``--collect`` (libtpu needed; a second or two per probe) compiles small ``shard_map`` programs for a v5e 2x2 slice
without its chips (``jax.experimental.topologies.get_topology_desc``): an fp32 buffer all-gathered over the slice and
read by a matmul of the default precision, as sequence parallelism gathers an activation (the rows sharded) and
fsdp a weight (the contracted rows sharded), and once read by an elementwise op too; it records the element type of
the compiled all-gather as ``benchmarks/xla_tpu_probes/narrowing.json`` with the date, the versions and the command.

Without ``--collect`` it reads that record (no JAX) and prints ONE JSON object: per probe the compiled element
beside testbed's rule (testbed.sim.xla.xla_tpu.gather_element_bytes: an fp32 gather every reader of which is a
default-precision matmul moves bf16; the rule the traced tier applies, testbed.sim.xla.xla_tpu.lowered_gathers).

    PYTHONPATH=<libtpu site> python benchmarks/xla_tpu_narrowing.py --collect
    python benchmarks/xla_tpu_narrowing.py
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
DATA = ROOT / "benchmarks" / "xla_tpu_probes" / "narrowing.json"
SLICE = "v5e:2x2"
#: (name, what gathers, whether an elementwise op reads the gathered buffer too): rows 2048, width 1024, fp32.
PROBES = [("activation", "x", False), ("weight", "w", False), ("activation_and_elementwise", "x", True)]
_GATHER = re.compile(r"=\s*(\w+)\[[\d,]*\][^\s]*\s+all-gather(-start)?\(")


def _probe(name: str, gathered: str, elementwise: bool) -> dict:
    """Compile one probe for :data:`SLICE` (libtpu) and return its record: each compiled all-gather's element."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, PartitionSpec as P

    devices = sorted(topologies.get_topology_desc(topology_name=SLICE, platform="tpu").devices, key=lambda d: d.id)
    mesh = Mesh(np.array(devices).reshape(len(devices)), ("a",))

    def body(x, w):
        g = jax.lax.all_gather(x if gathered == "x" else w, "a", tiled=True)
        y = g @ w if gathered == "x" else x @ g
        return (y, g * 2.0) if elementwise else y

    specs = (P("a"), P()) if gathered == "x" else (P(), P("a"))
    out = (P(), P()) if elementwise else P()
    mapped = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out, check_vma=False)
    args = (jax.ShapeDtypeStruct((2048, 1024), jnp.float32), jax.ShapeDtypeStruct((1024, 1024), jnp.float32))
    text = jax.jit(mapped).lower(*args).compile().as_text()
    return {"probe": name, "slice": SLICE, "gathered": gathered, "elementwise_reader": elementwise,
            "compiled_elements": [m.group(1) for m in map(_GATHER.search, text.splitlines()) if m]}


def collect() -> dict:
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax
    import jaxlib
    from importlib.metadata import version

    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python benchmarks/xla_tpu_narrowing.py --collect",
              "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "libtpu": version("libtpu")},
              "probes": [_probe(*p) for p in PROBES]}
    DATA.parent.mkdir(parents=True, exist_ok=True)
    tmp = DATA.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, DATA)
    return {"collected": len(record["probes"]), "file": str(DATA.relative_to(ROOT))}


def compare(record: dict) -> dict:
    """Each probe's compiled element beside testbed's rule (module docstring)."""
    from testbed.sim.xla.xla_tpu import gather_element_bytes

    rows = []
    for p in record["probes"]:
        narrowed = 0.0 if p["elementwise_reader"] else gather_element_bytes(4.0)  # only matmuls read it: the rule
        predicted = "bf16" if narrowed == 2.0 else "f32"
        rows.append({**p, "predicted_element": predicted, "agree": p["compiled_elements"] == [predicted]})
    return {"probes": len(rows), "agree": sum(r["agree"] for r in rows), "versions": record["versions"],
            "date": record["date"], "rows": rows}


def main(argv: list[str] | None = None) -> int:
    return probe_main(argv, __doc__, DATA, collect, compare)


if __name__ == "__main__":
    raise SystemExit(main())
