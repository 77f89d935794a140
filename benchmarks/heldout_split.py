"""Diagnosis benchmark: how the held-out programs' misses split between their priced matmul tasks and the rest.

For each results FILE of benchmarks/program_heldout.py (its eight-device rows; measured, or priced again with
``--from-json``), every program is priced as ``program_heldout.py`` prices it (traced, compiled for its transposing
kernels, on ``host-cpu-8``) and its price split in two: its matmul tasks (their priced seconds on a device alone, the
matmuls and convolutions with their kernels' ``compute.kernel_s``, times the host's sharing ``n / host.throughput[n]``
as the step plays them: benchmarks/host_thunks.py's ``priced_on_the_step_s``) and the rest of its predicted step
(memory-bound and transposing passes, collectives, the controller, stragglers). Least squares over the eight programs
fits ``measured_at_calibrated_speed = a * matmul + b * rest`` per FILE: ``a`` and ``b`` say how far each part's price
is from the measured steps at the calibrated speed (1 and 1: both right). A diagnosis of where the misses are, not a
price: it reads the held-out measurements, which fit nothing.

    python benchmarks/heldout_split.py FILE [FILE ...] [--topology T]

Prints ONE JSON object: per FILE ``a``, ``b``, per program its two parts, the measured step and the split's fit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parts(names, topology) -> dict[str, dict]:
    """Each program's priced matmul tasks on the step and the rest of its predicted step (seconds)."""
    import jax

    import program_heldout as ph
    from program_kernels import priced

    share = 1 / topology.calibration.host_share(8)  # the host's sharing, as the step prices it
    out = {}
    for name in names:
        case = ph.prepared(name, jax.devices()[:8], topology)
        step = ph.predicted(case)
        matmul = share * priced(case["workload"], topology).get("matmul_tasks_s", 0.0)
        out[name] = {"predicted_s": step, "matmul_s": matmul, "rest_s": step - matmul}
    return out


def split(rows: dict, priced: dict) -> dict:
    """``a`` and ``b`` of the least squares ``measured = a * matmul + b * rest`` over the programs of ``rows``."""
    names = [n for n in rows if n in priced]
    x = np.array([[priced[n]["matmul_s"], priced[n]["rest_s"]] for n in names])
    y = np.array([rows[n]["measured_at_calibrated_speed_s"] for n in names])
    (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
    return {"a": float(a), "b": float(b), "programs": {
        n: {**priced[n], "measured_at_calibrated_speed_s": float(m), "split_s": float(xr @ (a, b))}
        for n, xr, m in zip(names, x, y)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="results of benchmarks/program_heldout.py")
    parser.add_argument("--topology", default="host-cpu-8", help="the topology they were priced on")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from testbed.topology.io import load_topology

    results = {f: json.loads(Path(f).read_text())["rows"] for f in args.files}
    names = list(dict.fromkeys(n for rows in results.values() for n in rows))
    priced = parts(names, load_topology(args.topology))
    print(json.dumps({"benchmark": "heldout_split", "topology": args.topology,
                      "files": {Path(f).name: split(rows, priced) for f, rows in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
