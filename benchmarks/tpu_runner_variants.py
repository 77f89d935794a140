"""Where the single-chip full-remat Llama step loses its time on a TPU: the splash kernels' operand layouts, and
the whole step with the splash kernels' residuals kept through a rematerialised block, recorded as data.

The 430M Llama-style plans with every block rematerialised (``benchmarks/tpu_chip/plans/llama400m-bf16-full``,
``llama400m-bf16-flash-seq4096``) spend 29% of their step in the splash kernels at head dim 64 (profiles.json);
under ``remat: full`` the kernels' forward runs twice. Two questions, each answered on the chip:

- ``layouts``: the kernels' forward and forward + backward at the runner's blocks with K (and V) laid out
  sequence-minor (``splash_attention_kernel.QKVLayout.SEQ_MINOR``: the kernel's Q K^T an NN product) against
  the default head-dim-minor layout, at the suite's two 430M attention shapes;
- ``steps``: the whole step of a plan (testbed.runner.train, as benchmarks/tpu_chip.py times it) as the runner
  builds it (``runner``), with each block's full-remat checkpoint keeping the splash kernels' output and
  log-sum-exp (``keep-residuals``: ``jax.checkpoint_policies.save_only_these_names`` of their checkpoint name), the
  forward kernel then not rerun in the backward, and with K sequence-minor (``k-seq-minor``); its seconds, MFU and
  ``memory_analysis()``.

Writes ``OUT/runner_variants.json`` atomically after every measurement and prints ONE JSON object.

    python benchmarks/tpu_runner_variants.py --out OUT [--budget-s 400] PLAN...
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tpu_chip import relative_command, time_plan, versions, write_atomic  # noqa: E402
from tpu_splash_blocks import _timed  # noqa: E402

SHAPES = {"llama400m-seq2048": (8, 16, 4, 2048, 64), "llama400m-seq4096": (2, 16, 4, 4096, 64)}
LAYOUTS = {"default": (), "k-seq-minor": ("k",), "kv-seq-minor": ("k", "v"), "qkv-seq-minor": ("q", "k", "v")}


@contextlib.contextmanager
def splash_options(layout: tuple = (), residuals: bool = False):
    """The runner's splash kernels built with ``layout``'s operands sequence-minor and, with ``residuals``, every
    ``jax.checkpoint`` traced inside keeping the kernels' output and log-sum-exp (named
    testbed.runner.attention.FLASH_RESIDUALS) where it was given no policy of its own."""
    import jax
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    from testbed.model.flash_kernel import SplashBlocks
    from testbed.runner import tpu_attention
    from testbed.runner.attention import FLASH_RESIDUALS

    def kernel(heads: int, seq: int, window, blocks: SplashBlocks, interpret: bool = False):
        mask = splash.MultiHeadMask([splash.CausalMask((seq, seq))] * heads)
        kinds = {f"{x}_layout": splash.QKVLayout.SEQ_MINOR for x in layout}
        sizes = splash.BlockSizes(**blocks.block_sizes(), **kinds)
        with jax.ensure_compile_time_eval():
            return splash.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret,
                                                        residual_checkpoint_name=FLASH_RESIDUALS)

    saved_kernel, saved_checkpoint = tpu_attention._kernel, jax.checkpoint
    policy = jax.checkpoint_policies.save_only_these_names(FLASH_RESIDUALS)

    def checkpoint(fun, *args, **kwargs):
        return saved_checkpoint(fun, *args, **({"policy": policy} | kwargs))

    if layout:
        tpu_attention._kernel = kernel
    if residuals:
        jax.checkpoint = checkpoint
    try:
        yield
    finally:
        tpu_attention._kernel, jax.checkpoint = saved_kernel, saved_checkpoint


def measure_layout(shape: tuple, layout: tuple) -> dict:
    """Forward and forward + backward seconds of the runner's splash call at its blocks, in ``layout``."""
    import jax
    import jax.numpy as jnp

    from testbed.runner.tpu_attention import splash_attention

    b, heads, kv_heads, seq, head_dim = shape
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, seq, heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (b, seq, kv_heads, head_dim), jnp.bfloat16) for key in keys[1:])
    try:
        with splash_options(layout):
            forward = jax.jit(splash_attention)
            both = jax.jit(jax.grad(lambda q, k, v: splash_attention(q, k, v).astype(jnp.float32).sum(),
                                    argnums=(0, 1, 2)))
            return {"forward_s": _timed(forward, (q, k, v)), "forward_backward_s": _timed(both, (q, k, v))}
    except Exception as exc:  # a layout the kernel refuses: recorded, not fatal
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}


def measure_step(path: Path, variant: str) -> dict:
    """One plan's step (benchmarks/tpu_chip.time_plan) as the runner builds it, or with ``variant``'s options."""
    import jax

    options = {"runner": {}, "keep-residuals": {"residuals": True},
               "k-seq-minor": {"layout": ("k",)}}[variant]
    try:
        with splash_options(**options):
            row = time_plan(path, jax.devices()[:1], steps=5, rounds=3)
        return {k: row[k] for k in ("compile_s", "median_s", "mfu", "memory", "loss", "attention_kernel")}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}


def _record(rows: dict, start: float) -> dict:
    import jax

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": versions(), "device_kind": jax.devices()[0].device_kind,
            "command": "python benchmarks/tpu_runner_variants.py " + relative_command(" ".join(sys.argv[1:])),
            "wall_s": round(time.perf_counter() - start, 1)} | rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=math.inf)
    parser.add_argument("--variants", nargs="+", default=["keep-residuals", "k-seq-minor"])
    parser.add_argument("plans", nargs="*")
    args = parser.parse_args(argv)
    start, rows = time.perf_counter(), {"layouts": {}, "steps": {}}
    out = Path(args.out) / "runner_variants.json"
    for name, shape in SHAPES.items():
        for layout, operands in LAYOUTS.items():
            rows["layouts"].setdefault(name, {})[layout] = measure_layout(shape, operands)
            print(name, layout, rows["layouts"][name][layout], file=sys.stderr, flush=True)
            write_atomic(out, json.dumps(_record(rows, start), indent=1) + "\n")
    for plan in args.plans:
        for variant in args.variants:
            if time.perf_counter() - start > args.budget_s:
                continue
            rows["steps"].setdefault(Path(plan).stem, {})[variant] = measure_step(Path(plan), variant)
            print(plan, variant, rows["steps"][Path(plan).stem][variant], file=sys.stderr, flush=True)
            write_atomic(out, json.dumps(_record(rows, start), indent=1) + "\n")
    print(json.dumps({"layouts": rows["layouts"], "steps": {p: {v: {k: r.get(k) for k in ("median_s", "mfu", "error")}
                                                                 for v, r in row.items()}
                                                             for p, row in rows["steps"].items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
