"""Where a plan's step time goes on the chip: a per-op profile of the runner's step, recorded as data.

For each plan: build the runner's trainer (as benchmarks/tpu_chip.py does), warm it up, trace ``--steps``
steps with ``jax.profiler.trace`` and read the trace back with ``jax.profiler.ProfileData`` (no TensorBoard
needed). From each device plane (``/device:TPU:0``) it keeps, per trace line, the total time per step, and for
the op line ("XLA Ops") every op's time per step with the stats XLA attached to it (its category, FLOPs and
bytes where the profiler reports them), the ops sorted by time; ops below ``--min-share`` of the step are
summed into one row. It also keeps each op's fusion kind and root from the compiled HLO text, so a test can
tell matmuls (convolution fusions), attention kernels (custom calls) and elementwise passes apart without
the chip.

Writes ``OUT/profiles.json`` atomically (date, JAX/jaxlib/libtpu versions, device kind, the command, one
entry per plan) and prints a summary as ONE JSON object. On a CPU host (``--quick``) there is no device
plane: the script still runs end to end and records the host's op line where it finds one.

    python benchmarks/tpu_profile.py --out DIR [--steps 3] [--min-share 0.002] PLAN ...
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

from tpu_chip import versions, write_atomic  # noqa: E402

#: Stats kept per op (the TPU profiler's names; others are dropped to keep the file small).
KEPT_STATS = ("hlo_category", "flops", "model_flops", "bytes_accessed", "raw_bytes_accessed", "memory_bw")


def _stat_value(value):
    """A stat as JSON: numbers as they are, anything else as a short string."""
    if isinstance(value, (int, float)):
        return value
    return str(value)[:120]


def read_trace(path: str, steps: int, min_share: float) -> dict:
    """Per device plane: each line's time per step, and the op line's ops (time per step, count, stats)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    planes = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:") and plane.name != "/host:CPU":
            continue
        lines, ops = {}, {}
        for line in plane.lines:
            total = 0.0
            for event in line.events:
                total += event.duration_ns
                if line.name not in ("XLA Ops", "python") and not line.name.startswith("tf_XLA"):
                    continue
                op = ops.setdefault(event.name, {"ns": 0.0, "count": 0, "line": line.name})
                op["ns"] += event.duration_ns
                op["count"] += 1
                if "stats" not in op:
                    op["stats"] = {k: _stat_value(v) for k, v in event.stats if k in KEPT_STATS}
            lines[line.name] = total / steps
        planes[plane.name] = {"lines_ns_per_step": lines, "ops": _top_ops(ops, steps, min_share)}
    return planes


def _top_ops(ops: dict, steps: int, min_share: float) -> list[dict]:
    """Ops sorted by time per step; those under ``min_share`` of the op line's total folded into one row."""
    rows = sorted(({"name": k, "ns_per_step": v["ns"] / steps, "count_per_step": v["count"] / steps,
                    "line": v["line"], **v.get("stats", {})} for k, v in ops.items()),
                  key=lambda r: -r["ns_per_step"])
    total = sum(r["ns_per_step"] for r in rows) or 1.0
    kept = [r for r in rows if r["ns_per_step"] >= min_share * total]
    rest = [r for r in rows if r["ns_per_step"] < min_share * total]
    if rest:
        kept.append({"name": "(other ops)", "ns_per_step": sum(r["ns_per_step"] for r in rest),
                     "count_per_step": sum(r["count_per_step"] for r in rest), "ops": len(rest)})
    return kept


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[^=]*?\b(fusion|custom-call|convolution|dot|copy|"
                    r"all-reduce|while|conditional)\(.*?(?:kind=(k\w+))?(?:.*?calls=%?([\w.\-]+))?"
                    r"(?:.*?custom_call_target=\"([^\"]+)\")?")


def hlo_kinds(hlo_text: str) -> dict:
    """Each top-level instruction's opcode, fusion kind and custom-call target, from the compiled HLO text."""
    kinds = {}
    for line in hlo_text.splitlines():
        match = _INSTR.match(line)
        if match:
            name, opcode, kind, _calls, target = match.groups()
            kinds[name] = {k: v for k, v in (("opcode", opcode), ("kind", kind), ("target", target)) if v}
    return kinds


def profile_plan(path: Path, devices: list, steps: int, min_share: float) -> dict:
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
        planes = read_trace(files[0], steps, min_share) if files else {}
        kinds = hlo_kinds(trainer.compiled_programs(state)[0].as_text())
    for plane in planes.values():
        for op in plane["ops"]:
            op.update({f"hlo_{k}": v for k, v in kinds.get(op["name"], {}).items()})
    return {"plan": path.stem, "ok": True, "compile_s": round(compile_s, 3), "traced_s": round(traced_s, 4),
            "steps": steps, "planes": planes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for profiles.json")
    parser.add_argument("--steps", type=int, default=3, help="steps traced per plan (default 3)")
    parser.add_argument("--min-share", type=float, default=0.002,
                        help="ops under this share of the op line are summed into one row (default 0.002)")
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
            rows.append(profile_plan(path, devices, args.steps, args.min_share))
        except Exception as exc:  # noqa: BLE001 -- a plan that fails is recorded, the others still run
            rows.append({"plan": path.stem, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                         "trace": traceback.format_exc()[-1500:]})
        jax.clear_caches()
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "versions": versions(), "platform": devices[0].platform, "device_kind": devices[0].device_kind,
           "command": "python benchmarks/tpu_profile.py " + " ".join(
               re.sub(r"^.*/plans/", "plans/", a) for a in (argv if argv is not None else sys.argv[1:])
               if not a.startswith("/")),
           "plans": rows, "wall_s": round(time.perf_counter() - began, 1)}
    write_atomic(Path(args.out) / "profiles.json", json.dumps(out, indent=1) + "\n")
    print(json.dumps({"plans": [{"plan": r["plan"], "ok": r["ok"], **({"error": r["error"][:200]} if "error" in r
                                                                       else {})} for r in rows],
                      "wall_s": out["wall_s"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
