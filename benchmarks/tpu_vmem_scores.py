"""Where XLA:TPU keeps a layer's attention scores: the on-chip memory (VMEM, memory space ``S(1)``) or HBM, read from
deviceless compiles of the runner's single-chip step at several microbatch sizes.

XLA:TPU's memory-space assignment may place a buffer in the chip's VMEM, where the passes over it (the softmax, the
score matmuls' reads and writes) cost no HBM traffic; the step's compiled HLO marks such a buffer's layout ``S(1)``.
For each variant of :data:`VARIANTS` (a single-chip suite plan at another microbatch size) this compiles the
runner's step for ``tpu:v5e:1x1`` (libtpu, no chip needed) and records whether any instruction producing a
``[microbatch, heads, seq, seq]`` bf16 score tensor does so in ``S(1)``, beside the tensor's bytes; the tensor's
top-level slots by memory space (``touches``); and the bytes the top-level instructions read and write of it and
of every other array, by memory space (``traffic``: the share of those passes that stays on chip).

Writes ``OUT/vmem_scores.json`` atomically (date, versions, the command, one row per variant) and prints it as ONE
JSON object. Needs libtpu (``PYTHONPATH`` to an unpacked libtpu wheel, ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``); each
compile takes 1-4 minutes of CPU. ``--hlo`` keeps each compiled HLO text; ``--from-hlo DIR`` analyses those
instead of compiling again.

    python benchmarks/tpu_vmem_scores.py --out OUT [--only NAME ...] [--hlo | --from-hlo DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
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


_ARRAY = re.compile(r"\b[a-z]+\d*[a-z0-9]*\[[\d,]*\]\{[^}]*\}")
_ARRAY_PARTS = re.compile(r"([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]\{([^}]*)\}")
#: Bytes per element by HLO element type (others: 4).
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f64": 8, "s64": 8, "u64": 8}
#: Asynchronous transfers between memory spaces (prefetches, evictions, sliced weight reads): not passes over scores.
_TRANSFERS = {"copy-start", "slice-start", "copy-done", "slice-done"}


def _instructions(text: str) -> list[tuple[str, str, str, str, list[str]]]:
    """(computation, name, opcode, result, operand names) of every instruction of the HLO ``text``; ``result``:
    the printed shape (arrays with their layouts) of what it defines."""
    rows, current = [], None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            current = (line.split()[1] if line.startswith("ENTRY") else line.split()[0]).lstrip("%")
        elif current is not None and " = " in line:
            lhs, rhs = line.split(" = ", 1)
            opcode = re.search(r"\s([a-z][a-z0-9\-]*)\(", rhs)
            if not opcode:
                continue
            args, depth = rhs[opcode.end():], 1
            for i, ch in enumerate(args):
                depth += (ch == "(") - (ch == ")")
                if depth == 0:
                    args = args[:i]
                    break
            rows.append((current, lhs.strip().removeprefix("ROOT ").lstrip("%"), opcode.group(1),
                         rhs[:opcode.start()], re.findall(r"%([\w.\-]+)", args)))
    return rows


def traffic(text: str, microbatch: int, heads: int, seq: int) -> dict:
    """The bytes the compiled HLO ``text``'s top-level instructions (outside fusion bodies; views, control and the
    asynchronous transfers between memory spaces left out) read and write, by memory space (``hbm_bytes``, and
    ``vmem_bytes`` for ``S(1)``), each operand resolved to the layout its producer printed: of the bf16 score
    tensor (``scores``) and of every other array (``other``). ``on_chip``: the VMEM share of the two, the share
    of those passes that costs no HBM traffic."""
    shape = re.compile(r"^bf16\[%s\]\{" % _dims(microbatch, heads, seq))
    rows = _instructions(text)
    fused = {m.group(1) for line in text.splitlines() if " fusion(" in line for m in _FUSED.finditer(line)}
    defs = {(comp, name): _ARRAY.findall(result) for comp, name, _, result, _ in rows}
    out = {kind: {"hbm_bytes": 0, "vmem_bytes": 0} for kind in ("scores", "other")}
    for comp, name, op, _, args in rows:
        if comp in fused or op in _NO_TRAFFIC or op in _TRANSFERS:
            continue
        for array in [a for arg in args for a in defs.get((comp, arg), [])] + defs[(comp, name)]:
            dtype, dims, layout = _ARRAY_PARTS.match(array).groups()
            row = out["scores" if shape.match(array) else "other"]
            row["vmem_bytes" if "S(1)" in layout else "hbm_bytes"] += _BYTES.get(dtype, 4) * math.prod(
                int(d) for d in dims.split(",") if d)
    for row in out.values():
        total = row["hbm_bytes"] + row["vmem_bytes"]
        row["on_chip"] = round(row["vmem_bytes"] / total, 4) if total else 0.0
    return out


def compile_variant(name: str, hlo_dir: Path | None = None, from_hlo: Path | None = None) -> dict:
    """One variant compiled deviceless for a v5e chip (or its compiled HLO read from ``from_hlo``, a folder
    ``--hlo`` wrote): its score tensor's bytes and where XLA:TPU keeps it."""
    import yaml

    from testbed.plan.io import plan_from_dict
    from testbed.runner.check_sharding import spmd_step
    from testbed.runner.devices import build_mesh, plan_placement
    from testbed.runner.tpu_compile import target_devices
    from testbed.topology.compile_target import parse_target

    base, batch, microbatches = VARIANTS[name]
    spec = yaml.safe_load((SUITE / f"{base}.yaml").read_text())
    spec |= {"name": name, "batch": {"global_batch": batch, "microbatches": microbatches}}
    import gzip

    if from_hlo is not None:
        text = gzip.decompress((from_hlo / f"{name}.hlo.txt.gz").read_bytes()).decode()
    else:
        plan = plan_from_dict(spec)
        devices = target_devices(parse_target("tpu:v5e:1x1"))
        _, step, _, args = spmd_step(plan, build_mesh(plan_placement(plan, devices), devices))
        text = step.lower(*args).compile().as_text()
    if hlo_dir is not None and from_hlo is None:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        (hlo_dir / f"{name}.hlo.txt.gz").write_bytes(gzip.compress(text.encode()))
    model, mb = spec["model"], batch // microbatches
    shape = (mb, model["heads"], model["seq_len"])
    return {"variant": name, "plan": base, "microbatch": mb, "heads": model["heads"], "seq": model["seq_len"],
            "score_bytes": 2 * mb * model["heads"] * model["seq_len"] ** 2,
            **placed(text, *shape), "touches": touches(text, *shape), "traffic": traffic(text, *shape)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for vmem_scores.json")
    parser.add_argument("--only", nargs="*", help="variants to compile (default: all)")
    parser.add_argument("--hlo", action="store_true", help="also keep each compiled HLO text (OUT/hlo/NAME.hlo.txt.gz)")
    parser.add_argument("--from-hlo", help="read each variant's compiled HLO from this folder (--hlo's) instead")
    args = parser.parse_args(argv)
    from testbed.runner import devices

    devices.prepare(devices.DeviceRequest(kind="emulated", count=1))
    from testbed.runner.tpu_compile import versions

    rows, source = [], Path(args.from_hlo) if args.from_hlo else None
    for name in args.only or list(VARIANTS):
        rows.append(compile_variant(name, Path(args.out) / "hlo" if args.hlo else None, source))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    only = ("" if not args.only else " --only " + " ".join(args.only)) + (" --from-hlo HLO" if source else "")
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": versions(), "target": "tpu:v5e:1x1",
              "command": f"python benchmarks/tpu_vmem_scores.py --out OUT{only}", "rows": rows}
    write_atomic(Path(args.out) / "vmem_scores.json", json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
