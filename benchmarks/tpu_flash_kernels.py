"""Two Pallas flash-attention kernels' speed on a TPU chip, by sequence length, recorded as data.

- ``tpu-flash``: JAX's first Pallas TPU kernel, ``jax.experimental.pallas.ops.tpu.flash_attention``, every block at
  512 (AXLearn's TPU attention until it took up splash in October 2024: apple/axlearn f2326c53
  ``axlearn/common/flash_attention/utils.py`` sets each of ``BlockSizes``' eleven blocks to ``block_size``, which
  ``layer.py``'s ``tpu_block_size`` gives as 512), queries scaled before the kernel (AXLearn's ``tpu_attention.py``);
- ``splash``: the splash kernels at the runner's blocks (testbed.runner.tpu_attention.splash_attention).

Each shape is FlashAttention-3's benchmark setting (16k tokens a batch, hidden 2048: batch ``16384 / seq``, heads
``2048 / head_dim``), causal and not; the forward and the forward + backward of each are compiled, run ``CALLS``
times back to back in ``ROUNDS`` rounds, the least round's mean one call's seconds. The FLOPs are the kernel
papers' count (testbed.sim.price.attention_kernels): forward ``4 b s^2 h d``, halved when causal; backward 2.5 times the
forward. A bf16 GEMM at a 7B layer's MLP shape (4096 x 4096 x 11008) is timed the same way beside them.

Writes ``OUT/flash_kernels.json`` atomically (date, versions, device kind, the command, per kernel, head dim,
mask and sequence the seconds and TFLOP/s) after every shape, and prints a summary as ONE JSON object. ``--quick``
on a CPU host checks the plumbing with the kernels in interpret mode on one small shape.

    python benchmarks/tpu_flash_kernels.py --out OUT [--quick] [--budget-s 420] [--runs splash/64 ...]
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
from tpu_splash_blocks import _timed as splash_timed  # noqa: E402

SEQS = (512, 1024, 2048, 4096, 8192, 16384)
TOKENS, HIDDEN = 16384, 2048
CALLS, ROUNDS = 4, 3
#: (kernel, head_dim) pairs measured, in order.
RUNS = (("tpu-flash", 128), ("splash", 128), ("splash", 256), ("splash", 64), ("tpu-flash", 64),
        ("tpu-flash", 256))
#: AXLearn's TPU block size at f2326c53 (FlashAttention.Config.tpu_block_size).
AXLEARN_BLOCK = 512


def _timed(fn, args) -> float:
    """One call's seconds, timed as the splash-block benchmark times its kernels (here CALLS x ROUNDS)."""
    return splash_timed(fn, args, ROUNDS, CALLS)


def _attend(kernel: str, causal: bool, seq: int, interpret: bool):
    """``f(q, k, v)`` over ``[batch, seq, heads, head_dim]`` by ``kernel``."""
    import jax.numpy as jnp

    if kernel == "splash":
        from testbed.runner.tpu_attention import splash_attention

        if not causal:
            return None
        return lambda q, k, v: splash_attention(q, k, v, interpret=interpret)
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    block = min(AXLEARN_BLOCK, seq)
    sizes = fa.BlockSizes(block_q=block, block_k_major=block, block_k=block, block_b=1, block_q_major_dkv=block,
                          block_k_major_dkv=block, block_k_dkv=block, block_q_dkv=block, block_k_major_dq=block,
                          block_k_dq=block, block_q_dq=block)

    def attend(q, k, v):
        q = q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), q.dtype)
        heads_first = (0, 2, 1, 3)
        out = fa.flash_attention(*(x.transpose(heads_first) for x in (q, k, v)), causal=causal, sm_scale=1.0,
                                 block_sizes=sizes, debug=False)
        return out.transpose(heads_first)
    return attend


def measure(kernel: str, head_dim: int, seq: int, causal: bool, interpret: bool, tokens: int) -> dict | None:
    """Seconds and TFLOP/s of the forward and the backward (forward + backward less forward), or the error."""
    import jax
    import jax.numpy as jnp

    attend = _attend(kernel, causal, seq, interpret)
    if attend is None:
        return None
    b, heads = max(1, tokens // seq), max(1, HIDDEN // head_dim)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (b, seq, heads, head_dim), jnp.bfloat16) for key in keys)
    forward = jax.jit(attend)
    both = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    flops = 4 * b * seq * seq * heads * head_dim // (2 if causal else 1)
    try:
        f, fb = _timed(forward, (q, k, v)), _timed(both, (q, k, v))
    except Exception as exc:  # a shape the kernel refuses: recorded, not fatal
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    backward = max(fb - f, 1e-12)
    return {"batch": b, "heads": heads, "forward_s": f, "forward_backward_s": fb,
            "forward_tflops": round(flops / f / 1e12, 2), "backward_tflops": round(2.5 * flops / backward / 1e12, 2)}


def gemm_tflops(quick: bool) -> dict:
    """A bf16 GEMM at a 7B layer's MLP shape, timed as the kernels."""
    import jax
    import jax.numpy as jnp

    m, k, n = (128, 128, 128) if quick else (4096, 4096, 11008)
    a = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (k, n), jnp.bfloat16)
    s = _timed(jax.jit(lambda a, w: a @ w), (a, w))
    return {"m": m, "k": k, "n": n, "seconds": s, "tflops": round(2 * m * k * n / s / 1e12, 2)}


def _record(rows: dict, gemm: dict, start: float) -> dict:
    import jax

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": versions(), "device_kind": jax.devices()[0].device_kind,
            "command": "python benchmarks/tpu_flash_kernels.py " + relative_command(" ".join(sys.argv[1:])),
            "calls": CALLS, "rounds": ROUNDS, "tokens": TOKENS, "hidden": HIDDEN, "axlearn_block": AXLEARN_BLOCK,
            "wall_s": round(time.perf_counter() - start, 1), "gemm": gemm, "kernels": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for flash_kernels.json")
    parser.add_argument("--quick", action="store_true", help="one small shape in interpret mode (a host check)")
    parser.add_argument("--budget-s", type=float, default=math.inf, help="stop starting shapes after this")
    parser.add_argument("--runs", nargs="+", metavar="KERNEL/HEAD_DIM", help="of RUNS, these only (e.g. splash/64)")
    args = parser.parse_args(argv)
    seqs, tokens = ((256,), 512) if args.quick else (SEQS, TOKENS)
    runs = RUNS[:2] if args.quick else RUNS
    if args.runs:
        runs = [run for run in runs if f"{run[0]}/{run[1]}" in args.runs]
    start, rows = time.perf_counter(), {}
    gemm = gemm_tflops(args.quick)
    for kernel, head_dim in runs:
        for causal in (True, False):
            for seq in seqs:
                if time.perf_counter() - start > args.budget_s:
                    break
                row = measure(kernel, head_dim, seq, causal, args.quick, tokens)
                if row is None:
                    continue
                key = f"{kernel}/d{head_dim}/{'causal' if causal else 'full'}"
                rows.setdefault(key, {})[str(seq)] = row
                print(key, seq, row, file=sys.stderr, flush=True)
                write_atomic(Path(args.out) / "flash_kernels.json",
                             json.dumps(_record(rows, gemm, start), indent=1) + "\n")
    summary = {key: {seq: (r.get("forward_tflops"), r.get("backward_tflops")) for seq, r in row.items()}
               for key, row in rows.items()}
    print(json.dumps({"gemm_tflops": gemm["tflops"], "kernels": summary,
                      "wall_s": round(time.perf_counter() - start, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
