"""Calibration benchmark: the transposing pass rate of this host, as ``testbed calibrate --devices emulated:8`` measures
and fits it (``memory.transpose_efficiency``), alone.

Runs calibrate's own ``transpose`` benchmarks (testbed.runner.measure: ``(v * 1.5 + 1).T`` over the f32 matrices of
``transpose_grid``, one device) in calibrate's rounds (the fastest round of each kept,
testbed.runner.measure.least_disturbed) and fits them as calibrate does (testbed.calibration.fit.fit_transpose:
``t = c + bytes / rate``), then the fraction of ``--topology``'s peak memory bandwidth that rate is: the value a
full calibration of this host would write, without re-fitting its other groups. ``--repeats N`` runs that
calibration N times back to back: one calibration's rate moves from run to run on a shared host (its smallest
passes take tens of microseconds), and ``transpose_efficiency`` is then the median of the N. The bundled
``host-cpu-8`` carries it from ``benchmarks/results/host_transposing_pass.json`` (date, versions, command and load
average recorded there).

Prints ONE JSON object: per repeat every sample (each round's seconds) and the fit; the median fraction, the
versions, the load average before and after.

    python benchmarks/host_transposing_pass.py [--rounds R] [--repeats N] [--topology T]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys


def calibration(benches: list, devices: list, rounds: int) -> dict:
    """One calibration of the transposing passes: calibrate's rounds, the fastest round of each, its fit."""
    from testbed.calibration.fit import fit_transpose
    from testbed.runner.measure import least_disturbed, measurement_order, run_benchmark

    runs: dict[int, list] = {}
    for i in measurement_order(benches, rounds):
        runs.setdefault(i, []).append(run_benchmark(benches[i], devices))
    samples = [least_disturbed(runs[i]) for i in range(len(benches))]
    rate, fit = fit_transpose(samples)
    return {"samples": [{"rows": s.m, "columns": s.n, "bytes": s.bytes, "seconds": s.seconds,
                         "rounds_s": [r.seconds for r in runs[i]]} for i, s in enumerate(samples)],
            "fit": {"bytes_per_s": rate, "intercept_s": fit.values["half"] / rate, "r2": fit.r2,
                    "rel_residuals": list(fit.rel_residuals)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds, as calibrate's (default 5)")
    parser.add_argument("--repeats", type=int, default=1, help="calibrations, the median kept (default 1)")
    parser.add_argument("--topology", default="host-cpu-8", help="whose peak memory bandwidth the rate divides")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    load_before = os.getloadavg()
    import jax
    import jaxlib

    from testbed.runner.measure import plan_benchmarks
    from testbed.topology.io import load_topology

    benches = [b for b in plan_benchmarks("cpu", 8) if b.kind == "transpose"]
    repeats = [calibration(benches, jax.devices(), args.rounds) for _ in range(args.repeats)]
    rate = statistics.median(r["fit"]["bytes_per_s"] for r in repeats)
    peak = load_topology(args.topology).device.memory_bandwidth
    print(json.dumps({
        "benchmark": "host_transposing_pass", "command": "python benchmarks/host_transposing_pass.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": platform.python_version(),
                     "machine": platform.machine(), "cpus": os.cpu_count()},
        "rounds": args.rounds, "repeats": repeats, "bytes_per_s": rate,
        "bytes_per_s_range": [min(r["fit"]["bytes_per_s"] for r in repeats),
                              max(r["fit"]["bytes_per_s"] for r in repeats)],
        "topology": args.topology, "peak_memory_bandwidth": peak, "transpose_efficiency": min(1.0, rate / peak),
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in os.getloadavg()]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
