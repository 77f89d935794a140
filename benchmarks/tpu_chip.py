"""The single-chip TPU suite, measured: calibrate the chip, time each plan with the runner, record it all as data.

In one command on a TPU VM (one chip, ``--devices local``):

1. ``testbed calibrate --devices local --rounds R --out OUT/calibrated.yaml`` in a fresh process (every
   group a step needs: GEMM shapes per dtype, HBM bandwidth, elementwise passes, attention, dispatch);
2. in this process (the chip opened once), for each plan of :data:`SUITE`: build the runner's trainer,
   time its compile and warm-up step, then ``rounds`` rounds of ``steps`` steps (each round's median, and
   the median of those), the runner's MFU at that median (testbed.runner.results.device_peak_flops of the
   dtype the plan's matmuls run at), XLA's ``memory_analysis()`` of the compiled step and its HLO's facts
   (testbed.runner.hlo_facts); a plan that fails (out of memory) is recorded with its error, and plans
   left when ``--budget-s`` is spent are recorded as skipped.

It writes, atomically, the layout ``benchmarks/tpu_chip/`` commits: ``OUT/calibrated.yaml`` and
``OUT/calibration.json`` (calibrate's topology and JSON), ``OUT/runs.json`` (date, JAX/jaxlib/libtpu
versions, device kind, the command, one row per plan) and ``OUT/plans/*.yaml`` (the plans as run), and
prints ``runs.json``'s summary as ONE JSON object. tests/test_tpu_chip.py compares today's predictions with
the recorded file. ``--quick`` (a CPU host, to check the script end to end): three small plans, calibrate
--quick, 2 steps x 2 rounds.

    python benchmarks/tpu_chip.py --out DIR [--quick] [--steps 5] [--rounds 3] [--budget-s 480] [PLAN ...]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The suite (plans/validation-1dev/): GPT and Llama-style, bf16 and fp32 (default and HIGHEST precision), remat none /
#: selective / full, gradient accumulation, flash attention, seq 1024-4096; every one predicted to fit a 16 GiB v5e chip.
SUITE = (
    "gpt125m-fp32", "gpt125m-fp32-highest", "gpt125m-bf16", "gpt125m-bf16-accum4", "gpt125m-bf16-flash-seq4096",
    "gpt350m-bf16-selective-accum2", "gpt350m-bf16-full-accum2", "llama150m-fp32-flash", "llama400m-bf16-flash",
    "llama400m-bf16-full", "llama400m-bf16-flash-seq4096", "llama1b-bf16-flash", "llama1b-bf16-flash-full",
    "gpt125m-bf16-accum8", "gpt125m-bf16-accum2", "gpt350m-bf16-selective-accum4", "gpt350m-bf16-selective-accum6",
    "llama400m-bf16-flash-seq1024", "gpt125m-bf16-accum16", "gpt350m-bf16-selective-accum8",
)

#: ``--quick``'s plans: small shapes covering the same switches (fp32 / bf16, remat, accumulation, flash).
QUICK_PLANS = {
    "quick-gpt-fp32": "model: {kind: gpt, layers: 2, d_model: 128, heads: 2, d_ff: 512, seq_len: 256, vocab: 512}\n"
                      "batch: {global_batch: 4, microbatches: 2}\nmesh: {data: 1}\nprecision: fp32\nremat: none\n",
    "quick-llama-bf16-flash": "model: {layers: 2, d_model: 128, heads: 2, kv_heads: 1, d_ff: 384, seq_len: 256, "
                              "vocab: 512, mlp: swiglu, norm: rmsnorm, position: rope, bias: false, attention: flash}\n"
                              "batch: {global_batch: 4}\nmesh: {data: 1}\nprecision: bf16-mixed\nremat: full\n",
    "quick-gpt-bf16-selective": "model: {kind: gpt, layers: 2, d_model: 128, heads: 2, d_ff: 512, seq_len: 128, "
                                "vocab: 512}\nbatch: {global_batch: 4}\nmesh: {data: 1}\nprecision: bf16-mixed\n"
                                "remat: selective\n",
}


def versions() -> dict:
    """JAX, jaxlib and libtpu versions (None where not installed)."""
    out = {}
    for name in ("jax", "jaxlib", "libtpu", "libtpu-nightly"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def calibrate(out: Path, quick: bool, rounds: int) -> dict:
    """``testbed calibrate --devices local`` in a fresh process (the chip is free again when it exits)."""
    cmd = [sys.executable, "-m", "testbed.cli", "calibrate", "--devices", "local", "--rounds", str(rounds),
           "--out", str((out / "calibrated.yaml").resolve()), "--json"] + (["--quick"] if quick else [])
    start = time.perf_counter()
    # Run outside the source tree: an installed testbed (its bundled topologies and plans) is the one imported.
    done = subprocess.run(cmd, cwd=out, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        return {"ok": False, "seconds": round(seconds, 1), "error": done.stderr[-4000:]}
    result = json.loads(done.stdout)
    write_atomic(out / "calibration.json", json.dumps(result, indent=1) + "\n")
    return {"ok": True, "seconds": round(seconds, 1), "topology": str(out / "calibrated.yaml")}


def memory_facts(compiled) -> dict | None:
    """``memory_analysis()`` of a compiled step: argument, output, temp, alias bytes, their total less aliases
    (testbed.runner.pipeline.memory.program_bytes's rule) and XLA's peak where it reports one."""
    mem = compiled.memory_analysis()
    if mem is None:
        return None
    out = {k: int(getattr(mem, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    peak = getattr(mem, "peak_memory_in_bytes", None)
    if peak is not None:
        out["peak"] = int(peak)
    return out


def time_plan(path: Path, devices: list, steps: int, rounds: int) -> dict:
    """One plan on the chip: compile + warm-up seconds, each round's step times, the median of the rounds'
    medians, MFU there, memory_analysis and HLO facts of the compiled step."""
    import jax

    from testbed.plan.io import load_plan
    from testbed.runner.devices import describe
    from testbed.runner.hlo_facts import hlo_facts
    from testbed.runner.precision import matmul_precision
    from testbed.runner.train import build_trainer, first_step, plan_peak_flops
    from testbed.model.costs import model_flops_per_step

    plan = load_plan(str(path))
    with matmul_precision(plan):
        trainer = build_trainer(plan, devices)
        state, loss, compile_s = first_step(trainer)
        times: list[list[float]] = []
        for r in range(rounds):
            row = []
            for i in range(steps):
                t = time.perf_counter()
                state, loss = trainer.step(state, 1 + r * steps + i)
                jax.block_until_ready((state, loss))
                row.append(time.perf_counter() - t)
            times.append(row)
        compiled = trainer.compiled_programs(state)[0]
    median = statistics.median(statistics.median(row) for row in times)
    dtype, peak = plan_peak_flops(plan, describe(devices))
    batch = plan.batch.global_batch // plan.batch.microbatches
    return {"plan": path.stem, "ok": True, "compile_s": round(compile_s, 3), "step_times_s": times,
            "median_s": median, "loss": float(loss), "matmul_dtype": dtype,
            "attention_kernel": str(getattr(trainer, "attention_kernel", "")),
            "mfu": None if peak is None else model_flops_per_step(plan) / (peak * median),
            "memory": memory_facts(compiled),
            "hlo": hlo_facts(compiled.as_text(), batch=batch, seq_len=plan.model.seq_len).as_dict()}


def suite_paths(args: argparse.Namespace, out: Path) -> list[Path]:
    """The plans to run, copied under ``OUT/plans/`` (what was run is what the data file names)."""
    if args.quick and not args.plans:
        sources = []
        for name, text in QUICK_PLANS.items():
            write_atomic(out / "plans" / f"{name}.yaml", f"name: {name}\n{text}optimizer: {{name: adamw, "
                                                         "learning_rate: 3.0e-4}\n")
            sources.append(out / "plans" / f"{name}.yaml")
        return sources
    sources = [Path(p) for p in args.plans] or [ROOT / "plans/validation-1dev" / f"{n}.yaml" for n in SUITE]
    (out / "plans").mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy(p, out / "plans" / p.name)) for p in sources]


def relative_command(command: str) -> str:
    """A recorded command with the checkout's and the device machine's folders left out (``plans/...``, ``OUT``)."""
    words = []
    for word in command.split():
        if "/plans/" in word:
            word = "plans/" + word.split("/plans/", 1)[1]
        elif word.startswith("/"):
            word = "OUT"
        words.append(word)
    return " ".join(words)


def merge_runs(calls: list[dict]) -> dict:
    """Several calls' ``runs.json`` as one (a suite longer than one call's device time, under 10 minutes, runs in several): each
    call's date, command and wall time under ``calls``; one row per plan, from the first call where it ran (or,
    where it never ran, its last failure), its other successful runs' medians under ``repeats``."""
    rows: dict[str, dict] = {}
    for index, call in enumerate(calls):
        for row in call["plans"]:
            row = {k: v for k, v in row.items() if k != "trace"} | {"call": index}  # a trace names the machine's paths
            kept = rows.get(row["plan"])
            if kept is None or (not kept["ok"] and (row["ok"] or "skipped" not in row)):
                rows[row["plan"]] = row | ({"repeats": kept.get("repeats", [])} if kept else {})
            elif kept["ok"] and row["ok"]:
                kept.setdefault("repeats", []).append({"call": index, "median_s": row["median_s"]})
    first = calls[0]
    calibrated = [c["calibration"] for c in calls if c.get("calibration")]
    return {"date": first["date"], "versions": first["versions"], "platform": first["platform"],
            "device_kind": first["device_kind"], "command": " ; ".join(relative_command(c["command"]) for c in calls),
            "steps": first["steps"], "rounds": first["rounds"],
            "calibration": None if not calibrated else {k: v for k, v in calibrated[0].items() if k != "topology"},
            "calls": [{"date": c["date"], "command": relative_command(c["command"]), "wall_s": c["wall_s"],
                       "versions": c["versions"]} for c in calls],
            "plans": list(rows.values())}


def extend_runs(recorded: dict, calls: list[dict]) -> dict:
    """A merged ``runs.json`` extended by later calls made after the runner changed: each call added under
    ``calls``; a plan a later call ran replaces the recorded row (it measures today's runner), the row replaced kept
    under ``superseded`` and the new row's ``runner_since`` the call's date (what was measured of an older runner,
    e.g. a profile's step, pairs with the row of its time: benchmarks/tpu_chip_fit.py), the others stay."""
    first = [{k: recorded.get(k) for k in ("date", "command", "wall_s", "versions")}]  # one call's own file
    first[0]["command"] = relative_command(first[0]["command"])
    merged = dict(recorded, calls=list(recorded.get("calls", first)), command=relative_command(recorded["command"]))
    rows = {r["plan"]: ({"call": 0} | r) for r in recorded["plans"]}
    for call in calls:
        index = len(merged["calls"])
        merged["calls"].append({"date": call["date"], "command": relative_command(call["command"]),
                                "wall_s": call["wall_s"], "versions": call["versions"]})
        merged["command"] += " ; " + relative_command(call["command"])
        for r in call["plans"]:
            if r["ok"]:
                old = rows.get(r["plan"])
                row = {k: v for k, v in r.items() if k != "trace"} | {"call": index, "runner_since": call["date"]}
                rows[r["plan"]] = row | ({"superseded": old} if old else {})
    return merged | {"plans": list(rows.values())}


def measured_then(row: dict, date: str) -> dict:
    """The row measuring the runner of ``date`` (an ISO date): ``row``, or the row it superseded where the runner
    changed after ``date`` (:func:`extend_runs`)."""
    while row.get("runner_since") and row["runner_since"] > date and "superseded" in row:
        row = row["superseded"]
    return row


def merge_main(out: Path, sources: list[str], extend: str | None = None) -> int:
    """``--merge``: the calls' ``runs.json`` files merged into ``OUT/runs.json`` (:func:`merge_runs`)."""
    calls = sorted((json.loads(Path(s).read_text()) for s in sources), key=lambda c: c["date"])
    kinds = calls + ([json.loads(Path(extend).read_text())] if extend else [])
    if len({c["device_kind"] for c in kinds}) != 1 or len({json.dumps(c["versions"]) for c in kinds}) != 1:
        print("tpu_chip.py --merge: the calls ran on different devices or JAX/libtpu versions", file=sys.stderr)
        return 2
    merged = merge_runs(calls) if extend is None else extend_runs(json.loads(Path(extend).read_text()), calls)
    write_atomic(out / "runs.json", json.dumps(merged, indent=1) + "\n")
    print(json.dumps({"calls": len(calls), "plans": len(merged["plans"]),
                      "ok": sum(r["ok"] for r in merged["plans"])}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the data files (benchmarks/tpu_chip/'s layout)")
    parser.add_argument("--quick", action="store_true", help="small plans, calibrate --quick, 2 steps x 2 rounds")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round (default 5; --quick 2)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per plan (default 3; --quick 2)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="seconds after which plans left are skipped (default 480: one 9-minute call)")
    parser.add_argument("--skip-calibrate", action="store_true", help="time the plans only")
    parser.add_argument("--merge", nargs="+", metavar="RUNS_JSON",
                        help="merge several calls' runs.json into OUT/runs.json instead of running anything")
    parser.add_argument("--extend", metavar="RUNS_JSON",
                        help="with --merge: add the calls to this merged runs.json, their rows replacing its rows")
    parser.add_argument("plans", nargs="*", help=f"plans (default: {', '.join(SUITE)})")
    args = parser.parse_args(argv)
    if args.merge:
        return merge_main(Path(args.out), args.merge, args.extend)
    steps = args.steps or (2 if args.quick else 5)
    rounds = args.rounds or (2 if args.quick else 3)
    out = Path(args.out)
    began = time.perf_counter()
    paths = suite_paths(args, out)
    calibration = None if args.skip_calibrate else calibrate(out, args.quick, rounds)

    import jax

    from testbed.runner.devices import select_devices

    devices = select_devices(1)
    rows = []
    for path in paths:
        if time.perf_counter() - began > args.budget_s:
            rows.append({"plan": path.stem, "ok": False, "skipped": "budget spent"})
            continue
        try:
            rows.append(time_plan(path, devices, steps, rounds))
        except Exception as exc:  # noqa: BLE001 -- a plan that fails on the chip (OOM) is a result too
            rows.append({"plan": path.stem, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                         "trace": traceback.format_exc()[-2000:]})
        jax.clear_caches()
    runs = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": versions(), "platform": devices[0].platform, "device_kind": devices[0].device_kind,
            "command": "python benchmarks/tpu_chip.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "steps": steps, "rounds": rounds, "calibration": calibration, "plans": rows,
            "wall_s": round(time.perf_counter() - began, 1)}
    write_atomic(out / "runs.json", json.dumps(runs, indent=1) + "\n")
    print(json.dumps({k: v for k, v in runs.items() if k != "plans"}
                     | {"plans": [{k: r[k] for k in ("plan", "ok", "median_s", "mfu", "compile_s", "skipped", "error")
                                   if k in r} for r in rows]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
