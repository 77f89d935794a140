"""Flash attention's kernel choice: the Pallas splash kernels on one TPU device, the scan kernel elsewhere.

The choice is checked as a rule on CPU; the TPU path is checked to lower and compile for a TPU v5e chip by a
deviceless XLA:TPU compile in a fresh process, which needs libtpu: importable, or unpacked in the folder
``TESTBED_LIBTPU_PATH`` names (skipped without it, as on CI).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from testbed.model.flash_kernel import SPLASH_FUSED_BACKWARD, SplashBlocks
from testbed.runner.tpu_attention import AttentionKernel, attention_kernel, splash_block

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("platform, devices, seq, context, want", [
    ("tpu", 1, 2048, False, AttentionKernel.SPLASH),
    ("tpu", 1, 384, False, AttentionKernel.SPLASH),
    ("tpu", 4, 2048, False, AttentionKernel.SCAN),     # a sharded mesh: GSPMD cannot split a Pallas call
    ("tpu", 1, 200, False, AttentionKernel.SCAN),      # the kernel's 128 lanes do not tile 200 keys
    ("tpu", 1, 2048, True, AttentionKernel.SCAN),      # ring attention keeps its own blockwise kernel
    ("cpu", 1, 2048, False, AttentionKernel.SCAN),
    ("gpu", 1, 2048, False, AttentionKernel.SCAN),
])
def test_kernel_choice(platform: str, devices: int, seq: int, context: bool, want: AttentionKernel) -> None:
    assert attention_kernel(flash=True, platform=platform, devices=devices, seq=seq, context=context) is want
    assert attention_kernel(flash=False, platform=platform, devices=devices, seq=seq) is AttentionKernel.SCAN


def test_splash_block_is_the_largest_tile_dividing_seq() -> None:
    assert [splash_block(s) for s in (4096, 2048, 1536, 768, 384, 200)] == [1024, 1024, 512, 256, 128, None]


def test_splash_blocks_shrink_past_head_dim_128_as_the_chip_failed_to_compile_them() -> None:
    """1024-blocks at head dim 256 ran out of the fused dK/dV kernel's scoped VMEM on the chip (the proxies'
    record); the runner then takes 512-blocks, and keeps 1024 at head dims 64 and 128."""
    record = json.loads((ROOT / "benchmarks" / "tpu_chip" / "proxies" / "runs-1024blocks.json").read_text())
    failed = [r for r in record["plans"] if not r["ok"]]
    assert len(failed) == 5 and all("CompileTimeScopedVmemOom" in r["error"] and "splash_mha_dkv" in r["error"]
                                    and ",256]" in r["error"] for r in failed)
    assert [splash_block(4096, d) for d in (64, 128, 256, 512)] == [1024, 1024, 512, 256]
    assert SplashBlocks.for_seq(2048, 256).name == "q512-kv512-fused"
    assert splash_block(200, 256) is None


def test_splash_layouts_name_some_of_q_k_v_once() -> None:
    blocks = SplashBlocks(1024, 1024, 1024, True, seq_minor="kv")
    assert blocks.name == "q1024-kv1024-fused-kvseq"
    assert {k: v for k, v in blocks.block_sizes().items() if "layout" in k} == {"k_layout": "seq-minor",
                                                                             "v_layout": "seq-minor"}
    assert "layout" not in " ".join(SplashBlocks.for_seq(2048).block_sizes())
    for bad in ("kk", "x", "qkvq"):
        with pytest.raises(ValueError, match="seq_minor"):
            SplashBlocks(512, 512, 512, True, seq_minor=bad)


def test_no_splash_layout_beats_the_runners_by_more_than_the_chips_noise() -> None:
    """Timed on the chip (benchmarks/tpu_chip/splash_layouts.json): the runner's blocks with q, k or v read
    positions-minor run within 4% of its head-dim-minor layout at every suite shape, so the runner keeps that one."""
    record = json.loads((ROOT / "benchmarks" / "tpu_chip" / "splash_layouts.json").read_text())
    assert len(record["shapes"]) == 4 and record["versions"]["libtpu"]
    for name, row in record["shapes"].items():
        ours = replace(SplashBlocks.for_seq(row["shape"]["seq"], row["shape"]["head_dim"]), forward_q=0,
                       forward_compute=0).name  # the layouts were timed at the backward's blocks in both kernels
        timed = {c: r["forward_backward_s"] for c, r in row["configs"].items() if "error" not in r}
        assert len(timed) == 6 and ours in timed, name
        assert min(timed.values()) > 0.96 * timed[ours], (name, min(timed, key=timed.get))


def test_the_cached_splash_kernel_holds_no_tracer() -> None:
    """Asked for first inside a trace (as a checkpointed block does), the cached kernel's mask arrays are still
    concrete: a tracer kept there leaks into later traces, where JAX passes it as an extra step input that an
    ahead-of-time ``Compiled`` call does not (full-remat splash plans failed on the chip that way)."""
    import jax
    import jax.numpy as jnp

    from testbed.runner import tpu_attention

    tpu_attention._kernel.cache_clear()
    held = []
    jax.jit(lambda x: held.append(tpu_attention._kernel(2, 256, None, tpu_attention.SplashBlocks.for_seq(256))) or x)(jnp.zeros(()))
    leaves = jax.tree.leaves(held[0])
    tpu_attention._kernel.cache_clear()
    assert leaves and not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)


def test_cpu_trainer_keeps_the_scan_kernel() -> None:
    import jax

    from testbed.plan.io import plan_from_dict
    from testbed.runner.train import build_trainer

    plan = plan_from_dict({"model": {"layers": 1, "d_model": 128, "heads": 1, "d_ff": 256, "seq_len": 256,
                                     "vocab": 256, "attention": "flash"},
                           "batch": {"global_batch": 2}, "mesh": {"data": 1}})
    assert build_trainer(plan, jax.devices()[:1]).attention_kernel is AttentionKernel.SCAN


def _libtpu_path() -> str | None:
    """Where libtpu is importable from: ``TESTBED_LIBTPU_PATH``, or "" when installed; None when absent."""
    path = os.environ.get("TESTBED_LIBTPU_PATH")
    if path:
        return path if (Path(path) / "libtpu").is_dir() else None
    return "" if importlib.util.find_spec("libtpu") is not None else None


def test_splash_lowers_for_a_tpu_chip(tmp_path: Path) -> None:
    """A one-layer flash plan's train step compiles for a v5e chip with the splash kernels in it (forward,
    its recomputation under full remat, and the fused dQ/dK/dV backward: three Pallas calls) and no scan over K/V
    blocks."""
    path = _libtpu_path()
    if path is None:
        pytest.skip("libtpu is not importable (set TESTBED_LIBTPU_PATH to an unpacked libtpu wheel's folder)")
    plan = tmp_path / "flash.yaml"
    plan.write_text("model: {layers: 1, d_model: 128, heads: 1, d_ff: 256, seq_len: 256, vocab: 384, "
                    "mlp: swiglu, norm: rmsnorm, position: rope, bias: false, attention: flash}\n"
                    "batch: {global_batch: 2}\nmesh: {data: 1}\nprecision: bf16-mixed\nremat: full\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (path, str(ROOT)) if p), JAX_PLATFORMS="")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/tpu_compile_facts.py"), str(plan)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(done.stdout)["plans"][0]
    assert row["hlo"]["pallas_calls"] == (3 if SPLASH_FUSED_BACKWARD else 4)
    assert row["memory"]["total"] > 0


def test_the_runners_splash_blocks_are_the_fastest_measured_on_the_chip() -> None:
    """The blocks the runner uses (testbed.model.flash_kernel) are, at every attention shape of the chip's record
    (benchmarks/tpu_chip/splash_blocks.json), the fastest backward measured (forward + backward less the forward);
    its forward blocks, varied one knob at a time around the runner's at the head-dim-64 shapes
    (benchmarks/tpu_chip/splash_around.json), the fastest forward of the runner's layout, and with the backward
    the fastest pair under full remat (the forward run twice)."""
    record = json.loads((ROOT / "benchmarks" / "tpu_chip" / "splash_blocks.json").read_text())
    assert record["device_kind"].startswith("TPU")
    for name, row in record["shapes"].items():
        ours = SplashBlocks.for_seq(row["shape"]["seq"], row["shape"]["head_dim"])
        backward_blocks = replace(ours, forward_q=0, forward_compute=0).name
        ok = {c: r for c, r in row["configs"].items() if "error" not in r}
        backward = {c: r["forward_backward_s"] - r["forward_s"] for c, r in ok.items()}
        assert len(ok) >= 5 and backward_blocks in ok, name
        assert backward[backward_blocks] == min(backward.values()), (name, min(backward, key=backward.get))
    around = json.loads((ROOT / "benchmarks" / "tpu_chip" / "splash_around.json").read_text())
    assert around["device_kind"].startswith("TPU") and len(around["shapes"]) == 2
    for name, row in around["shapes"].items():
        ours = SplashBlocks.for_seq(row["shape"]["seq"], row["shape"]["head_dim"]).name
        plain = {c: r for c, r in row["configs"].items() if "error" not in r and "qkvseq" not in c}
        assert len(plain) >= 6 and ours in plain, name
        forward = {c: r["forward_s"] for c, r in plain.items()}
        remat = {c: r["forward_backward_s"] + r["forward_s"] for c, r in plain.items()}
        assert forward[ours] == min(forward.values()) and remat[ours] == min(remat.values()), name




@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rope_turned_is_rope_bit_for_bit(dtype: str) -> None:
    """The splash path's RoPE (the half swap as a signed-permutation dot) equals the half-split form exactly, and
    with a power-of-two scale on its tables equals the half-split form scaled; zigzag positions too."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from testbed.runner.rope import rope, rope_turned

    x = jax.random.normal(jax.random.key(0), (2, 32, 3, 16)).astype(dtype)
    order = np.arange(32)[::-1]
    assert bool((rope_turned(x, 1e4) == rope(x, 1e4)).all())
    assert bool((rope_turned(x, 1e4, order) == rope(x, 1e4, order)).all())
    assert bool((rope_turned(x, 500.0, scale=0.25) == rope(x, 500.0) * jnp.asarray(0.25, x.dtype)).all())


def test_the_splash_paths_rope_is_the_faster_form_on_the_chip() -> None:
    """Timed on the chip (benchmarks/tpu_chip/rope_forms.json): the 430M full-remat step with RoPE turned by a dot
    over the whole head dim runs at least 3% faster than with the half-split slices (whose half-width arrays XLA:TPU
    copies apart), and the runner as it is now (the scale on the tables, the forward's blocks) faster still."""
    record = json.loads((ROOT / "benchmarks" / "tpu_chip" / "rope_forms.json").read_text())
    full = record["steps"]["llama400m-bf16-full"]
    assert record["device_kind"].startswith("TPU") and record["versions"]["libtpu"]
    assert full["rope-matmul"]["median_s"] < 0.97 * full["runner"]["median_s"]
    assert record["runner_after"]["llama400m-bf16-full"]["median_s"] < full["rope-matmul"]["median_s"]
    turned, split = (record["profile_seconds_per_step"]["llama400m-bf16-full"][f] for f in ("turned", "half-split"))
    assert turned["elementwise"] < 0.2 * split["elementwise"]


def test_the_runner_keeps_head_dim_minor_operands_as_the_chip_timed_them() -> None:
    """The positions-minor splash operands at head dim 64 (rope_forms.json's ``positions_minor``: fewer relayout
    copies in XLA:TPU's compile) ran one recorded plan faster and the other slower than the runner as it is, so the
    runner keeps head-dim-minor operands (no ``seq_minor`` in its blocks)."""
    record = json.loads((ROOT / "benchmarks" / "tpu_chip" / "rope_forms.json").read_text())
    variant, runner = record["positions_minor"]["steps"], record["runner_after"]
    faster = [p for p in variant if variant[p]["median_s"] < runner[p]["median_s"]]
    assert len(variant) == 2 and 0 < len(faster) < len(variant)
    assert SplashBlocks.for_seq(2048, 64).seq_minor == ""
