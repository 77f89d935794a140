"""What a compiled step's optimized HLO holds that decides how well an accelerator runs it.

Pure text processing of ``compiled.as_text()`` (no JAX). Top-level instructions are those outside fused
computations (the entry, loop bodies, conditionals): each one is a kernel launch or a buffer in HBM.

- ``pallas_calls``: Pallas TPU kernels (``custom_call_target="tpu_custom_call"``, what
  ``jax.experimental.pallas`` lowers to on a TPU), e.g. the splash attention kernels;
- ``fusions``: top-level fusion instructions (each one kernel);
- ``transposes``: ``transpose`` instructions anywhere (inside fusions too: a transposing fusion reads across
  tiles); ``copies``: ``copy`` instructions anywhere (on XLA:TPU a layout change, a physical transpose);
- ``f32_activations``: top-level instructions with an f32 result of an activation's shape (a dim of the
  microbatch's rows and the plan's ``seq_len``, or of their product; a parameter's fp32 master has neither): fp32
  activations written to HBM, and ``f32_activation_bytes`` their bytes;
- ``dots``: ``dot`` and ``convolution`` instructions anywhere, and ``bf16_dots_f32_out`` those of bf16
  operands with an f32 result (fp32 accumulation kept as the result).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["HloFacts", "hlo_facts", "activation_shaped"]

#: ``%name = TYPE[dims]{layout} op(`` of one instruction (a tuple-typed result is skipped by the shape group).
_INSTR = re.compile(r"=\s*(\w+)\[([\d,]*)\][^ ]*\s+([\w-]+)\(")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"\bfusion\(.*?calls=%?([\w.\-]+)")
_PALLAS = re.compile(r'custom_call_target="tpu_custom_call"')
_BF16_OPERAND = re.compile(r"\(bf16\[")
#: Top-level ops that name a buffer without writing one.
_VIEWS = frozenset({"parameter", "get-tuple-element", "bitcast", "tuple", "constant"})


@dataclass(frozen=True, slots=True, kw_only=True)
class HloFacts:
    """Counts of one optimized HLO module (see the module doc)."""

    pallas_calls: int
    fusions: int
    transposes: int
    copies: int
    f32_activations: int
    f32_activation_bytes: int
    dots: int
    bf16_dots_f32_out: int

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


def activation_shaped(shape: list[int], *, batch: int, seq_len: int) -> bool:
    """Whether a result of ``shape`` is an activation: dims of the ``batch`` rows and ``seq_len`` positions, or one
    dim of ``batch x seq_len`` tokens."""
    return (batch in shape and seq_len in shape) or batch * seq_len in shape


def hlo_facts(text: str, *, batch: int, seq_len: int) -> HloFacts:
    """The counts of the module ``text`` for a step of ``batch`` rows (one microbatch's) of ``seq_len``."""
    lines = text.splitlines()
    fused = {m.group(1) for line in lines for m in [_CALLS.search(line)] if m}
    counts = dict.fromkeys(HloFacts.__slots__, 0)
    computation = ""
    for line in lines:
        header = _HEADER.match(line)
        if header:
            computation = header.group(1)
            continue
        if _PALLAS.search(line):
            counts["pallas_calls"] += 1
        match = _INSTR.search(line)
        if match is None:
            continue
        dtype, op = match.group(1), match.group(3)
        shape = [int(d) for d in match.group(2).split(",") if d]
        top = computation not in fused
        counts["fusions"] += top and op == "fusion"
        counts["transposes"] += op == "transpose"
        counts["copies"] += op == "copy"
        if top and op not in _VIEWS and dtype == "f32" and activation_shaped(shape, batch=batch, seq_len=seq_len):
            counts["f32_activations"] += 1
            counts["f32_activation_bytes"] += 4 * math.prod(shape)
        if op in ("dot", "convolution"):
            counts["dots"] += 1
            counts["bf16_dots_f32_out"] += dtype == "f32" and bool(_BF16_OPERAND.search(line[match.end() - 1:]))
    return HloFacts(**counts)
