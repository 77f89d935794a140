"""The compiled-HLO reader of check-sharding --compile: collectives per mesh axis, loop trip counts, async pairs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from testbed.runner import hlo_schedule as hs

# A scheduled module in XLA:TPU's forms (2x2 mesh, axes data and tensor): an all-gather-start/done pair with
# two instructions between, a reduce-scatter inside an async-start wrapper, a synchronous all-reduce in a while
# body whose condition compares with 4, and a group-of-one all-reduce that moves nothing.
_HLO = """HloModule jit_step, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_computation (p: f32[8,16]) -> f32[8,16] {
  %p = f32[8,16]{1,0} parameter(0)
  ROOT %n = f32[8,16]{1,0} negate(%p)
}

%async_rs (x: f32[8,16]) -> f32[4,16] {
  %x = f32[8,16]{1,0} parameter(0)
  ROOT %reduce-scatter.1 = f32[4,16]{1,0} reduce-scatter(%x), channel_id=3, replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}, to_apply=%add
}

%cond (c: (s32[], f32[8,16])) -> pred[] {
  %c = (s32[]{:T(128)}, f32[8,16]{1,0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%c), index=0
  %limit = s32[]{:T(128)} constant(4)
  ROOT %lt = pred[] compare(%i, %limit), direction=LT
}

%body (c: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %c = (s32[]{:T(128)}, f32[8,16]{1,0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%c), index=0
  %v = f32[8,16]{1,0} get-tuple-element(%c), index=1
  %all-reduce.2 = f32[8,16]{1,0} all-reduce(%v), channel_id=4, replica_groups=[2,2]<=[4], use_global_device_ids=true, to_apply=%add
  %fusion.2 = f32[8,16]{1,0} fusion(%all-reduce.2), kind=kLoop, calls=%fused_computation
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %fusion.2)
}

ENTRY %main (p0: f32[4,16], p1: f32[8,16]) -> f32[8,16] {
  %p0 = f32[4,16]{1,0} parameter(0)
  %p1 = f32[8,16]{1,0} parameter(1)
  %all-gather-start.1 = (f32[4,16]{1,0}, f32[8,16]{1,0}) all-gather-start(%p0), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}, use_global_device_ids=true
  %fusion.1 = f32[8,16]{1,0} fusion(%p1), kind=kLoop, calls=%fused_computation
  %neg = f32[8,16]{1,0} negate(%fusion.1)
  %all-gather-done.1 = f32[8,16]{1,0} all-gather-done(%all-gather-start.1)
  %async-start.1 = ((f32[8,16]{1,0}), f32[4,16]{1,0}, s32[]) async-start(%neg), calls=%async_rs
  %copy = f32[8,16]{1,0} copy(%neg)
  %async-done.1 = f32[4,16]{1,0} async-done(%async-start.1)
  %single = f32[8,16]{1,0} all-reduce(%copy), channel_id=5, replica_groups={{0},{1},{2},{3}}, to_apply=%add
  %zero = s32[]{:T(128)} constant(0)
  %init = (s32[], f32[8,16]{1,0}) tuple(%zero, %single)
  %loop = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%loop), index=1
}
"""

_AXES = ("data", "tensor")


def test_collectives_map_groups_to_axes_and_read_async_pairs_and_loops():
    found = {c.name: c for c in hs.collectives(_HLO, (2, 2), _AXES)}
    assert set(found) == {"all-gather-start.1", "reduce-scatter.1", "all-reduce.2"}  # the group of one moves nothing
    gather, scatter, reduce = found["all-gather-start.1"], found["reduce-scatter.1"], found["all-reduce.2"]
    # Partition i is the mesh's i-th device row-major: {0,1} varies the last axis, [2,2]<=[2,2]T(1,0) the first.
    assert (gather.axes, scatter.axes, reduce.axes) == ("tensor", "data", "tensor")
    assert gather.bytes == 8 * 16 * 4  # the gathered output, read from the done
    assert scatter.bytes == 4 * 16 * 4 * 2  # result times the group: its whole input
    assert (gather.overlap, scatter.overlap, reduce.overlap) == (2, 1, None)
    assert scatter.computation == "main" and scatter.executions == 1
    assert reduce.executions == 4 and not reduce.asynchronous


def test_per_axis_counts_executions_and_bytes():
    rows = {(r.axes, r.kind): r for r in hs.per_axis(hs.collectives(_HLO, (2, 2), _AXES))}
    assert rows[("tensor", "all-reduce")].count == 4
    assert rows[("tensor", "all-reduce")].instructions == 1
    assert rows[("tensor", "all-reduce")].bytes == 4 * 8 * 16 * 4
    assert rows[("tensor", "all-gather")].asynchronous == 1
    assert rows[("data", "reduce-scatter")].overlap == 1


def test_fusions_counted_per_text_and_per_execution():
    assert hs.fusion_count(_HLO) == {"instructions": 2, "executions": 1 + 4}


def test_known_trip_count_wins_over_the_condition():
    text = _HLO.replace("condition=%cond, body=%body",
                        'condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}')
    assert hs.multiplicities(hs.computations(text))["body"] == 7


# XLA:TPU's async collective fusion (the form of libtpu 0.0.42's compile of the runner's fsdp step, abridged): one
# all-gather over the 4 devices as a chain: its AsyncCollectiveStart fusion, a step fused into a while body of 16
# trips, a step in the entry, and its AsyncCollectiveDone fusion; each holds a copy of the all-gather (chain 7).
_AG = ('bf16[8,16]{{1,0}} all-gather(%{p}), channel_id=1, replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}, '
       'use_global_device_ids=true, frontend_attributes={{chain_id="7"}}, backend_config={{"async_collective_fusion_'
       'config":{{"flag_start":"{f}","flag_end":"{e}"}}}}')
_CHAIN = f"""HloModule jit_step, is_scheduled=true

%start_comp (s: bf16[2,16]) -> (bf16[2,16], bf16[8,16]) {{
  %s = bf16[2,16]{{1,0}} parameter(0)
  %all-gather.1 = {_AG.format(p="s", f=-1, e=-1)}
  ROOT %cc.1 = (bf16[2,16]{{1,0}}, bf16[8,16]{{1,0}}) custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}}

%step_comp (a: bf16[2,16], b: bf16[8,16]) -> bf16[8,16] {{
  %a = bf16[2,16]{{1,0}} parameter(0)
  %b = bf16[8,16]{{1,0}} parameter(1)
  ROOT %all-gather.2 = {_AG.format(p="a", f=2, e=8)}
}}

%done_comp (a: bf16[2,16], b: bf16[8,16]) -> bf16[8,16] {{
  %a = bf16[2,16]{{1,0}} parameter(0)
  %b = bf16[8,16]{{1,0}} parameter(1)
  %all-gather.3 = {_AG.format(p="a", f=2, e=8)}
  ROOT %cc.2 = bf16[8,16]{{1,0}} custom-call(%a, %b, %all-gather.3), custom_call_target="AsyncCollectiveDone"
}}

%cond (c: (s32[], bf16[2,16], bf16[8,16])) -> pred[] {{
  %c = (s32[], bf16[2,16]{{1,0}}, bf16[8,16]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %limit = s32[] constant(16)
  ROOT %lt = pred[] compare(%i, %limit), direction=LT
}}

%body (c: (s32[], bf16[2,16], bf16[8,16])) -> (s32[], bf16[2,16], bf16[8,16]) {{
  %c = (s32[], bf16[2,16]{{1,0}}, bf16[8,16]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %a = bf16[2,16]{{1,0}} get-tuple-element(%c), index=1
  %b = bf16[8,16]{{1,0}} get-tuple-element(%c), index=2
  %async_collective_fusion.1 = bf16[8,16]{{1,0}} fusion(%a, %b), kind=kCustom, calls=%step_comp
  ROOT %t = (s32[], bf16[2,16]{{1,0}}, bf16[8,16]{{1,0}}) tuple(%i, %a, %async_collective_fusion.1)
}}

ENTRY %main (p0: bf16[2,16]) -> bf16[8,16] {{
  %p0 = bf16[2,16]{{1,0}} parameter(0)
  %async-collective-start.1 = (bf16[2,16]{{1,0}}, bf16[8,16]{{1,0}}) fusion(%p0), kind=kCustom, calls=%start_comp
  %a = bf16[2,16]{{1,0}} get-tuple-element(%async-collective-start.1), index=0
  %b = bf16[8,16]{{1,0}} get-tuple-element(%async-collective-start.1), index=1
  %zero = s32[] constant(0)
  %init = (s32[], bf16[2,16]{{1,0}}, bf16[8,16]{{1,0}}) tuple(%zero, %a, %b)
  %loop = (s32[], bf16[2,16]{{1,0}}, bf16[8,16]{{1,0}}) while(%init), condition=%cond, body=%body
  %b2 = bf16[8,16]{{1,0}} get-tuple-element(%loop), index=2
  %async_collective_fusion.2 = bf16[8,16]{{1,0}} fusion(%a, %b2), kind=kCustom, calls=%step_comp
  ROOT %async-collective-done.1 = bf16[8,16]{{1,0}} fusion(%a, %async_collective_fusion.2), kind=kCustom, calls=%done_comp
}}
"""


def test_an_async_collective_fusion_chain_is_one_collective_at_its_start():
    """XLA:TPU's chain (start, steps in and out of a loop, done) is one all-gather, run once, asynchronous."""
    (gather,) = hs.collectives(_CHAIN, (4,), ("fsdp",))
    assert (gather.kind, gather.axes, gather.bytes) == ("all-gather", "fsdp", 8 * 16 * 2)
    assert (gather.computation, gather.position, gather.executions) == ("main", 1, 1)
    assert gather.overlap == 7  # the instructions between the start and the done, the loop and a step among them


def test_xla_cpu_compile_of_a_sharded_step():
    """On an XLA:CPU compile (4 of the 8 test devices as data 2 x tensor 2): the gradient reduction over data."""
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), _AXES)
    w = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))

    def grad(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)

    text = jax.jit(grad, out_shardings=NamedSharding(mesh, P())).lower(w, x).compile().as_text()
    rows = {(r.axes, r.kind): r for r in hs.per_axis(hs.collectives(text, (2, 2), _AXES))}
    assert ("data", "all-reduce") in rows
    assert rows[("data", "all-reduce")].bytes == 64 * 64 * 4
    assert all(axes == "data" for axes, _ in rows)


# XLA:TPU's all-reduce-scatter fusion (libtpu 0.0.42's compile of a [1024, 4096] bf16 gradient reduce-scattered
# along dim 0 over a v5e 2x2 slice, abridged): the reduce-scatter decomposer's all-reduce and dynamic-slice of the
# padded input, emitted as one reduce-scatter; each shard completed by a collective-permute of a slice of it.
_SCATTER = """HloModule jit_body, is_scheduled=true

%region (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

%all-reduce-scatter (input: bf16[1024,4096]) -> bf16[288,4096] {
  %input = bf16[1024,4096]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %constant = bf16[] constant(0)
  %pad = bf16[1152,4096]{1,0:T(8,128)(2,1)} pad(%input, %constant), padding=0_128x0_0
  %all-reduce.1 = bf16[1152,4096]{1,0:T(8,128)(2,1)} all-reduce(%pad), channel_id=2, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%region
  %partition-id = u32[] partition-id()
  %constant.1 = u32[] constant(288)
  %multiply = u32[]{:T(128)} multiply(%partition-id, %constant.1)
  %constant.2 = u32[] constant(0)
  ROOT %dynamic-slice = bf16[288,4096]{1,0:T(8,128)(2,1)S(1)} dynamic-slice(%all-reduce.1, %multiply, %constant.2), dynamic_slice_sizes={288,4096}
}

ENTRY %main (p: bf16[1024,4096]) -> bf16[384,4096] {
  %p = bf16[1024,4096]{1,0:T(8,128)(2,1)} parameter(0)
  %fusion = bf16[288,4096]{1,0:T(8,128)(2,1)S(1)} fusion(%p), kind=kCustom, calls=%all-reduce-scatter, backend_config={"flag_configs":[],"collective_algorithm_config":{"emitter":"SingleInputAllReduceScatterFusion","strategy":"StrategySubgroupND"}}
  %slice = bf16[96,4096]{1,0:T(8,128)(2,1)S(1)} slice(%fusion), slice={[192:288], [0:4096]}
  %collective-permute-start = (bf16[96,4096]{1,0:T(8,128)(2,1)S(1)}, bf16[96,4096]{1,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%slice), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3}}
  %collective-permute-done = bf16[96,4096]{1,0:T(8,128)(2,1)S(1)} collective-permute-done(%collective-permute-start)
  %other = bf16[96,4096]{1,0:T(8,128)(2,1)S(1)} negate(%collective-permute-done)
  %shift-start = (bf16[96,4096]{1,0}, bf16[96,4096]{1,0}, u32[], u32[]) collective-permute-start(%other), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %shift-done = bf16[96,4096]{1,0} collective-permute-done(%shift-start)
  ROOT %concatenate = bf16[384,4096]{1,0:T(8,128)(2,1)S(1)} concatenate(%shift-done, %fusion), dimensions={0}
}
"""


def test_an_all_reduce_scatter_fusion_is_its_reduce_scatter_with_its_fixups():
    """The fused all-reduce counts as one reduce-scatter of the fusion's input (unpadded); the permute of a slice
    of its output is its fix-up, in its row's fixup_bytes; a permute of anything else stays a collective."""
    found = {c.name: c for c in hs.collectives(_SCATTER, (4,), ("fsdp",))}
    scatter = found["fusion"]
    assert (scatter.kind, scatter.bytes, scatter.position, scatter.computation) == (
        "reduce-scatter", 1024 * 4096 * 2, 1, "main")
    assert found["collective-permute-start"].fixes == "fusion" and found["shift-start"].fixes is None
    rows = {r.kind: r for r in hs.per_axis(list(found.values()))}
    assert set(rows) == {"reduce-scatter", "collective-permute"}
    assert (rows["reduce-scatter"].count, rows["reduce-scatter"].fixup_bytes) == (1, 96 * 4096 * 2)
    assert rows["collective-permute"].count == 1 and rows["collective-permute"].fixup_bytes == 0
    assert rows["reduce-scatter"].to_dict()["fixup_bytes"] == 96 * 4096 * 2
    assert "fixup_bytes" not in rows["collective-permute"].to_dict()


def test_an_all_reduce_in_a_plain_custom_fusion_stays_an_all_reduce():
    """Without the all-reduce-scatter emitter the fused all-reduce is an all-reduce of its padded buffer."""
    text = _SCATTER.replace("SingleInputAllReduceScatterFusion", "RotatedPincerShortEmitter")
    kinds = {c.name: (c.kind, c.bytes, c.fixes) for c in hs.collectives(text, (4,), ("fsdp",))}
    assert kinds["all-reduce.1"] == ("all-reduce", 1152 * 4096 * 2, None)
    assert kinds["collective-permute-start"][2] is None
