"""Check the compiled program: does the optimized HLO hold the collectives the plan implies?

A plan's mesh implies communication: gradient reduction over ``data`` (an
all-reduce, or a reduce-scatter under ZeRO-2/3), parameter gathers over
``fsdp`` and for ZeRO (all-gather), Megatron's all-reduces over ``tensor``,
activation transfers between ``stage`` s (a collective-permute inside a
program, or cross-mesh transfers between per-stage programs), and ring
attention's K/V sends over ``context`` (collective-permutes). The counts come
from the text of ``jitted.lower(...).compile().as_text()``; async pairs
(``all-reduce-start``/``-done``) count once. Pure text processing, no JAX.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from testbed.plan.spec import Plan
from testbed.plan.sharding import state_sharding

__all__ = ["COLLECTIVES", "count_collectives", "expected_collectives", "check_collectives"]

#: HLO collective op names counted in compiled programs.
COLLECTIVES: tuple[str, ...] = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")

#: Pseudo-op for transfers between per-stage programs (not visible inside any one program).
TRANSFER = "cross-mesh-transfer"

_OP = re.compile(r"=\s*[^=]*?\b(" + "|".join(COLLECTIVES) + r")(-start)?\(")


def count_collectives(hlo_texts: Iterable[str]) -> dict[str, int]:
    """Instructions of each collective kind over several optimized HLO module texts."""
    counts = {name: 0 for name in COLLECTIVES}
    for text in hlo_texts:
        for line in text.splitlines():
            match = _OP.search(line)
            if match:
                counts[match.group(1)] += 1
    return counts


def expected_collectives(plan: Plan) -> list[str]:
    """What the plan's mesh implies, one ``axis: op|op`` entry per communicating axis.

    Any op of an entry satisfies it (XLA may pick either form of a reduction).
    """
    mesh = plan.mesh
    out = []
    if mesh.data > 1:
        out.append("data: all-reduce|reduce-scatter")
    if state_sharding(plan).split_axes(plan, "optimizer"):  # sharded state is gathered for use
        out.append(f"{'fsdp' if mesh.fsdp > 1 else 'zero'}: all-gather")
    if mesh.tensor > 1:  # sequence parallelism: a reduce-scatter after each row-parallel matmul instead
        out.append("tensor: reduce-scatter" if plan.sequence_parallel else "tensor: all-reduce")
    if mesh.stage > 1:
        out.append(f"stage: collective-permute|{TRANSFER}")
    if mesh.context > 1:  # ring attention: K/V (and dK/dV) passed around the context ring (testbed.runner.ring_attention)
        out.append("context: collective-permute")
    if mesh.expert > 1 and any(plan.model.is_moe_layer(i) for i in range(plan.model.layers)):
        # MoE dispatch and combine of the routed experts' tokens (testbed.runner.moe)
        out.append("expert: all-to-all")
    return out


def check_collectives(plan: Plan, hlo_texts: Iterable[str], transfers: int = 0) -> dict[str, Any]:
    """``{expected: [...], found: {op: count}, missing: [...], ok}`` for the plan's compiled programs."""
    found = count_collectives(hlo_texts)
    found[TRANSFER] = int(transfers)
    expected = expected_collectives(plan)
    missing = [entry for entry in expected
               if not any(found.get(op, 0) > 0 for op in entry.split(": ", 1)[1].split("|"))]
    return {"expected": expected, "found": found, "missing": missing, "ok": not missing}
