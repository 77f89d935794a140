"""On a machine with one GPU: calibrate it and validate the single-device plans, in about 10 minutes.

The prepared device check of the fidelity work: it refuses to start (exit 2,
one line) unless JAX sees a GPU, then runs ``benchmarks/validate_host.py
--devices local`` (``testbed calibrate --devices local`` on the GPU, then
``testbed validate`` of ``plans/validation-1dev/``) with a budget of rounds
that fits 10 minutes, and prints ONE JSON object: validate_host's, plus the
GPU's name and the wall time. Install the GPU build first: ``pip install -e
'.[cuda]'``.

    python benchmarks/gpu_validate.py [--rounds R] [--steps S] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def gpu_name() -> str | None:
    """The first GPU's device kind as JAX sees it, or None without one (asked in a child process, so that
    this process never starts a backend the validation would then compete with)."""
    probe = ("import jax\n"
             "try:\n    devices = jax.devices('gpu')\nexcept RuntimeError:\n    devices = []\n"
             "print(devices[0].device_kind if devices else '')")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    name = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else ""
    return name or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="calibrate's and validate's rounds (default 3)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per plan (default 5)")
    parser.add_argument("--keep", default=None, help="folder to keep the calibrated topology and measurements in")
    args = parser.parse_args(argv)
    name = gpu_name()
    if name is None:
        sys.stderr.write("error: no GPU visible to JAX (jax.devices('gpu') is empty); run this on a GPU machine "
                         "after `pip install -e '.[cuda]'`\n")
        return 2
    started = time.perf_counter()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "validate_host.py"), "--devices", "local",
           "--rounds", str(args.rounds), "--steps", str(args.steps), *(["--keep", args.keep] if args.keep else [])]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        return done.returncode
    result = json.loads(done.stdout)
    print(json.dumps({"gpu": name, "seconds": round(time.perf_counter() - started, 1), **result}, allow_nan=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
