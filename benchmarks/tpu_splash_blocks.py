"""The splash attention kernels' speed by their block sizes on a TPU chip, for the attention shapes of the single-chip
suite's flash plans: forward and forward + backward of each configuration, recorded as data.

JAX's Pallas splash kernels (``jax.experimental.pallas.ops.tpu.splash_attention``) take block sizes for the forward
(``block_q``, ``block_kv``, ``block_kv_compute``), for the K/V gradient kernel and for the Q gradient kernel, or one
fused backward kernel (``use_fused_bwd_kernel``); their docstring: "those parameters have negligible effect on
numerics, but affect performance greatly". Each configuration of :data:`CONFIGS` is compiled for each shape (the
runner's own call, testbed.runner.tpu_attention.splash_attention, at those blocks), run ``CALLS`` times back to back
(dispatch overlaps the kernels) in five rounds; the least round's mean is one call's seconds.

``--layouts`` times instead the runner's own blocks for each shape (``SplashBlocks.for_seq``) with each of
:data:`SEQ_MINOR` read with positions minor (``QKVLayout.SEQ_MINOR``: the forward's ``q k^T`` then contracts k's
leading dimension, with no transpose in the kernel), into ``OUT/splash_layouts.json``.

Writes ``OUT/splash_blocks.json`` atomically (date, versions, device kind, the command; per shape and configuration
the forward and forward + backward seconds and the attention FLOPs the kernels compute) and prints a summary as ONE
JSON object (the fastest configuration per shape). ``--quick`` on a CPU host checks the script's plumbing with the
kernels in interpret mode on one small shape.

    python benchmarks/tpu_splash_blocks.py --out OUT [--quick] [--layouts]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tpu_chip import relative_command, versions, write_atomic  # noqa: E402

from testbed.model.flash_kernel import SplashBlocks  # noqa: E402

# (batch, heads, kv_heads, seq, head_dim) of the suite's single-chip flash plans (benchmarks/tpu_chip/plans).
SHAPES = {
    "llama400m-seq2048": (8, 16, 4, 2048, 64),
    "llama400m-seq4096": (2, 16, 4, 4096, 64),
    "llama1b-seq2048": (4, 16, 4, 2048, 128),
    "gpt125m-seq4096": (2, 12, 12, 4096, 64),
}
CALLS, ROUNDS = 8, 5
#: Which of q, k, v ``--layouts`` reads with positions minor, beside none.
SEQ_MINOR = ("", "k", "v", "kv", "q", "qkv")


def around(base: SplashBlocks) -> dict[str, SplashBlocks]:
    """``--around``: the runner's blocks for a shape and each variant of one knob of them (the forward's query and
    compute blocks, the backward's compute block, a longer K/V block, the backward's query block), with the
    positions-minor q, k, v layout of each. The knobs are those BlockSizes takes (splash_attention_kernel)."""
    q, kv, fq = base.q, base.kv, base.forward_q or base.q
    knobs = [{}, {"forward_q": fq // 2}, {"forward_q": q, "forward_compute": q // 2}, {"compute": kv // 2},
             {"q": q // 2}, {"forward_compute": fq * 2}, {"kv": kv * 2, "compute": kv, "forward_compute": fq}]
    out = {}
    for knob in knobs:
        for minor in ("", "qkv"):
            try:
                one = replace(base, **knob, seq_minor=minor)
            except ValueError:  # a side under the lanes, or a compute block not dividing its K/V block
                continue
            out[one.name] = one
    return out


CONFIGS = {blocks.name: blocks for blocks in (
    SplashBlocks(512, 512, 512, False), SplashBlocks(512, 512, 512, True), SplashBlocks(512, 1024, 512, False),
    SplashBlocks(512, 1024, 512, True), SplashBlocks(1024, 1024, 1024, False), SplashBlocks(1024, 1024, 1024, True),
    SplashBlocks(1024, 512, 512, True), SplashBlocks(256, 256, 256, False), SplashBlocks(256, 512, 512, True),
    SplashBlocks(2048, 512, 512, True))}


def _timed(fn, args, rounds: int = ROUNDS, calls: int = CALLS) -> float:
    """One call's seconds: the least over ``rounds`` of ``calls`` back-to-back calls' mean (after one warm call)."""
    import jax

    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def measure(shape: tuple, blocks: SplashBlocks, interpret: bool) -> dict:
    """Forward and forward + backward seconds of one configuration on one shape, or the error it raised."""
    import jax
    import jax.numpy as jnp

    b, heads, kv_heads, seq, head_dim = shape
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, seq, heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (b, seq, kv_heads, head_dim), jnp.bfloat16) for key in keys[1:])
    from testbed.runner.tpu_attention import splash_attention

    def attend(q, k, v):  # the runner's call (testbed.runner.tpu_attention) at these blocks
        return splash_attention(q, k, v, blocks=blocks, interpret=interpret)

    forward = jax.jit(attend)
    both = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    try:
        return {"forward_s": _timed(forward, (q, k, v)), "forward_backward_s": _timed(both, (q, k, v))}
    except Exception as exc:  # a block size the kernel refuses for this shape: recorded, not fatal
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}


def causal_flops(shape: tuple) -> dict:
    """The attention matmul FLOPs of the causal half: forward (QK^T, PV) and its backward (dQ, dK, dV, dP)."""
    b, heads, _, seq, head_dim = shape
    one = 2 * b * heads * seq * seq * head_dim // 2
    return {"forward": 2 * one, "backward": 4 * one}


def _record(rows: dict, start: float) -> dict:
    """The data file's content so far (written after every configuration: a cut call keeps what it measured)."""
    import jax

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": versions(), "device_kind": jax.devices()[0].device_kind,
            "command": "python benchmarks/tpu_splash_blocks.py " + relative_command(" ".join(sys.argv[1:])),
            "calls": CALLS, "rounds": ROUNDS,
            "wall_s": round(time.perf_counter() - start, 1), "shapes": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for splash_blocks.json")
    parser.add_argument("--quick", action="store_true", help="one small shape in interpret mode (a host check)")
    parser.add_argument("--budget-s", type=float, default=math.inf, help="stop starting configurations after this")
    parser.add_argument("--layouts", action="store_true", help="the runner's blocks with q/k/v layouts varied")
    parser.add_argument("--around", action="store_true",
                        help="the runner's blocks at head dim 64, one knob varied at a time (splash_around.json)")
    args = parser.parse_args(argv)
    shapes = {"quick": (1, 2, 1, 256, 128)} if args.quick else SHAPES
    if args.around and not args.quick:
        shapes = {name: shape for name, shape in SHAPES.items() if name.startswith("llama400m")}
    configs = {b.name: b for b in (SplashBlocks(128, 128, 128, False), SplashBlocks(128, 128, 128, True))} \
        if args.quick else CONFIGS
    start, rows = time.perf_counter(), {}
    for name, shape in shapes.items():
        seq = shape[3]
        if args.layouts:
            base = SplashBlocks(128, 128, 128, True) if args.quick else SplashBlocks.for_seq(seq, shape[4])
            configs = {b.name: b for b in (replace(base, seq_minor=m) for m in SEQ_MINOR)}
        elif args.around:
            configs = around(SplashBlocks(256, 256, 256, True, forward_q=128, forward_compute=128) if args.quick
                             else SplashBlocks.for_seq(seq, shape[4]))
        rows[name] = {"shape": dict(zip(("batch", "heads", "kv_heads", "seq", "head_dim"), shape)),
                      "flops": causal_flops(shape), "configs": {}}
        for config, blocks in configs.items():
            if seq % blocks.q or seq % blocks.kv or time.perf_counter() - start > args.budget_s:
                continue
            rows[name]["configs"][config] = measure(shape, blocks, args.quick)
            print(name, config, rows[name]["configs"][config], file=sys.stderr, flush=True)
            record = _record(rows, start)
            file = ("splash_layouts.json" if args.layouts else "splash_around.json" if args.around
                    else "splash_blocks.json")
            write_atomic(Path(args.out) / file, json.dumps(record, indent=1) + "\n")
    best = {name: min((c for c in row["configs"].items() if "error" not in c[1]),
                      key=lambda c: c[1]["forward_backward_s"], default=(None, None))[0]
            for name, row in rows.items()}
    print(json.dumps({"shapes": len(rows), "fastest": best, "wall_s": _record(rows, start)["wall_s"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
