"""Diagnosis benchmark: XLA:CPU's physical transposes in the held-out steps and what a transposing pass costs on
this host. It changes no price.

The traced tier prices a transpose as free (docs/program.md, "How a program is read": XLA folds it into its
consumer). XLA:CPU's layout assignment instead writes some values with their minor dimension moved (a weight
gradient's operand, a token-mixing activation, a scan's gradient stored into its stacked buffer): a ``copy`` whose
layout differs from its operand's, alone or as the root of a loop fusion that recomputes the operand's elementwise
producers. Such a loop reads one operand with a stride of a whole row, and on this host it streams several times
slower than a plain pass. Two parts:

- ``grid``: on one device, a transposing pass ``(v * 1.5 + 1).T`` over an ``R x C`` f32 matrix against the plain
  pass ``v * 1.5 + 1``, for R, C in 64-2048 (4 Ki-1 Mi elements): each the 10th percentile of many calls (the
  least disturbed on a shared host), an empty program's time taken off. ``transposed_GBps`` is read plus written
  bytes over seconds;
- ``programs``: each held-out program (benchmarks/program_heldout.py) compiled on 8 emulated devices, and the
  data-parallel ones on one (``NAME@1``); its compiled HLO's physical transposes per device (while bodies times
  their trip count), each as the ``R x C`` pass that moves its source's minor dimension (``R``: the destination's
  minor dimension, ``C``: the source's, the rest a batch of such passes), priced at the grid's measured rate of the
  nearest shape (``seconds_per_device``).

The grid's rates are this host's now, under whatever load it carries; its small passes (tens of microseconds) carry
the noise of a shared host, so the seconds per program are a scale, not a price: benchmarks/host_thunks.py times the
programs' own transposing thunks.

Prints ONE JSON object; the load average before and after.

    python benchmarks/host_transposes.py [--calls N] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from program_kernels import _DTYPE_BYTES, _computations, _physical  # noqa: E402

#: Sides of the grid's matrices, and the bounds on their elements.
SIDES = (64, 128, 256, 512, 1024, 2048)
ELEMENTS = (2 ** 12, 2 ** 20)


def _least_disturbed(fn, x, calls: int) -> float:
    """The 10th percentile of ``calls`` timed calls (after one warm-up call)."""
    fn(x).block_until_ready()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 10]


def grid(calls: int) -> dict:
    """Transposing and plain passes over the grid's matrices on one device (module docstring)."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    plain, moved, empty = (jax.jit(lambda v: v * 1.5 + 1.0), jax.jit(lambda v: (v * 1.5 + 1.0).T),
                           jax.jit(lambda v: v))
    base = _least_disturbed(empty, jax.device_put(jnp.ones(4), device), calls)
    rows = []
    for r in SIDES:
        for c in SIDES:
            if not ELEMENTS[0] <= r * c <= ELEMENTS[1]:
                continue
            x = jax.device_put(jnp.ones((r, c), jnp.float32), device)
            n = max(20, calls * 2 ** 14 // (r * c))
            p = max(1e-7, _least_disturbed(plain, x, n) - base)
            t = max(1e-7, _least_disturbed(moved, x, n) - base)
            rows.append({"shape": [r, c], "bytes": 8.0 * r * c, "plain_s": p, "transposed_s": t,
                         "plain_GBps": 8.0 * r * c / p / 1e9, "transposed_GBps": 8.0 * r * c / t / 1e9})
    return {"empty_program_s": base, "rows": rows}


def _as_pass(dims: tuple, layout: tuple, source_layout: tuple) -> tuple[int, int, int]:
    """A physical copy as ``batch`` passes over an ``R x C`` matrix: ``C`` the source's minor dimension (read with a
    stride), ``R`` the destination's (written contiguously), ``batch`` the other elements."""
    c, r = dims[source_layout[0]], dims[layout[0]]
    return max(1, math.prod(dims) // max(1, r * c)), r, c


def transposes(text: str) -> list[dict]:
    """The compiled HLO's physical transposes per device (module docstring), each as its pass and count."""
    comps, entry = _computations(text)
    shapes = {i[0]: i for body in comps.values() for i in body}
    out: dict[tuple, dict] = {}

    def walk(name: str, times: int) -> None:
        for iname, dtype, dims, layout, opcode, rest in comps.get(name, ()):
            if opcode == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                walk(re.search(r"body=%([\w.\-]+)", rest).group(1), times * (int(trips.group(1)) if trips else 1))
                continue
            called = re.search(r"calls=%([\w.\-]+)", rest)
            if opcode == "copy":
                source = shapes.get(re.search(r"%([\w.\-]+)", rest).group(1))
                if source is not None and _physical(dims, layout, source[3]):
                    batch, r, c = _as_pass(dims, layout, source[3])
                    row = out.setdefault((batch, r, c, dtype), {"batch": batch, "R": r, "C": c, "dtype": dtype,
                                                                "count": 0})
                    row["count"] += times
            if called and opcode == "fusion" and "__ynn" not in rest:
                walk(called.group(1), times)

    walk(entry, 1)
    return sorted(out.values(), key=lambda row: -row["count"] * row["batch"] * row["R"] * row["C"])


def _nearest(rows: list[dict], r: int, c: int) -> dict:
    """The grid row whose sides are nearest ``r x c`` (log distance)."""
    def distance(row: dict) -> float:
        return abs(math.log(row["shape"][0] / r)) + abs(math.log(row["shape"][1] / c))
    return min(rows, key=distance)


def transposes_seconds(found: list[dict], rows: list[dict]) -> float:
    """Seconds of ``found`` transposes at the grid's measured rate of the nearest shapes (read and written bytes)."""
    total = 0.0
    for t in found:
        moved = 2.0 * _DTYPE_BYTES.get(t["dtype"], 4) * t["batch"] * t["R"] * t["C"] * t["count"]
        total += moved / (_nearest(rows, t["R"], t["C"])["transposed_GBps"] * 1e9)
    return total


def compiled(name: str, devices):
    """Program ``name`` (``NAME@1``: a data-parallel one on one device) compiled, as its trainer."""
    import program_heldout as ph

    from testbed.cli.program import local_mesh
    from testbed.runner.program.measure import ProgramTrainer

    program, one = name.removesuffix("@1"), name.endswith("@1")
    mesh = local_mesh({"data": 1} if one else ph.PROGRAMS[program], devices[:1] if one else devices)
    step, args = ph._module(program).predict(mesh)
    trainer = ProgramTrainer(step, args, mesh)
    trainer.step(trainer.init(), 0)
    return trainer


def program_row(name: str, devices, rows: list[dict]) -> dict:
    """One held-out program: its compiled transposes and their seconds per device at the grid's rates."""
    trainer = compiled(name, devices)
    found = transposes(trainer.hlo_text())
    return {"transposes": found, "count": sum(t["count"] for t in found),
            "bytes_written": sum(_DTYPE_BYTES.get(t["dtype"], 4) * t["batch"] * t["R"] * t["C"] * t["count"]
                                 for t in found),
            "seconds_per_device": transposes_seconds(found, rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="timed calls per grid pass (default 200)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="programs, NAME@1 for one on one device (default all eight and the three @1)")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    load_before = os.getloadavg()
    import jax

    import program_heldout as ph

    devices = jax.devices()[:8]
    measured_grid = grid(args.calls)
    names = args.only or [*ph.PROGRAMS, *(f"{n}@1" for n, mesh in ph.PROGRAMS.items() if mesh == {"data": 8})]
    rows = {name: program_row(name, devices, measured_grid["rows"]) for name in names}
    print(json.dumps({"benchmark": "host_transposes", "devices": "emulated:8", "grid": measured_grid,
                      "programs": rows,
                      "load_average": {"before": [round(x, 2) for x in load_before],
                                       "after": [round(x, 2) for x in os.getloadavg()]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
