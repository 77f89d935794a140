"""Where a plan's step time goes on the chip: a per-op profile of the runner's step, recorded as data.

For each plan: build the runner's trainer (as benchmarks/tpu_chip.py does), warm it up, trace ``--steps``
steps with ``jax.profiler.trace`` and read the trace back with ``jax.profiler.ProfileData`` (no TensorBoard
needed). From each device plane (``/device:TPU:0``) it keeps each trace line's time per step, every op's time
summed into a class (:data:`CLASSES`: a fusion is a matmul when its body holds a convolution or dot, with the
optimizer when it reads optimizer state, ...; the compiled HLO text says what each fusion's body holds), and the
``--top`` longest ops with their HLO instruction text (shapes, fusion kind, operands).

Writes ``OUT/profiles.json`` atomically (date, JAX/jaxlib/libtpu versions, device kind, the command, one
entry per plan) and prints a summary as ONE JSON object. On a CPU host (``--quick``) there is no device
plane: the script still runs end to end and records no planes.

    python benchmarks/tpu_profile.py --out DIR [--steps 3] [--top 150] PLAN ...
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tpu_chip import relative_command, versions, write_atomic  # noqa: E402

#: Classes an op's time is summed into (:func:`op_class`); ``control`` (a while loop, a call) holds ops that the
#: trace also lists one by one, so it is left out of the classes' total.
CLASSES = ("matmul", "matmul+optimizer", "optimizer", "attention", "elementwise", "reduction", "copy", "custom-call",
           "collective", "control", "other")
_OPCODE = re.compile(r"\)?\s([a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_KIND = re.compile(r"kind=(k\w+)")


def computations(hlo_text: str) -> dict[str, set[str]]:
    """The opcodes inside each computation of a compiled HLO module's text (a fusion's body included)."""
    out: dict[str, set[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            current = out.setdefault(name.lstrip("%"), set())
        elif current is not None and " = " in line:
            match = _OPCODE.search(line.split(" = ", 1)[1])
            if match:
                current.add(match.group(1))
    return out


def op_class(text: str, bodies: dict[str, set[str]]) -> str:
    """An op of the trace (its HLO instruction's text) as one of :data:`CLASSES`: a fusion by what its body holds."""
    head, _, rest = text.partition(" = ")
    match = _OPCODE.search(rest)
    opcode = match.group(1) if match else ""
    called = _CALLS.search(rest)
    body = bodies.get(called.group(1), set()) if called else set()
    optimizer = "opt_state" in rest
    if opcode in ("while", "conditional", "call"):
        return "control"
    if opcode == "custom-call" or head.lstrip("%").startswith(("splash", "flash")):
        return "attention" if any(w in text for w in ("splash", "flash", "mha")) else "custom-call"
    if opcode in ("convolution", "dot") or {"convolution", "dot"} & body:
        return "matmul+optimizer" if optimizer else "matmul"
    if optimizer:
        return "optimizer"
    if any(opcode.startswith(c) for c in ("all-", "reduce-scatter", "collective", "send", "recv")):
        return "collective"
    if opcode in ("copy", "copy-start", "copy-done", "transpose") or (
            opcode == "fusion" and body and body <= {"copy", "transpose", "bitcast", "parameter"}):
        return "copy"
    if opcode == "fusion":
        return "reduction" if (_KIND.search(rest) or [None, ""])[1] == "kInput" or "reduce" in body else "elementwise"
    return "other"


def read_trace(path: str, steps: int, bodies: dict[str, set[str]], top: int) -> dict:
    """Per device plane: each line's time per step, each op class's time per step, and the ``top`` longest ops
    (their instruction text cut to 240 characters, class, time and count per step)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    planes = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        lines, ops = {}, {}
        for line in plane.lines:
            total = 0.0
            for event in line.events:
                total += event.duration_ns
                if line.name == "XLA Ops":
                    op = ops.setdefault(event.name, [0.0, 0])
                    op[0] += event.duration_ns
                    op[1] += 1
            lines[line.name] = total / steps
        classes = dict.fromkeys(CLASSES, 0.0)
        rows = []
        for text, (ns, count) in ops.items():
            kind = op_class(text, bodies)
            classes[kind] += ns / steps
            rows.append({"op": text[:240], "class": kind, "ns_per_step": ns / steps, "count_per_step": count / steps})
        rows.sort(key=lambda r: -r["ns_per_step"])
        planes[plane.name] = {"lines_ns_per_step": lines, "classes_ns_per_step": classes, "ops": len(rows),
                              "top_ops": rows[:top]}
    return planes


def profile_plan(path: Path, devices: list, steps: int, top: int) -> dict:
    """One plan: warm up, trace ``steps`` steps, read the trace; the HLO's op kinds for the ops kept."""
    import jax

    from testbed.plan.io import load_plan
    from testbed.runner.precision import matmul_precision
    from testbed.runner.train import build_trainer, first_step

    plan = load_plan(str(path))
    with matmul_precision(plan), tempfile.TemporaryDirectory() as trace_dir:
        trainer = build_trainer(plan, devices)
        state, loss, compile_s = first_step(trainer)
        state, loss = trainer.step(state, 1)
        jax.block_until_ready((state, loss))
        began = time.perf_counter()
        with jax.profiler.trace(trace_dir):
            for i in range(steps):
                state, loss = trainer.step(state, 2 + i)
                jax.block_until_ready((state, loss))
        traced_s = time.perf_counter() - began
        files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        bodies = computations(trainer.compiled_programs(state)[0].as_text())
        planes = read_trace(files[0], steps, bodies, top) if files else {}
    return {"plan": path.stem, "ok": True, "compile_s": round(compile_s, 3), "traced_s": round(traced_s, 4),
            "steps": steps, "planes": planes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for profiles.json")
    parser.add_argument("--steps", type=int, default=3, help="steps traced per plan (default 3)")
    parser.add_argument("--top", type=int, default=150, help="longest ops kept one by one per plan (default 150)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds after which plans left are skipped")
    parser.add_argument("plans", nargs="+", help="plan files")
    args = parser.parse_args(argv)
    began = time.perf_counter()

    import jax

    from testbed.runner.devices import select_devices

    devices = select_devices(1)
    rows = []
    for path in map(Path, args.plans):
        if time.perf_counter() - began > args.budget_s:
            rows.append({"plan": path.stem, "ok": False, "skipped": "budget spent"})
            continue
        try:
            rows.append(profile_plan(path, devices, args.steps, args.top))
        except Exception as exc:  # noqa: BLE001 -- a plan that fails is recorded, the others still run
            rows.append({"plan": path.stem, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                         "trace": traceback.format_exc()[-1500:]})
        jax.clear_caches()
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "versions": versions(), "platform": devices[0].platform, "device_kind": devices[0].device_kind,
           "command": "python benchmarks/tpu_profile.py " + relative_command(" ".join(sys.argv[1:] if argv is None else argv)),
           "plans": rows, "wall_s": round(time.perf_counter() - began, 1)}
    write_atomic(Path(args.out) / "profiles.json", json.dumps(out, indent=1) + "\n")
    print(json.dumps({"plans": [{"plan": r["plan"], "ok": r["ok"], **({"error": r["error"][:200]} if "error" in r
                                                                       else {})} for r in rows],
                      "wall_s": out["wall_s"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
