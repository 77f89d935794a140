"""Users' programs on one TPU chip: the eight held-out programs of ``program_heldout.py`` at chip sizes, each on a
one-device mesh (its own axis names, every axis of size 1), predicted on ``tpu-v5e-1`` and measured on the chip.

The programs are ``benchmarks/heldout/`` as they are, their ``SIZES`` raised by :data:`CHIP_SIZES` (batch and widths:
at the host sizes a step is under a millisecond on a v5e, all dispatch; at these a step takes 4-60 ms). Each is
traced and priced as ``testbed run --program`` does, compiled and timed by the runner's
:class:`~testbed.runner.measure.StepTimer` (``--rounds`` rounds of ``--steps`` steps, the least disturbed median
kept: the chip is not shared, so no host-speed scaling), XLA:TPU's memory analysis read beside the live-range
estimate, and ``--profile`` more steps traced with ``jax.profiler`` (each op class's time per step and the longest
ops with their fused HLO, as ``tpu_profile.py`` records them for plans).

Record on a TPU host (one call, about 3 minutes): ``python benchmarks/program_chip.py --out OUT``, which writes
``OUT/programs.json`` (date, versions, device kind, the command). Without a TPU, ``--report FILE`` re-traces every
program at its recorded sizes on one CPU device, prices it on today's ``tpu-v5e-1`` and prints ONE JSON object:
per program the recorded measurement, today's prediction and its error; the medians and maxima. Goal (issue 56):
step time median <= 10%.

``--deviceless FILE`` (a host with libtpu, no chip) compiles each recorded program for one v5e chip with XLA:TPU
(testbed.runner.tpu_compile.compile_program, what ``testbed simulate --program --compile`` does) and prints its
memory analysis beside the chip's.

    python benchmarks/program_chip.py --out OUT [--only NAME ...] [--steps S] [--rounds R]
    python benchmarks/program_chip.py --report benchmarks/tpu_chip/programs.json [--only NAME ...]
    PYTHONPATH=LIBTPU python benchmarks/program_chip.py --deviceless benchmarks/tpu_chip/programs.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from program_heldout import PROGRAMS, _module  # noqa: E402
from tpu_chip import relative_command, versions, write_atomic  # noqa: E402
from tpu_profile import _CALLS, computations, read_trace  # noqa: E402

TOPOLOGY = "tpu-v5e-1"

#: program -> the ``SIZES`` entries raised for one v5e chip (the rest as in the module).
CHIP_SIZES = {
    "cnn": {"per_device": 256, "channels": [64, 128, 256]},
    "mixer": {"per_device": 256, "channels": 512, "tokens_hidden": 256, "channels_hidden": 2048},
    "vit": {"per_device": 128, "dim": 512, "heads": 8, "hidden": 2048},
    "tp_transformer": {"per_replica": 16, "seq": 512, "dim": 1024, "heads": 16, "hidden": 4096},
    "fsdp_adamw": {"per_device": 2048, "dim": 1024, "hidden": 4096},
    "scan_remat": {"per_replica": 1024, "dim": 1024, "hidden": 4096},
    "moe": {"tokens_per_device": 4096, "dim": 1024, "hidden": 4096, "capacity": 4096},
    "pipeline": {"microbatch_per_replica": 512, "dim": 2048, "layers_per_stage": 4},
}
GOAL = {"step_time": {"median_abs": 0.10}}


def one_device_mesh(name: str) -> dict[str, int]:
    """The program's own mesh axes, each of size 1."""
    return {axis: 1 for axis in PROGRAMS[name]}


def sized_module(name: str, sizes: dict):
    """The held-out program's module with ``sizes`` written over its ``SIZES`` (tuples where the module has them)."""
    module = _module(name)
    for key, value in sizes.items():
        module.SIZES[key] = tuple(value) if isinstance(module.SIZES.get(key), tuple) else value
    return module


def traced(name: str, device, sizes: dict):
    """``(workload, step, args, mesh)``: the program at ``sizes`` called once on a one-device mesh and traced."""
    from testbed.cli.program import local_mesh
    from testbed.runner.program import trace

    mesh = local_mesh(one_device_mesh(name), [device])
    step, args = sized_module(name, sizes).predict(mesh)
    return trace(step, *args, mesh=mesh, name=name), step, args, mesh


def priced(workload) -> dict:
    """Today's prediction of a traced program on one v5e chip."""
    from testbed.sim.graph.traced import simulate_workload
    from testbed.topology.io import load_topology

    report = simulate_workload(workload, load_topology(TOPOLOGY)).report
    return {"predicted_s": report.step_time_s, "memory_estimate": float(report.memory["total"]),
            "flops_per_device": workload.flops(), "dtype": workload.dtype}


def profiled(trainer, state, steps: int, top: int) -> dict:
    """``steps`` more steps under ``jax.profiler.trace``: each op class's time per step on the device plane and the
    ``top`` longest ops (tpu_profile.read_trace; classes by the compiled HLO's fusion bodies)."""
    import glob
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for i in range(steps):
                state, outputs = trainer.step(state, i)
                jax.block_until_ready((state, outputs))
        files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        text = trainer.compiled.as_text()
        bodies = computations(text)
        planes = read_trace(files[0], steps, bodies, top) if files else {}
    calls = {line.split(" = ", 1)[0].split()[-1]: match.group(1) for line in text.splitlines()
             if " = " in line and (match := _CALLS.search(line))}
    for plane in planes.values():  # each kept op with its fusion body's opcodes
        for row in plane["top_ops"]:
            row["body"] = sorted(bodies.get(calls.get(row["op"].split(" = ", 1)[0].strip(), ""), ()))
    return planes


def measure(name: str, device, steps: int, rounds: int, profile: int = 0) -> dict:
    """One program predicted and timed on ``device`` (and profiled for ``profile`` steps)."""
    from testbed.runner.measure import StepTimer
    from testbed.runner.program.measure import ProgramTrainer

    sizes = CHIP_SIZES[name]
    workload, step, args, mesh = traced(name, device, sizes)
    trainer = ProgramTrainer(step, args, mesh)
    timer = StepTimer(trainer)
    medians = [timer.round(steps)[0] for _ in range(rounds)]
    xla = trainer.memory()
    planes = profiled(trainer, timer.state, profile, 60) if profile else {}
    return {"mesh": one_device_mesh(name), "sizes": sizes, **priced(workload), "measured_s": min(medians),
            "round_medians_s": medians, "compile_s": timer.compile_s, "memory_xla": float(xla.total),
            "xla_memory": xla.to_dict(), "profile": planes}


def record(args: argparse.Namespace) -> int:
    import jax

    device = jax.devices()[0]
    rows, failed = {}, {}
    for name in args.only or list(PROGRAMS):
        start = time.perf_counter()
        try:
            rows[name] = measure(name, device, args.steps, args.rounds, args.profile)
        except Exception as error:  # a program that does not fit or compile is recorded, not fatal to the rest
            failed[name] = f"{type(error).__name__}: {str(error)[:300]}"
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    data = {"benchmark": "program_chip", "date": datetime.date.today().isoformat(), "versions": versions(),
            "device_kind": device.device_kind, "topology": TOPOLOGY, "steps": args.steps, "rounds": args.rounds,
            "command": relative_command("python benchmarks/program_chip.py " + " ".join(sys.argv[1:])),
            "rows": rows, "failed": failed}
    write_atomic(Path(args.out) / "programs.json", json.dumps(data, indent=1) + "\n")
    print(json.dumps({"programs": len(rows), "failed": failed}))
    return 0


def report(path: Path, only: list[str] | None) -> dict:
    """Today's predictions of the recorded programs against their measurements (no TPU needed)."""
    import jax

    from testbed.calibration.validation import relative_error

    recorded = json.loads(path.read_text())
    device, rows = jax.devices("cpu")[0], {}
    for name, row in recorded["rows"].items():
        if only and name not in only:
            continue
        today = priced(traced(name, device, row["sizes"])[0])
        rows[name] = {"measured_s": row["measured_s"], "predicted_s": today["predicted_s"],
                      "error": relative_error(today["predicted_s"], row["measured_s"]),
                      "memory_estimate": today["memory_estimate"], "memory_xla": row["memory_xla"],
                      "memory_error": relative_error(today["memory_estimate"], row["memory_xla"]),
                      "flops_per_device": today["flops_per_device"], "dtype": today["dtype"]}
    summary = {key: {"median_abs": statistics.median(abs(r[key]) for r in rows.values()),
                     "max_abs": max(abs(r[key]) for r in rows.values())} for key in ("error", "memory_error")}
    return {"benchmark": "program_chip", "topology": TOPOLOGY, "recorded": {k: recorded[k] for k in
            ("date", "versions", "device_kind", "command")}, "step_time": summary["error"],
            "memory_vs_xla": summary["memory_error"], "goal": GOAL, "rows": rows, "failed": recorded["failed"]}


def deviceless(path: Path, only: list[str] | None) -> dict:
    """Each recorded program compiled by XLA:TPU for one v5e chip without it, its memory beside the chip's."""
    from testbed.runner.tpu_compile import compile_program, target_mesh
    from testbed.topology.compile_target import parse_target

    recorded, rows = json.loads(path.read_text()), {}
    for name, row in recorded["rows"].items():
        if only and name not in only:
            continue
        mesh = target_mesh(parse_target("tpu:v5e:1x1"), row["mesh"])
        step, args = sized_module(name, row["sizes"]).predict(mesh)
        memory = compile_program(step, args, mesh, name).memory.to_dict()
        rows[name] = {"deviceless": memory, "chip": row["xla_memory"],
                      "equal": all(memory[k] == row["xla_memory"][k] for k in ("argument", "output", "temp", "alias"))}
    return {"benchmark": "program_chip --deviceless", "target": "tpu:v5e:1x1", "rows": rows,
            "all_equal": all(r["equal"] for r in rows.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder to write programs.json into (records on this host's first device)")
    parser.add_argument("--report", help="a recorded programs.json: print today's predictions against it")
    parser.add_argument("--deviceless", help="a recorded programs.json: compile them for one v5e chip with libtpu, "
                                             "no chip, and print XLA:TPU's memory beside the chip's")
    parser.add_argument("--only", nargs="*", default=None, help="programs (default all eight)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the least disturbed median kept (default 3)")
    parser.add_argument("--profile", type=int, default=3, help="steps profiled per program after the rounds "
                        "(per-op classes and the longest ops: tpu_profile.read_trace; 0: none; default 3)")
    args = parser.parse_args(argv)
    if sum(map(bool, (args.out, args.report, args.deviceless))) != 1:
        parser.error("give one of --out (record), --report (compare) or --deviceless (compile without a chip)")
    if args.deviceless:
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        print(json.dumps(deviceless(Path(args.deviceless), args.only)))
        return 0
    if args.report:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        print(json.dumps(report(Path(args.report), args.only)))
        return 0
    return record(args)


if __name__ == "__main__":
    sys.exit(main())
