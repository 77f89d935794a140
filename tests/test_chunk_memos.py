"""The chunk facts' merged gathers and reduce-scatters (testbed.model.blocks' block_ops and gather_holds,
testbed.model.block_scatters' scatter_ops, scatter_reads, scatter_early and scatter_cuts) are memoized on what they
read of the plan: plans apart only in what none of them reads (the microbatch count, the ZeRO stage's optimizer,
the schedule beside its virtual stages, the name) share one answer, equal to each one's own reading of the merges,
and plans apart in what they read (the fsdp ways) do not."""

from __future__ import annotations

import math
import pytest

from testbed.model import block_scatters as bs
from testbed.model import blocks as bl
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan

MODEL = ModelSpec(layers=4, d_model=1024, heads=8, d_ff=4096, seq_len=512, vocab=32000)


def _plan(microbatches: int = 1, fsdp: int = 16, name: str = "a") -> Plan:
    return Plan(name=name, model=MODEL, mesh=MeshSpec(fsdp=fsdp, tensor=2), precision="bf16-mixed",
                batch=BatchSpec(global_batch=64, microbatches=microbatches), sequence_parallel=True)


GATHERS = (6, 30 * 2 ** 20, 2.0)  # blocks (embedding, 4 layers, head), XLA's merge bound, bf16
SCATTERS = (6, 30 * 2 ** 20, 4.0)


def _gathered(plan: Plan, kind: str):
    """The gathers' ops and holds as the merges give them, unmemoized."""
    key = bl._gathers_key(plan)
    args = (0, 0, kind, GATHERS[0], 0, GATHERS[1], GATHERS[2], False, 0.0, bl.NO_LOWERING)
    return bl._block_ops.__wrapped__(*key, *args), bl._gather_holds.__wrapped__(*key, *args)


@pytest.mark.parametrize("kind", ["F", "B"])
def test_gathers_memoized_on_what_they_read(kind: str) -> None:
    a, b, wider = _plan(1), _plan(4, name="b"), _plan(1, fsdp=32)
    for plan in (a, b, wider):
        ops = bl.block_ops(plan, 0, 0, kind, GATHERS[0], 0, *GATHERS[1:])
        holds = bl.gather_holds(plan, 0, 0, kind, GATHERS[0], 0, *GATHERS[1:])
        assert (ops, holds) == _gathered(plan, kind)
    assert bl.gather_holds(a, 0, 0, kind, GATHERS[0], 0, *GATHERS[1:]) is \
        bl.gather_holds(b, 0, 0, kind, GATHERS[0], 0, *GATHERS[1:])
    assert bl._gathers_key(a) == bl._gathers_key(b) != bl._gathers_key(wider)
    assert any(len(block) > 1 for block in bl.gather_holds(a, 0, 0, kind, GATHERS[0], 0, *GATHERS[1:]))


def test_scatters_memoized_on_what_they_read() -> None:
    a, b, wider = _plan(1), _plan(4, name="b"), _plan(1, fsdp=32)
    readings = (bs.scatter_ops, bs.scatter_reads, bs.scatter_early, bs.scatter_cuts)
    memos = (bs._scatter_ops, bs._scatter_reads, bs._scatter_early, bs._scatter_cuts)
    for plan in (a, b, wider):
        key = bs._merges_key(plan, 0, 0, *SCATTERS, False, False)
        for read, memo in zip(readings, memos):
            assert read(plan, 0, 0, *SCATTERS) == memo.__wrapped__(*key)
    assert bs.scatter_cuts(a, 0, 0, *SCATTERS) is bs.scatter_cuts(b, 0, 0, *SCATTERS)
    assert bs._merges_key(a, 0, 0, *SCATTERS, False, False) != bs._merges_key(wider, 0, 0, *SCATTERS, False, False)
