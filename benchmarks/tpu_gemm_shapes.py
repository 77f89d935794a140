"""One matmul's speed by its shape on a TPU chip: a grid of fp32 GEMMs at JAX's default precision, each timed inside
one program, recorded as data for the traced tier's GEMM shape model (``compute.matmul_*`` of ``tpu-v5e-1``).

On a chip one program costs about 0.6 ms to dispatch and wait for (benchmarks/tpu_chip/calibration.json), more than
most single products take, so each shape runs ``r`` and ``2 r`` times in a ``lax.fori_loop`` (the left operand
offset by the loop index, so XLA cannot hoist the product; the offset fuses into the matmul's kernel on XLA:TPU) and
one product's time is the difference over ``r``: the dispatch and the loop's entry cancel. ``r`` puts about 2e11
FLOPs in the shorter loop. The grid: every ``m, n, k`` of :data:`SIDES` whose product is within :data:`FLOPS` (narrow
and flat products, as users' programs have them: an MLP-Mixer's token mixing, per-head attention).

Writes ``OUT/gemm_shapes.json`` atomically (date, versions, device kind, the command; per shape the two loop times
and one product's seconds) and prints a summary as ONE JSON object. ``--quick`` (a CPU host, three shapes) checks
the script end to end.

    python benchmarks/tpu_gemm_shapes.py --out OUT [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tpu_chip import relative_command, versions, write_atomic  # noqa: E402

SIDES = (64, 256, 1024, 4096, 16384)
FLOPS = (2 ** 30, 2 ** 38)
LOOP_FLOPS = 2e11


def grid(quick: bool) -> list[tuple[int, int, int]]:
    """The (m, n, k) shapes timed (three small ones with ``quick``)."""
    if quick:
        return [(256, 256, 256), (1024, 64, 256), (64, 1024, 1024)]
    return [(m, n, k) for m in SIDES for n in SIDES for k in SIDES if FLOPS[0] <= 2 * m * n * k <= FLOPS[1]]


def loop_seconds(m: int, n: int, k: int, repeats: int, device) -> float:
    """The least of five timed calls of a program running ``repeats`` fp32 ``m x k`` by ``k x n`` products."""
    import jax
    import jax.numpy as jnp

    def run(a, b):
        def body(i, c):
            return (a + i.astype(a.dtype)) @ b

        return jax.lax.fori_loop(0, repeats, body, jnp.zeros((m, n), a.dtype))

    a = jax.device_put(jnp.full((m, k), 0.001, jnp.float32), device)
    b = jax.device_put(jnp.full((k, n), 0.001, jnp.float32), device)
    fn = jax.jit(run).lower(a, b).compile()
    jax.block_until_ready(fn(a, b))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(fn(a, b))
        times.append(time.perf_counter() - start)
    return min(times)


def measure(shape: tuple[int, int, int], device, quick: bool) -> dict:
    m, n, k = shape
    flops = 2.0 * m * n * k
    repeats = 2 if quick else max(1, math.ceil(LOOP_FLOPS / flops))
    once, twice = loop_seconds(m, n, k, repeats, device), loop_seconds(m, n, k, 2 * repeats, device)
    seconds = (twice - once) / repeats
    return {"m": m, "n": n, "k": k, "repeats": repeats, "loop_s": [once, twice], "seconds": seconds,
            "flops_per_s": flops / seconds if seconds > 0 else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gemm_shapes.json")
    parser.add_argument("--quick", action="store_true", help="three small shapes (a check of the script on a host)")
    args = parser.parse_args(argv)
    import jax

    device, began = jax.devices()[0], time.perf_counter()
    rows = [measure(shape, device, args.quick) for shape in grid(args.quick)]
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "versions": versions(), "platform": device.platform, "device_kind": device.device_kind,
           "dtype": "fp32", "precision": "default",
           "command": "python benchmarks/tpu_gemm_shapes.py " + relative_command(" ".join(sys.argv[1:] if argv is None
                                                                                             else argv)),
           "rows": rows, "wall_s": round(time.perf_counter() - began, 1)}
    write_atomic(Path(args.out) / "gemm_shapes.json", json.dumps(out, indent=1) + "\n")
    rates = [r["flops_per_s"] for r in rows if r["flops_per_s"]]
    print(json.dumps({"shapes": len(rows), "tflops_min": min(rates) / 1e12, "tflops_max": max(rates) / 1e12,
                      "wall_s": out["wall_s"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
