"""testbed's memory and collectives vs XLA:TPU's own compile of multi-chip plans (ground truth, recorded).

XLA:TPU compiles for a slice without its chips (libtpu's deviceless topology,
``testbed.runner.tpu_compile``): ``--collect`` compiles each plan of :data:`PLANS`
for its TPU target with the runner's own step (``check-sharding --compile``), one
subprocess per plan under a time limit, and writes each report as
``benchmarks/xla_tpu/<name>.json`` (the plan, target, date, jax/jaxlib/libtpu
versions, the command, compile seconds, memory, collectives per mesh axis,
fusions, FLOPs); a plan whose compile runs past the limit is recorded as
``status: timeout``. Needs libtpu (``PYTHONPATH`` holding it, or
``pip install 'jax-testbed[tpu]'``); takes minutes per plan on a loaded CPU host.

Without ``--collect`` it reads the recorded data (no JAX, no libtpu) and prints
ONE JSON object: per plan testbed's memory (``testbed.model.memory``: total and
parts) beside XLA:TPU's (argument, output, temp, alias, total) and the error,
the out-of-memory verdicts, and testbed's predicted collectives per mesh axis
(the plan-driven task graph, :mod:`testbed.compiled.compare`) beside the
compiled HLO's; the median and max memory error over the multi-chip plans against XLA's
total and against its peak (the arguments and the most temporaries live at once, what
testbed's instants price; ``benchmarks/xla_tpu_heap.py`` reads what the total holds beyond
it), the verdicts that disagree and the plans whose collectives differ. ``--table PATH``
also writes the markdown table of docs/xla_tpu.md.

``--heldout`` takes the held-out plans of :func:`_heldout` instead (``benchmarks/xla_tpu_heldout/``): plans
none of testbed's XLA:TPU rules was written or fitted on, whose predictions ``--heldout --predict`` records
(``predicted.json``, with the commit) before ``--heldout --collect`` compiles them into ``compiled/``. The
default run reports them under ``heldout``: the current code's predictions (key ``today``) and the recorded ones
against XLA's.

    PYTHONPATH=/tmp/tpusite nice python benchmarks/memory_vs_xla_tpu.py --collect [--only NAME ...] [--limit CPU_S]
    python benchmarks/memory_vs_xla_tpu.py --heldout --predict
    python benchmarks/memory_vs_xla_tpu.py --heldout --collect
    python benchmarks/memory_vs_xla_tpu.py [--table docs/xla_tpu_table.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "xla_tpu"
HELDOUT = ROOT / "benchmarks" / "xla_tpu_heldout"

_GPT = {"kind": "gpt", "vocab": 32000}
_LLAMA = {"kind": "gpt", "mlp": "swiglu", "norm": "rmsnorm", "position": "rope", "bias": False, "vocab": 32000,
          "rope_theta": 500000.0}


def _model(base: dict, d: int, layers: int, seq: int, heads: int, **extra) -> dict:
    ff = {"swiglu": int(8 * d / 3) // 256 * 256}.get(base.get("mlp"), 4 * d)
    return {**base, "layers": layers, "d_model": d, "heads": heads, "d_ff": ff, "seq_len": seq, **extra}


def _plan(name: str, target: str, model: dict, batch: int, mesh: dict, precision: str = "bf16-mixed",
          remat: str = "none", microbatches: int = 1, **extra) -> dict:
    return {"target": target, "plan": {"name": name, "model": model,
                                       "batch": {"global_batch": batch, "microbatches": microbatches},
                                       "mesh": mesh, "precision": precision, "remat": remat,
                                       "optimizer": {"name": "adamw", "learning_rate": 3.0e-4}, **extra}}


def _plans() -> list[dict]:
    """Multi-chip plans over the parallelisms, model kinds, remat, precisions and 4 to 1,024 chips: realistic
    widths, few layers (a compile takes minutes on a loaded CPU host)."""
    gpt1k, gpt2k = _model(_GPT, 1024, 2, 2048, 16), _model(_GPT, 2048, 2, 2048, 16)
    llama2k = _model(_LLAMA, 2048, 2, 2048, 16, kv_heads=4)
    llama4k = _model(_LLAMA, 4096, 2, 4096, 32, kv_heads=8)
    moe = _model(_LLAMA, 1024, 2, 2048, 16, kv_heads=4, experts=8, top_k=2)
    return [
        _plan("gpt1k-data4", "tpu:v5e:2x2", gpt1k, 8, {"data": 4}),
        _plan("gpt1k-fsdp4-full", "tpu:v5e:2x2", gpt1k, 8, {"fsdp": 4}, remat="full"),
        _plan("gpt1k-tensor4", "tpu:v5e:2x2", gpt1k, 4, {"tensor": 4}),
        _plan("gpt1k-tensor4-sp-selective", "tpu:v5e:2x2", gpt1k, 4, {"tensor": 4}, remat="selective",
              sequence_parallel=True),
        _plan("llama2k-fsdp4-fp32", "tpu:v5e:2x2", llama2k, 4, {"fsdp": 4}, precision="fp32"),
        _plan("moe1k-expert4", "tpu:v5e:2x2", moe, 8, {"expert": 4}),
        _plan("gpt1k-context4", "tpu:v5e:2x2", _model(_GPT, 1024, 2, 4096, 16, attention="flash"), 2, {"context": 4}),
        _plan("gpt2k-fsdp16-full", "tpu:v5e:4x4", gpt2k, 32, {"fsdp": 16}, remat="full"),
        _plan("llama2k-fsdp4-tensor4-sp", "tpu:v5e:4x4", llama2k, 8, {"fsdp": 4, "tensor": 4}, remat="selective",
              sequence_parallel=True),
        _plan("gpt1k-stage2-data2", "tpu:v5e:2x2", _model(_GPT, 1024, 4, 2048, 16), 8, {"stage": 2, "data": 2},
              microbatches=4, schedule="1f1b"),
        _plan("gpt2k-data4-tensor4-full", "tpu:v5e:4x4", gpt2k, 16, {"data": 4, "tensor": 4}, remat="full"),
        _plan("llama2k-fsdp16-fp32-selective", "tpu:v5e:4x4", llama2k, 16, {"fsdp": 16}, precision="fp32",
              remat="selective"),
        _plan("moe1k-data4-expert4", "tpu:v5e:4x4", moe, 16, {"data": 4, "expert": 4}, remat="full"),
        _plan("gpt1k-data2-mb2", "tpu:v5e:2x2", gpt1k, 8, {"data": 2, "tensor": 2}, microbatches=2),
        _plan("llama2k-fsdp8", "tpu:v5p:2x2x2", llama2k, 16, {"fsdp": 8}),
        _plan("gpt1k-data2-tensor4", "tpu:v5p:2x2x2", gpt1k, 8, {"data": 2, "tensor": 4}, remat="selective"),
        _plan("llama2k-fsdp64", "tpu:v5e:8x8", llama2k, 64, {"fsdp": 64}, remat="full"),
        _plan("gpt2k-fsdp16-tensor4-sp", "tpu:v5e:8x8", gpt2k, 32, {"fsdp": 16, "tensor": 4}, sequence_parallel=True),
        _plan("gpt2k-fsdp256-full", "tpu:v5e:16x16", gpt2k, 256, {"fsdp": 256}, remat="full"),
        _plan("gpt1k-data256", "tpu:v5e:16x16", gpt1k, 256, {"data": 256}, remat="full"),
        _plan("llama4k-fsdp64-tensor4-sp", "tpu:v5e:16x16", llama4k, 64, {"fsdp": 64, "tensor": 4}, remat="full",
              sequence_parallel=True),
        _plan("llama2k-data8-fsdp8-selective", "tpu:v5p:4x4x4", llama2k, 64, {"data": 8, "fsdp": 8},
              remat="selective"),
        _plan("gpt2k-fsdp8-tensor8-sp", "tpu:v5p:4x4x4", gpt2k, 8, {"fsdp": 8, "tensor": 8}, sequence_parallel=True),
        _plan("gpt1k-fsdp16-context4", "tpu:v5p:4x4x4", _model(_GPT, 1024, 2, 4096, 16, attention="flash"), 16,
              {"fsdp": 16, "context": 4}),
        _plan("llama4k-fsdp256-tensor4", "tpu:v5p:8x8x16", llama4k, 256, {"fsdp": 256, "tensor": 4}, remat="full"),
        _plan("gpt2k-fsdp1024-full", "tpu:v5p:8x8x16", gpt2k, 1024, {"fsdp": 1024}, remat="full"),
        _plan("gpt2k-data4-b64-oom", "tpu:v5e:2x2", gpt2k, 64, {"data": 4}),
        _plan("gpt1k-data4-fp32", "tpu:v5e:2x2", gpt1k, 8, {"data": 4}, precision="fp32", remat="selective"),
        _plan("llama1b-fsdp256-flash", "tpu:v5e:16x16",  # the chip suite's 0.85B Llama whole, as users shard it
              _model(_LLAMA, 2048, 16, 2048, 16, kv_heads=4, d_ff=5632, attention="flash"), 256, {"fsdp": 256}),
    ]


def _heldout() -> list[dict]:
    """Multi-chip plans of widths, meshes and targets the recorded set lacks (an 8-chip v5e, a 128-chip v5p,
    context with fsdp, expert with data, accumulation under tensor parallelism, fp32 fsdp x tensor, 3k widths),
    predicted before they are compiled: how the memory and collective rules fare on plans they were not written on."""
    llama3k = _model(_LLAMA, 3072, 2, 2048, 24, kv_heads=8)
    gpt1536 = _model(_GPT, 1536, 2, 1024, 12)
    llama4k = _model(_LLAMA, 4096, 2, 4096, 32, kv_heads=8)
    moe2k = _model(_LLAMA, 2048, 2, 2048, 16, kv_heads=4, experts=8, top_k=2)
    return [
        _plan("ho-llama3k-data2-fsdp8-selective", "tpu:v5e:4x4", llama3k, 32, {"data": 2, "fsdp": 8},
              remat="selective"),
        _plan("ho-gpt1536-data4-tensor2-mb4", "tpu:v5e:2x4", gpt1536, 32, {"data": 4, "tensor": 2}, microbatches=4),
        _plan("ho-llama4k-tensor8-sp-full", "tpu:v5p:2x2x2", llama4k, 8, {"tensor": 8}, remat="full",
              sequence_parallel=True),
        _plan("ho-moe2k-data2-expert8-selective", "tpu:v5e:4x4", moe2k, 32, {"data": 2, "expert": 8},
              remat="selective"),
        _plan("ho-gpt2k-fsdp32-tensor2-fp32-full", "tpu:v5e:8x8", _model(_GPT, 2048, 2, 2048, 16), 64,
              {"fsdp": 32, "tensor": 2}, precision="fp32", remat="full"),
        _plan("ho-llama2k-fsdp8-context2-flash", "tpu:v5e:4x4",
              _model(_LLAMA, 2048, 2, 8192, 16, kv_heads=4, attention="flash"), 8, {"fsdp": 8, "context": 2},
              remat="full"),
        _plan("ho-llama2k-data16-fsdp16-full", "tpu:v5e:16x16", _model(_LLAMA, 2048, 2, 2048, 16, kv_heads=4), 256,
              {"data": 16, "fsdp": 16}, remat="full"),
        _plan("ho-gpt1k-data8-seq4096-flash", "tpu:v5e:2x4", _model(_GPT, 1024, 2, 4096, 16, attention="flash"), 16,
              {"data": 8}, remat="selective"),
        _plan("ho-llama4k-fsdp128-full", "tpu:v5p:4x4x8", llama4k, 128, {"fsdp": 128}, remat="full"),
        _plan("ho-gpt3k-data4-tensor4-sp-selective", "tpu:v5e:4x4", _model(_GPT, 3072, 2, 2048, 24), 16,
              {"data": 4, "tensor": 4}, remat="selective", sequence_parallel=True),
    ]


def _single_chip() -> list[dict]:
    """The single-device validation plans (plans/validation-1dev/) on one v5e chip: XLA:TPU's memory for one
    chip is what the chip allocates."""
    import yaml

    out = []
    for path in sorted((ROOT / "plans" / "validation-1dev").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        out.append({"target": "tpu:v5e:1x1", "plan": data, "file": str(path.relative_to(ROOT))})
    return out


def entries() -> list[dict]:
    return _plans() + _single_chip()


def _write(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def compile_one(entry: dict) -> dict:
    """Compile one entry's plan for its target (libtpu needed); the record's ``report``."""
    from testbed.plan.io import plan_from_dict
    from testbed.runner import devices

    devices.prepare(devices.DeviceRequest(kind="emulated", count=1))
    from testbed.runner.tpu_compile import compile_plan, versions
    from testbed.topology.compile_target import parse_target

    plan = plan_from_dict(entry["plan"])
    report = compile_plan(plan, parse_target(entry["target"]))
    return {"report": report.to_dict(), "versions": versions()}


def collect(names: list[str] | None, limit: float, wall: float, again: bool, heldout: bool = False) -> dict:
    """Compile every entry (or ``names``) not yet recorded, each in a subprocess under ``limit`` seconds of CPU
    (a shared host's load does not count against a plan) and ``wall`` seconds of wall time; ``heldout``: the
    held-out plans, into ``benchmarks/xla_tpu_heldout/compiled``."""
    folder = HELDOUT / "compiled" if heldout else DATA
    folder.mkdir(parents=True, exist_ok=True)
    done = []
    listed = _heldout() if heldout else entries()
    if names:  # in the order asked for
        listed = sorted((e for e in listed if e["plan"]["name"] in names), key=lambda e: names.index(e["plan"]["name"]))
    for entry in listed:
        name = entry["plan"]["name"]
        path = folder / f"{name}.json"
        if (names and name not in names) or (path.exists() and not again and not names):
            continue
        command = f"python benchmarks/memory_vs_xla_tpu.py{' --heldout' if heldout else ''} --collect --only {name}"
        start = time.time()
        try:
            proc = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True,
                                  timeout=wall, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CPU,
                                                                                      (int(limit), int(limit) + 5)))
            out = proc.stdout.strip().splitlines()
            result = json.loads(out[-1]) if proc.returncode == 0 and out else None
            status = "ok" if result else "timeout" if proc.returncode == -signal.SIGXCPU else "error"
            message = (None if result else f"compile used more than {limit:.0f} s of CPU" if status == "timeout"
                       else (proc.stderr.strip().splitlines() or ["no output"])[-1][:600])
        except subprocess.TimeoutExpired:
            result, status, message = None, "timeout", f"compile did not finish within {wall:.0f} s"
        record = {"name": name, "target": entry["target"], "plan": entry["plan"], "status": status,
                  "message": message, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": command, "wall_s": round(time.time() - start, 1), **(result or {})}
        if "file" in entry:
            record["file"] = entry["file"]
        _write(path, record)
        done.append({"name": name, "status": status, "wall_s": record["wall_s"]})
        print(json.dumps(done[-1]), file=sys.stderr, flush=True)
    return {"collected": done}


def _prediction(entry: dict) -> dict:
    """testbed's prediction of one entry on its target: memory (total, live peak, fits) and collectives per axis."""
    from testbed.compiled.compare import predicted_collectives
    from testbed.model.memory import memory_breakdown
    from testbed.plan.io import plan_from_dict
    from testbed.topology.compile_target import parse_target, target_topology

    plan = plan_from_dict(entry["plan"])
    topology = target_topology(parse_target(entry["target"]))
    memory = memory_breakdown(plan, topology)
    return {"target": entry["target"], "memory": memory.total, "live_peak": memory.live_peak,
            "fits": memory.total <= topology.device.memory_bytes,
            "collectives": predicted_collectives(plan, topology)}


def predict_heldout() -> dict:
    """The held-out plans' predictions with the date and the commit that made them (recorded before compiling)."""
    commit = subprocess.run(["git", "rev-parse", "--short=8", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    return {"predicted_on": datetime.date.today().isoformat(), "testbed_commit": commit,
            "command": "python benchmarks/memory_vs_xla_tpu.py --heldout --predict",
            "plans": {e["plan"]["name"]: _prediction(e) for e in _heldout()}}


def heldout_result() -> dict | None:
    """The compiled held-out plans against the current code's predictions (``today``: ``compare_all``'s summaries)
    and against the predictions recorded before they were compiled (``before``: memory error median and max,
    collectives equal)."""
    from testbed.compiled.compare import compare_all
    from testbed.compiled.records import load_records

    if not (HELDOUT / "compiled").is_dir():
        return None
    today = compare_all(load_records(HELDOUT / "compiled"))
    recorded = json.loads((HELDOUT / "predicted.json").read_text())["plans"]
    rows = [(r, recorded[r["plan"]]) for r in today["plans"] if r["plan"] in recorded]
    errors = [abs(before["memory"] / r["xla"] - 1) for r, before in rows]
    before = {"count": len(rows), "median_abs_error": statistics.median(errors) if errors else None,
              "max_abs_error": max(errors, default=None),
              "verdicts_disagree": [r["plan"] for r, b in rows if b["fits"] != r["xla_fits"]],
              "collectives_equal": sum(b["collectives"] == r["xla_collectives"] for r, b in rows)}
    return {"today": today["multi_chip"], "before": before, "plans": today["plans"],
            "not_compiled": today["not_compiled"]}


#: Markers of the generated table in a docs page (the text between them is replaced).
START, END = "<!-- xla_tpu table: generated by benchmarks/memory_vs_xla_tpu.py --table -->", "<!-- end of table -->"
HELDOUT_START = "<!-- xla_tpu held-out table: generated by benchmarks/memory_vs_xla_tpu.py --table -->"
HELDOUT_END = "<!-- end of held-out table -->"


def _write_table(path: Path, table: str, start: str = START, end: str = END) -> None:
    """Replace the text between ``start`` and ``end`` in ``path`` (appended with them if it has no such markers),
    atomically."""
    text = path.read_text() if path.exists() else ""
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + start + "\n" + table + end + rest.split(end, 1)[1]
    else:
        text = text + start + "\n" + table + end + "\n"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collect", action="store_true", help="compile with XLA:TPU (needs libtpu) and record")
    parser.add_argument("--only", nargs="*", help="plan names to collect")
    parser.add_argument("--again", action="store_true", help="recompile plans already recorded")
    parser.add_argument("--limit", type=float, default=600.0,
                        help="CPU seconds one compile may take (default 600)")
    parser.add_argument("--wall-limit", type=float, default=3600.0,
                        help="wall seconds one compile may take (default 3600)")
    parser.add_argument("--heldout", action="store_true", help="the held-out plans (benchmarks/xla_tpu_heldout/)")
    parser.add_argument("--predict", action="store_true", help="record the current predictions of the held-out plans")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--table", help="write the markdown table of predicted vs XLA:TPU memory to this path")
    args = parser.parse_args(argv)
    if args.one:
        entry = next(e for e in entries() + _heldout() if e["plan"]["name"] == args.one)
        print(json.dumps(compile_one(entry)))
        return 0
    if args.collect:
        print(json.dumps(collect(args.only, args.limit, args.wall_limit, args.again, args.heldout)))
        return 0
    if args.predict:
        HELDOUT.mkdir(parents=True, exist_ok=True)
        _write(HELDOUT / "predicted.json", predict_heldout())
        print(json.dumps({"predicted": len(_heldout()), "file": "benchmarks/xla_tpu_heldout/predicted.json"}))
        return 0
    from testbed.compiled.compare import compare_all, markdown_table
    from testbed.compiled.records import load_records

    result = compare_all(load_records(DATA))
    result["heldout"] = heldout_result()
    if args.table:
        _write_table(Path(args.table), markdown_table(result))
        held = result["heldout"]
        if held:
            _write_table(Path(args.table), markdown_table({"plans": held["plans"], "multi_chip": held["today"],
                                                           "not_compiled": held["not_compiled"]}),
                         HELDOUT_START, HELDOUT_END)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
