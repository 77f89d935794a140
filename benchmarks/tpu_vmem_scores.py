"""Where XLA:TPU keeps a layer's attention scores: the on-chip memory (VMEM, memory space ``S(1)``) or HBM, read from
deviceless compiles of the runner's single-chip step at several microbatch sizes.

XLA:TPU's memory-space assignment may place a buffer in the chip's VMEM, where the passes over it (the softmax, the
score matmuls' reads and writes) cost no HBM traffic; the step's compiled HLO marks such a buffer's layout ``S(1)``.
For each variant of :data:`VARIANTS` (a single-chip suite plan at another microbatch size) this compiles the
runner's step for ``tpu:v5e:1x1`` (libtpu, no chip needed) and records whether any instruction producing a
``[microbatch, heads, seq, seq]`` bf16 score tensor does so in ``S(1)``, beside the tensor's bytes.

Writes ``OUT/vmem_scores.json`` atomically (date, versions, the command, one row per variant) and prints it as ONE
JSON object. Needs libtpu (``PYTHONPATH`` to an unpacked libtpu wheel, ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``); each
compile takes 1-4 minutes of CPU.

    python benchmarks/tpu_vmem_scores.py --out OUT [--only NAME ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tpu_chip import write_atomic  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "plans" / "validation-1dev"
#: name: (suite plan, global batch, microbatches) — microbatch sizes 2 to 8 of the GPT-2 small and medium shapes.
VARIANTS = {
    "gpt125m-mb2": ("gpt125m-bf16-accum4", 16, 8),
    "gpt125m-mb4": ("gpt125m-bf16-accum4", 16, 4),
    "gpt125m-mb5": ("gpt125m-bf16-accum4", 10, 2),
    "gpt125m-mb6": ("gpt125m-bf16-accum4", 24, 4),
    "gpt125m-mb8": ("gpt125m-bf16-accum4", 8, 1),
    "gpt350m-mb3": ("gpt350m-bf16-selective-accum2", 6, 2),
    "gpt350m-mb4": ("gpt350m-bf16-selective-accum2", 8, 2),
    "gpt125m-mb1": ("gpt125m-bf16-accum4", 16, 16),
    "gpt125m-mb3": ("gpt125m-bf16-accum4", 12, 4),
    "gpt350m-mb1": ("gpt350m-bf16-selective-accum2", 8, 8),
    "gpt350m-mb2": ("gpt350m-bf16-selective-accum2", 8, 4),
}
#: Opcodes whose operands and results are views or control, not memory traffic.
_NO_TRAFFIC = {"bitcast", "get-tuple-element", "tuple", "parameter", "while", "call", "conditional", "constant"}
_FUSED = re.compile(r"calls=%?([\w.\-]+)")


def _dims(microbatch: int, heads: int, seq: int) -> str:
    """The score tensor's dimensions as a pattern: a microbatch of one sequence may lose its unit dimension."""
    return ("(?:1,)?" if microbatch == 1 else f"{microbatch},") + f"{heads},{seq},{seq}"


def placed(text: str, microbatch: int, heads: int, seq: int) -> dict:
    """How many instructions of the compiled HLO ``text`` produce the bf16 score tensor, and how many in ``S(1)``."""
    shape = re.compile(r"^\s*(?:ROOT )?%%\S+ = bf16\[%s\]\{([^}]*)\} " % _dims(microbatch, heads, seq), re.M)
    layouts = [m.group(1) for m in shape.finditer(text)]
    return {"producers": len(layouts), "in_vmem": sum("S(1)" in layout for layout in layouts)}


def touches(text: str, microbatch: int, heads: int, seq: int) -> dict:
    """The score tensor's operand and result slots of the compiled HLO's top-level instructions (outside fusion
    bodies; views and control left out), by opcode: how many in all and how many in ``S(1)`` (VMEM). The share
    of a step's score bytes that stays on chip is ``in_vmem / slots`` summed over the opcodes that move bytes."""
    shape = re.compile(r"bf16\[%s\]\{([^}]*)\}" % _dims(microbatch, heads, seq))
    fused = {m.group(1) for line in text.splitlines() if " fusion(" in line for m in _FUSED.finditer(line)}
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            current = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            current = current.lstrip("%")
        elif current is not None and current not in fused and " = " in line:
            rhs = line.split(" = ", 1)[1]
            opcode = re.search(r"\s([a-z][a-z0-9\-]*)\(", rhs)
            op = opcode.group(1) if opcode else "?"
            if op in _NO_TRAFFIC:
                continue
            layouts = [m.group(1) for m in shape.finditer(line)]
            if layouts:
                row = out.setdefault(op, {"slots": 0, "in_vmem": 0})
                row["slots"] += len(layouts)
                row["in_vmem"] += sum("S(1)" in layout for layout in layouts)
    return out


def compile_variant(name: str, hlo_dir: Path | None = None) -> dict:
    """One variant compiled deviceless for a v5e chip: its score tensor's bytes and where XLA:TPU keeps it."""
    import yaml

    from testbed.plan.io import plan_from_dict
    from testbed.runner.check_sharding import spmd_step
    from testbed.runner.devices import build_mesh, plan_placement
    from testbed.runner.tpu_compile import target_devices
    from testbed.topology.compile_target import parse_target

    base, batch, microbatches = VARIANTS[name]
    spec = yaml.safe_load((SUITE / f"{base}.yaml").read_text())
    spec |= {"name": name, "batch": {"global_batch": batch, "microbatches": microbatches}}
    plan = plan_from_dict(spec)
    devices = target_devices(parse_target("tpu:v5e:1x1"))
    _, step, _, args = spmd_step(plan, build_mesh(plan_placement(plan, devices), devices))
    text = step.lower(*args).compile().as_text()
    if hlo_dir is not None:
        import gzip
        hlo_dir.mkdir(parents=True, exist_ok=True)
        (hlo_dir / f"{name}.hlo.txt.gz").write_bytes(gzip.compress(text.encode()))
    model, mb = spec["model"], batch // microbatches
    shape = (mb, model["heads"], model["seq_len"])
    return {"variant": name, "plan": base, "microbatch": mb, "heads": model["heads"], "seq": model["seq_len"],
            "score_bytes": 2 * mb * model["heads"] * model["seq_len"] ** 2,
            **placed(text, *shape), "touches": touches(text, *shape)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for vmem_scores.json")
    parser.add_argument("--only", nargs="*", help="variants to compile (default: all)")
    parser.add_argument("--hlo", action="store_true", help="also keep each compiled HLO text (OUT/hlo/NAME.hlo.txt.gz)")
    args = parser.parse_args(argv)
    from testbed.runner import devices

    devices.prepare(devices.DeviceRequest(kind="emulated", count=1))
    from testbed.runner.tpu_compile import versions

    rows = []
    for name in args.only or list(VARIANTS):
        rows.append(compile_variant(name, Path(args.out) / "hlo" if args.hlo else None))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    only = "" if not args.only else " --only " + " ".join(args.only)
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": versions(), "target": "tpu:v5e:1x1",
              "command": f"python benchmarks/tpu_vmem_scores.py --out OUT{only}", "rows": rows}
    write_atomic(Path(args.out) / "vmem_scores.json", json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
