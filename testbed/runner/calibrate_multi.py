"""``testbed calibrate --processes K``: calibrate a K-host cluster emulated on this machine.

K local workers (:mod:`testbed.runner.launch`, gloo over loopback TCP) hold N/K
emulated devices each. Devices of different processes talk through gloo, a
slower "network" than the host memory devices of one process share. The base
topology therefore has two levels, innermost first: ``node`` (the N/K devices
of one process, kind ``host`` as in ``host-cpu-8``) and ``cluster`` (the K
processes on one Ethernet switch, one link per device), and the collective
fit (:func:`testbed.calibration.fit.fit_collectives`) fits both levels. Measured
on a 2-core host, collectives inside one process slow to gloo's pace too once
JAX runs multi-process (a 4 KiB psum of 2 devices: ~30 us in one process,
0.3-4 ms in two), so the levels differ less than real hosts' would and the
fit is noisy; the full (not ``--quick``) list measures more to average it.

Every worker plans the same benchmark list (:func:`plan_benchmarks`) and runs
it in the same order; in multi-process JAX each process must take part in
every program over devices it owns. Which devices a benchmark uses:

- programs that fit on one process's devices (matmuls, memory streams,
  dispatch on up to N/K devices, the MLP on one device) run on worker 0's
  devices only, while the other workers wait at a barrier: a busy peer would
  share the host's cores and skew the numbers that stand for one device
  alone, as in the single-process path;
- collectives run over all N devices, on groups of consecutive devices inside
  one process (``node``) and spanning processes (``cluster``); ring shifts
  (``ppermute``) only inside a process, because the simulator prices a ring
  shift as one send between neighbouring devices 0 and 1;
- training steps run on worker 0's first device alone (``step_plan(shape,
  1)``). They fit compute efficiency on the model's own kernels, a property
  of the device; the step fit predicts a step on ``d > 1`` devices by
  simulating the plan on the whole topology, so ``d`` could only be all N
  devices, across the processes, and gloo's per-tensor gradient all-reduces
  would then be folded into compute efficiency (measured on a 2-core host:
  0.02 instead of about 0.4). The network is fitted by the collectives.

Worker 0's samples are fitted by :func:`testbed.calibration.calibrated.fit_all` and
written like the single-process path (topology YAML plus
``FILE.measurements.json``, which records ``processes``). A refit from such a
file (``--from-measurements``) rebuilds the same two-level base.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from testbed.calibration import fit

__all__ = ["plan_benchmarks", "runs_on_all", "worker_body"]


# -- the benchmarks ------------------------------------------------------------------------

def plan_benchmarks(platform: str, num_devices: int, processes: int, *, quick: bool = False) -> list[Any]:
    """The benchmarks of a K-process calibration, in the order every worker runs them.

    The single-process list (:func:`testbed.runner.measure.plan_benchmarks`) with
    dispatch on 1, N/K and N devices, collectives on groups inside one
    process and spanning processes, and training steps of one device
    (none with ``quick``: compute efficiency then comes from the matmuls).
    """
    from testbed.runner.measure import COLLECTIVE_OPS, Benchmark
    from testbed.runner.measure import plan_benchmarks as single

    local = num_devices // processes
    base = single(platform, num_devices, quick=quick)
    messages = sorted({b.size for b in base if b.kind == "collective"}) or [1 << 12, 1 << 18, 1 << 21]
    inner = sorted({g for g in (2, 8, 64) if g < local and local % g == 0} | ({local} if local > 1 else set()))
    outer = sorted({local * m for m in (2, 8) if local * m < num_devices and num_devices % (local * m) == 0}
                   | {num_devices})
    if quick:
        inner, outer = inner[:1], outer[-1:]
    ops = ("psum", "all_gather", "ppermute") if quick else COLLECTIVE_OPS
    out = [Benchmark(kind="dispatch", size=k) for k in sorted({1, local, num_devices})]
    out += [b for b in base if b.kind in ("matmul", "concurrent", "memory")]
    out += [Benchmark(kind="collective", op=op, ranks=g, size=b) for op in ops for g in inner + outer
            if g > 1 and (op != "ppermute" or g <= local) for b in messages]
    if not quick:
        # Every shape: a step of one device lasts ~20 ms on a CPU, and --quick's two fp32 shapes fitted
        # compute efficiency anywhere from 0.28 to 1.49 over four runs on a busy 2-core host.
        out += [b for b in single(platform, 1) if b.kind == "step"]
    return out


def runs_on_all(bench: Any, local: int) -> bool:
    """Whether every process takes part (over all devices), or worker 0 runs it alone on its own devices."""
    if bench.kind == "collective":
        return True
    # Steps too run on one device (see the module doc); the rest use `size` or `ranks` devices.
    needs = bench.size if bench.kind == "dispatch" else bench.ranks if bench.kind == "concurrent" else 1
    return needs > local


def _collective(bench: Any, devices: list[Any]) -> fit.Sample:
    """A collective timed over loops of 1 and 9 rounds (not 1 and 5): a gloo round takes milliseconds of
    scheduling noise on a busy host, and the longer loop averages more of it out of the per-round time."""
    from testbed.runner import measure

    return measure.collective_sample(bench, devices, repeats=(1, 9))


def _barrier(name: str) -> None:
    """Wait until every process got here (a tiny all-gather over every device)."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def worker_body(payload: dict[str, Any]) -> dict[str, Any]:
    """What one launched worker runs (after JAX joined the job): every benchmark, in the shared order.

    Returns the device description; worker 0's result also holds the samples.
    """
    import jax

    from testbed.runner import devices as dev
    from testbed.runner import measure

    everyone = dev.select_devices()
    me = jax.process_index()
    mine = [d for d in everyone if d.process_index == me]
    info = dev.describe(everyone)
    benches = plan_benchmarks(info["platform"], len(everyone), jax.process_count(), quick=bool(payload.get("quick")))
    order = measure.measurement_order(benches, int(payload.get("rounds", 1)))
    runs: dict[int, list[Any]] = {}
    timers: dict[Any, Any] = {}  # training steps' compiled trainers, reused by their later rounds
    started = time.perf_counter()
    for position, i in enumerate(order):
        bench = benches[i]
        if bench.kind == "collective":
            sample = _collective(bench, everyone)
        elif runs_on_all(bench, len(mine)):
            sample = measure.run_benchmark(bench, everyone, timers)
        else:
            mine_run = mine[:1] if bench.kind == "step" else mine
            sample = measure.run_benchmark(bench, mine_run, timers) if me == 0 else None
            _barrier(f"testbed-calibrate-{position}")
        if me == 0:
            runs.setdefault(i, []).append(sample)
            sys.stderr.write(f"measured {position + 1}/{len(order)}: {bench.label}\n")
            sys.stderr.flush()
    samples = [measure.least_disturbed(runs[i]) for i in range(len(benches))] if me == 0 else []
    return {**info, "process_id": me, "seconds": time.perf_counter() - started,
            "samples": fit.samples_to_rows(samples)}


