"""Where XLA:TPU adds a microbatch's weight gradients into the step's accumulator, read from a deviceless compile of
the runner's single-chip step with gradient accumulation (``lax.scan`` over the microbatches).

For each matrix the loop carries (a weight's gradient accumulator: a carried bf16 or f32 array of two or more
dimensions), this finds the loop body's matmul fusions that write an array of its shape and records whether their
fused body holds the ``add`` (the accumulation fused into the gradient's matmul, its output fusion) or not (an add
of its own). testbed.sim.step.grad_bytes.FUSED_ACCUMULATE_PASSES prices the fused add from this record.

Writes ``OUT/accumulate.json`` atomically (date, versions, the command, one row per plan) and prints it as ONE JSON
object. Needs libtpu (``PYTHONPATH`` to an unpacked libtpu wheel, ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``); a compile takes
1-4 minutes of CPU.

    python benchmarks/tpu_accumulate.py --out OUT [PLAN ...]
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
PLANS = ("gpt125m-bf16-accum16",)
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ")
_OPCODE = re.compile(r"\s([a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"(?:bf16|f32)\[([0-9,]+)\]")


def computations(text: str) -> dict[str, list[str]]:
    """The instruction lines of each computation of a compiled HLO module's text."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            current = out.setdefault(name.lstrip("%"), [])
        elif current is not None and " = " in line:
            current.append(line)
    return out


def _opcodes(lines: list[str]) -> set[str]:
    return {m.group(1) for line in lines if (m := _OPCODE.search(line.split(" = ", 1)[1]))}


def accumulations(text: str) -> dict[str, int]:
    """Of the first while loop's body: the carried matrices it writes anew (the accumulators of the weight
    gradients: the body's result in a carried position of two or more dimensions, not the value it read), how many a
    matmul fusion writes (the gradient's matmul), and how many of those hold the add into the accumulator."""
    comps = computations(text)
    loop = next(line for lines in comps.values() for line in lines if " while(" in line)
    lines = comps[re.search(r"body=%?([\w.\-]+)", loop).group(1)]
    defs = {line.split(" = ", 1)[0].split()[-1].lstrip("%"): line for line in lines}
    root = next(line for line in lines if line.lstrip().startswith("ROOT "))
    written = matmuls = fused = 0
    for name in re.findall(r"%([\w.\-]+)", root.split(" tuple(", 1)[1]):
        line = _producer(defs, name)
        if line is None or not _ARRAY.search(line.split(" = ", 1)[1].split("(")[0] + "(") \
                or " parameter(" in line or not _is_matrix(line):
            continue
        written += 1
        if " fusion(" in line:
            ops = _opcodes(comps.get(re.search(r"calls=%?([\w.\-]+)", line).group(1), []))
            if "convolution" in ops:
                matmuls += 1
                fused += "add" in ops
    return {"accumulators": written, "gradient_matmuls": matmuls, "add_fused": fused}


def _is_matrix(line: str) -> bool:
    """Whether the instruction writes an array of two or more dimensions (a matrix's gradient, not a vector's)."""
    head = line.split(" = ", 1)[1].split(" fusion(")[0]
    return any(dims.count(",") >= 1 for dims in _ARRAY.findall(head))


def _producer(defs: dict[str, str], name: str) -> str | None:
    """The line computing ``name``: through bitcasts, copies and tuple elements to the fusion or op behind them;
    None for a value the body reads from its parameter unchanged."""
    for _ in range(16):
        line = defs.get(name)
        if line is None:
            return None
        rhs = line.split(" = ", 1)[1]
        op = _OPCODE.search(rhs)
        if op and op.group(1) in ("bitcast", "copy", "get-tuple-element", "copy-start", "copy-done"):
            source = re.search(r"\(\s*(?:[^%)]*\s)?%([\w.\-]+)", rhs[op.start():])
            if source is None:
                return None
            name = source.group(1)
            if defs.get(name, "").split(" = ", 1)[-1].lstrip().startswith("(") and " parameter(" in defs.get(name, ""):
                return None
            continue
        return line
    return None


def compile_plan(name: str) -> dict:
    """The plan's step compiled deviceless for a v5e chip, and its accumulation fusions."""
    import yaml

    from testbed.plan.io import plan_from_dict
    from testbed.runner.check_sharding import spmd_step
    from testbed.runner.devices import build_mesh, plan_placement
    from testbed.runner.tpu_compile import target_devices
    from testbed.topology.compile_target import parse_target

    spec = yaml.safe_load((SUITE / f"{name}.yaml").read_text())
    plan = plan_from_dict(spec)
    devices = target_devices(parse_target("tpu:v5e:1x1"))
    _, step, _, args = spmd_step(plan, build_mesh(plan_placement(plan, devices), devices))
    text = step.lower(*args).compile().as_text()
    return {"plan": name, "microbatches": plan.batch.microbatches, **accumulations(text)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for accumulate.json")
    parser.add_argument("plans", nargs="*", default=list(PLANS), help=f"suite plans (default: {' '.join(PLANS)})")
    args = parser.parse_args(argv)
    from testbed.runner import devices

    devices.prepare(devices.DeviceRequest(kind="emulated", count=1))
    from testbed.runner.tpu_compile import versions

    rows = [compile_plan(name) for name in args.plans]
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": versions(), "target": "tpu:v5e:1x1",
              "command": "python benchmarks/tpu_accumulate.py --out OUT " + " ".join(args.plans), "rows": rows}
    write_atomic(Path(args.out) / "accumulate.json", json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
