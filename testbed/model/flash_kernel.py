"""Which kernel computes ``attention: flash``: JAX's Pallas splash kernels on one TPU device, the runner's scan
kernel elsewhere. Both interpreters read this one rule: the runner to run the kernel
(testbed.runner.tpu_attention), the memory model for what XLA:TPU keeps around it (testbed.model.xla_tpu).

A Pallas call is opaque to GSPMD (which would run it replicated on a sharded mesh), so splash runs only where the
step is one device's program, and only for a sequence the kernel's 128-key lanes tile; context parallelism keeps
its ring's own blockwise kernel. (A stack's own kernel, ``runtime.attention_kernel``, is priced by
testbed.sim.price.attention_kernels and its workspace by testbed.model.splash.)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from testbed.plan.spec import Plan

__all__ = ["AttentionKernel", "attention_kernel", "tpu_kernel", "splash_block", "SplashBlocks", "LANES", "SPLASH_BLOCKS",
           "SPLASH_FUSED_BACKWARD", "SPLASH_BLOCK_AREA", "SPLASH_FORWARD_HALVED_AT", "turns_rope"]

#: The TPU vector unit's lane count: splash attention's K/V compute blocks are multiples of it
#: (``splash_attention_kernel.NUM_LANES``).
LANES = 128

#: Splash block sizes tried, largest first (every forward and backward block alike), and whether the backward is the
#: one fused dQ/dK/dV kernel (``BlockSizes.use_fused_bwd_kernel``). Measured on a v5e chip at the suite's attention
#: shapes (benchmarks/tpu_chip/splash_blocks.json, benchmarks/tpu_splash_blocks.py): 1024-blocks with the fused
#: backward were the fastest of ten configurations at all four (head dim 64 and 128, seq 2048 and 4096), forward +
#: backward 16-24% faster than MaxText's default 512-blocks and two backward kernels (configs/base.yml).
SPLASH_BLOCKS = (1024, 512, 256, 128)
SPLASH_FUSED_BACKWARD = True

#: The forward kernel's K/V compute block at a 1024-block: half of it, its query block whole. The same measurements
#: give the forward alone 2.3-5.8% faster computing 512 keys at a time (``q512-kv1024-c512``) than 1024-blocks at all
#: four shapes, while the fused backward is fastest at 1024-blocks; one knob at a time around those blocks at the
#: 430M plans' head-dim-64 shapes (benchmarks/tpu_chip/splash_around.json, tpu_splash_blocks.py --around), 1024-query
#: blocks computing 512 keys at a time (``fq1024-fc512``) run the forward a further 2.8-4.2% faster than 512-query
#: ones, and the whole full-remat steps 0.6-1.3% faster (runs.json). Smaller blocks keep one size.
SPLASH_FORWARD_HALVED_AT = 1024

#: The largest block side x head dim the splash kernels compile with: the fused dK/dV kernel's VMEM buffers grow
#: with both, and XLA:TPU caps a kernel's scoped VMEM at 16 MiB. 1024-blocks compile at head dim 64 and 128
#: (splash_blocks.json); at head dim 256 they need 17.4-18.4 MiB and fail to compile (E1001 CompileTimeScopedVmemOom,
#: benchmarks/tpu_chip/proxies/runs-1024blocks.json), so a head dim over 128 takes smaller blocks.
SPLASH_BLOCK_AREA = 1024 * 128


class AttentionKernel(StrEnum):
    """Which kernel computes ``attention: flash``."""

    SCAN = "scan"      # testbed.runner.attention.flash_attention: XLA, any backend
    SPLASH = "splash"  # jax.experimental.pallas.ops.tpu.splash_attention: Pallas, TPU only


@dataclass(frozen=True, slots=True)
class SplashBlocks:
    """The splash kernels' blocks: queries ``q``, keys and values ``kv`` (``compute`` of them at a time), the same in
    the backward, whether the backward is the one fused dQ/dK/dV kernel, and which of q, k, v the kernels read with
    positions minor (``seq_minor``, e.g. ``"k"``: ``QKVLayout.SEQ_MINOR``, transposed by XLA before the kernel;
    the others head-dim minor): ``BlockSizes`` of JAX's kernels."""

    q: int
    kv: int
    compute: int
    fused: bool
    seq_minor: str = ""
    forward_q: int = 0        # the forward kernel's query block; 0: ``q``
    forward_compute: int = 0  # the forward kernel's K/V compute block; 0: ``compute``

    def __post_init__(self) -> None:
        sides = (self.q, self.kv, self.compute, self.forward_q or self.q, self.forward_compute or self.compute)
        if min(sides) < LANES or self.kv % self.compute or self.kv % (self.forward_compute or self.compute):
            raise ValueError(f"splash blocks need sides of {LANES}+ and compute dividing kv, got {self}")
        if not set(self.seq_minor) <= set("qkv") or len(set(self.seq_minor)) != len(self.seq_minor):
            raise ValueError(f"splash seq_minor names some of q, k, v once each, got {self.seq_minor!r}")

    @classmethod
    def for_seq(cls, seq: int, head_dim: int = LANES) -> "SplashBlocks | None":
        """The runner's blocks for ``seq`` keys of ``head_dim`` (:func:`splash_block`,
        :data:`SPLASH_FUSED_BACKWARD`); None when the kernel's lanes do not tile it."""
        block = splash_block(seq, head_dim)
        if block is None:
            return None
        forward = block // 2 if block >= SPLASH_FORWARD_HALVED_AT else 0
        return cls(block, block, block, SPLASH_FUSED_BACKWARD, forward_compute=forward)

    @property
    def name(self) -> str:
        """``q1024-kv1024-fused``: how benchmarks/tpu_chip/splash_blocks.json names a configuration (``-fq512-fc512``
        after it: a forward kernel of its own blocks)."""
        compute = "" if self.compute == self.kv else f"-c{self.compute}"
        minor = f"-{self.seq_minor}seq" if self.seq_minor else ""
        forward = f"-fq{self.forward_q or self.q}-fc{self.forward_compute or self.compute}" if (
            self.forward_q or self.forward_compute) else ""
        return f"q{self.q}-kv{self.kv}{compute}" + ("-fused" if self.fused else "") + minor + forward

    def block_sizes(self) -> dict[str, int | bool | str]:
        """Keyword arguments of ``splash_attention_kernel.BlockSizes``: no dQ blocks under the fused backward; a
        layout named ``"seq-minor"`` for each of :attr:`seq_minor` (the runner maps it to ``QKVLayout``)."""
        out = {"block_q": self.forward_q or self.q, "block_kv": self.kv,
               "block_kv_compute": self.forward_compute or self.compute, "block_q_dkv": self.q,
               "block_kv_dkv": self.kv, "block_kv_dkv_compute": self.compute, "use_fused_bwd_kernel": self.fused}
        out |= {f"{x}_layout": "seq-minor" for x in self.seq_minor}
        return out if self.fused else out | {"block_q_dq": self.q, "block_kv_dq": self.kv}


def splash_block(seq: int, head_dim: int = LANES) -> int | None:
    """The splash kernel's query and K/V block for ``seq`` keys of ``head_dim``: the largest of
    :data:`SPLASH_BLOCKS` dividing it within :data:`SPLASH_BLOCK_AREA` (the smallest block at any head dim), or
    None when none divides it (a sequence the kernel's lanes do not tile)."""
    fitting = [b for b in SPLASH_BLOCKS if b * head_dim <= SPLASH_BLOCK_AREA] or [SPLASH_BLOCKS[-1]]
    return next((b for b in fitting if seq % b == 0), None)


def attention_kernel(*, flash: bool, platform: str, devices: int, seq: int, context: bool = False) -> AttentionKernel:
    """The kernel of flash attention for a step on ``devices`` devices of ``platform`` (``"tpu"``, ``"gpu"``,
    ``"cpu"``): splash on one TPU device for a sequence :func:`splash_block` tiles, without context
    parallelism (its ring attention has its own blockwise kernel); the scan kernel otherwise."""
    if flash and platform == "tpu" and devices == 1 and not context and splash_block(seq) is not None:
        return AttentionKernel.SPLASH
    return AttentionKernel.SCAN


def turns_rope(kernel: AttentionKernel) -> bool:
    """Whether RoPE takes its XLA:TPU form under ``kernel``: the half swap a signed-permutation dot over the whole head
    dim (testbed.runner.rope.rope_turned), on the splash path; the runner applies it and the memory model counts the
    dots a dots policy then saves (testbed.model.xla_tpu.turned_rope_bytes)."""
    return kernel is AttentionKernel.SPLASH


def tpu_kernel(plan: "Plan", seq: int | None = None) -> AttentionKernel:
    """:func:`attention_kernel` of the plan's step compiled for a TPU (its devices, its context parallelism) over
    ``seq`` keys, the model's sequence unless given: what the memory and pricing rules keyed by XLA:TPU read."""
    return attention_kernel(flash=True, platform="tpu", devices=plan.mesh.size,
                            seq=plan.model.seq_len if seq is None else seq, context=plan.mesh.context > 1)
