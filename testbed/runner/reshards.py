"""The collectives a lowered program needs, found without devices: Shardy's partitioning of its StableHLO.

A program lowered on an abstract mesh (``jax.jit(f).trace(...).lower(...)``)
holds only sharding annotations: XLA's SPMD partitioner inserts the
collectives when it compiles, and compiling needs the real devices. Shardy,
the sharding dialect JAX lowers to, can do the partitioner's job on the
StableHLO itself: its propagation pipeline, then ``insert-explicit-reshards``
(the full version) and ``reshard-to-collectives`` turn every place where an
op's operands and results disagree into explicit ``sdy.all_reduce``,
``all_gather``, ``reduce_scatter``, ``all_to_all`` and ``collective_permute``
ops that name the mesh axes they run over; the explicit collectives that
``shard_map`` bodies already hold (``stablehlo.all_gather`` ..., e.g. the
runner's sequence parallelism) are read with their device groups mapped to
the same axes. The passes run in jaxlib's own
MLIR context, on one host core, whatever the device count.

What this finds is what Shardy decides; XLA's compiler, given real devices,
partitions the same annotated program with the same propagated shardings but
may pick other forms (a reduce-scatter where Shardy all-reduces, a gather
where Shardy moves activations with an all-to-all) and its combiners merge
the per-leaf gradient reductions into a few large ones. The axes that carry
communication are the plan's; op counts are Shardy's, per leaf.
:func:`compiled_axes` maps the replica groups of XLA's compiled HLO to the
same mesh axes, so the two can be compared where the devices exist.

Counts are executions per program run: an op inside a ``stablehlo.while``
(the microbatch ``lax.scan``) counts its trip count, an op in a private
function once per call (calls inside loops multiplied). Bytes follow
``testbed.collectives`` (the nccl-tests convention): per device, the whole
buffer of one rank for all-reduce, all-to-all and collective-permute, the
whole gathered buffer (n blocks) for all-gather and reduce-scatter.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

# Reading compiled HLO lives in testbed.runner.hlo; re-exported here where the comparisons began.
from testbed.runner.hlo import compiled_axes, compiled_bytes, replica_groups, varying_dims

__all__ = ["Reshard", "PASSES", "KINDS", "MANUAL", "partition", "collectives", "result_shardings", "replica_groups",
           "compiled_axes", "compiled_bytes"]

#: Shardy's partitioning, as a pass pipeline over the lowered module.
PASSES = ("builtin.module(sdy-propagation-pipeline,"
          "func.func(sdy-insert-explicit-reshards{enable-full-version=true}),"
          "func.func(sdy-reshard-to-collectives))")

#: Shardy collective op -> (HLO spelling, attribute naming the axes it runs over).
KINDS: dict[str, tuple[str, str | None]] = {
    "sdy.all_reduce": ("all-reduce", "reduction_axes"),
    "sdy.all_gather": ("all-gather", "gathering_axes"),
    "sdy.reduce_scatter": ("reduce-scatter", "reduce_scatter_axes"),
    "sdy.all_to_all": ("all-to-all", "params"),
    "sdy.collective_permute": ("collective-permute", None),
}

#: Explicit collectives inside ``shard_map`` bodies (``sdy.manual_computation``): HLO spelling.
MANUAL: dict[str, str] = {
    "stablehlo.all_reduce": "all-reduce", "stablehlo.all_gather": "all-gather",
    "stablehlo.reduce_scatter": "reduce-scatter", "stablehlo.all_to_all": "all-to-all",
    "stablehlo.collective_permute": "collective-permute",
}

#: Name-stack component of the ops JAX recomputes in a checkpoint's backward.
_REMAT = "rematted_computation"

_AXIS_REF = re.compile(r'"([^"]+)"(?::\((\d+)\)(\d+))?')
_DIM = re.compile(r"\{([^{}]*)\}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Reshard:
    """One collective of a partitioned program (identical ops merged: ``times`` counts them all).

    ``axes`` are the mesh axes its groups span, in mesh order; ``group``
    the number of devices in one group; ``bytes`` per device and execution
    (module doc); ``times`` executions per program run; ``shape`` and
    ``dtype`` the operand: global for Shardy's ops, the body's block for
    the explicit collectives of ``shard_map`` bodies (:data:`MANUAL`; local
    along the map's manual axes, and divided by the map's free axes that
    split it for ``bytes``). ``recomputed``: inside a ``jax.checkpoint``'s
    rematerialised computation (Megatron's second gather of a sequence
    shard; XLA may reuse the forward's result instead).
    """

    kind: str
    axes: tuple[str, ...]
    group: int
    bytes: int
    times: int
    shape: tuple[int, ...]
    dtype: str
    recomputed: bool = False

    def __post_init__(self) -> None:
        if self.kind not in {k for k, _ in KINDS.values()}:
            raise ValueError(f"unknown collective kind {self.kind!r}")
        if self.group < 1 or self.bytes < 0 or self.times < 1:
            raise ValueError(f"group >= 1, bytes >= 0 and times >= 1 needed, got {self.group}, {self.bytes}, {self.times}")

    @property
    def axis_label(self) -> str:
        """The spanned axes joined with ``+`` (``data+fsdp``)."""
        return "+".join(self.axes)


def _refs(text: str, sizes: dict[str, int]) -> list[tuple[str, int]]:
    """Axis references in an attribute's text: (axis name, size of the (sub-)axis)."""
    return [(name, int(sub) if sub else sizes[name]) for name, _, sub in _AXIS_REF.findall(text)]


def _dims(sharding: str, sizes: dict[str, int]) -> list[list[tuple[str, int]]]:
    """Per dim, the axis references of a ``#sdy.sharding<@mesh, [{...}, ...]>`` text."""
    body = sharding[sharding.index("[") + 1:]
    depth, end = 1, 0
    for end, ch in enumerate(body):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth == 0:
            break
    return [_refs(dim, sizes) for dim in _DIM.findall(body[:end])]


def _dtype_bytes(element: str) -> int:
    from testbed.sim.xla.workload import element_bytes

    return element_bytes(element)


def _trip_count(op: Any) -> int | None:
    """Iterations of a ``stablehlo.while`` lowered from ``lax.scan``/``fori_loop``: ``i < N``, N a constant."""
    constants: dict[str, int] = {}
    for inner in op.regions[0].blocks[0].operations:
        name = inner.operation.name
        if name in ("stablehlo.constant", "sdy.constant"):
            value = re.search(r"dense<(-?\d+)>", str(inner.attributes["value"]))
            if value:
                constants[inner.results[0].get_name()] = int(value.group(1))
        if name == "stablehlo.compare" and "LT" in str(inner.attributes["comparison_direction"]):
            bound = constants.get(inner.operands[1].get_name())
            if bound is not None:
                return bound
    return None


def _collective(op: Any, sizes: dict[str, int], order: list[str]) -> tuple:
    """(kind, axes, group, bytes, shape, dtype) of one Shardy collective op."""
    kind, attr = KINDS[op.operation.name]
    out = str(op.attributes["out_sharding"])
    dims = _dims(out, sizes)
    refs = _refs(str(op.attributes[attr]), sizes) if attr else [r for dim in dims for r in dim]
    group = math.prod(size for _, size in refs)
    operand = op.operands[0].type
    shape = tuple(int(d) for d in operand.shape)
    element = str(operand.element_type)
    local = math.prod(shape) * _dtype_bytes(element) // max(1, math.prod(size for dim in dims for _, size in dim))
    nbytes = local * group if kind == "reduce-scatter" else local
    axes = tuple(a for a in order if a in {name for name, _ in refs})
    return kind, axes, group, nbytes, shape, element


_PER_VALUE = re.compile(r"<@[\w.]+,\s*\[[^\]]*\][^<>]*>")


def _free_split(value: Any, manual: frozenset[str], sizes: dict[str, int]) -> int:
    """Devices that split ``value`` of a shard_map body over the map's free (automatic) axes.

    Inside a map the types are local along the manual axes only; Shardy's
    propagation records the split over the free axes on the defining op
    (``sdy.sharding``) or, for a block argument, the map's ``in_shardings``.
    """
    from jaxlib.mlir import ir

    owner = value.owner
    if isinstance(owner, ir.Block):
        parent = owner.owner
        attr, index = "in_shardings", ir.BlockArgument(value).arg_number
    else:
        parent, attr, index = owner, "sdy.sharding", ir.OpResult(value).result_number
    if attr not in parent.attributes:
        return 1
    values = _PER_VALUE.findall(str(parent.attributes[attr]))
    if index >= len(values):
        return 1
    return math.prod(size for dim in _dims(values[index], sizes) for name, size in dim if name not in manual)


def _manual(op: Any, sizes: dict[str, int], order: list[str], manual: frozenset[str] = frozenset()) -> tuple:
    """(kind, axes, group, bytes, shape, dtype) of an explicit collective in a shard_map body (local shapes).

    Its device groups (``replica_groups``, or a permute's pairs) are ids of
    the abstract mesh's devices in row-major order; ``manual`` the map's
    manual axes (the bytes are one device's: divided by the free axes' split).
    """
    kind = MANUAL[op.operation.name]
    attr = "source_target_pairs" if kind == "collective-permute" else "replica_groups"
    from jaxlib.mlir import ir

    # Read as an array: MLIR prints a large dense attribute (4096 devices' groups) as a hex string.
    groups = np.atleast_2d(np.asarray(ir.DenseIntElementsAttr(op.attributes[attr]))).tolist()
    shape_ = tuple(sizes[a] for a in order)
    axes = tuple(order[i] for i in varying_dims(groups, shape_))
    value = op.results[0] if kind == "all-gather" else op.operands[0]
    shape = tuple(int(d) for d in value.type.shape)
    element = str(value.type.element_type)
    group = math.prod(sizes[a] for a in axes) if kind == "collective-permute" else max(len(g) for g in groups)
    local = math.prod(shape) * _dtype_bytes(element) // max(1, _free_split(value, manual, sizes))
    return kind, axes, group, local, shape, element


def partition(text: str, follow_xla: bool = False) -> Any:
    """Run :data:`PASSES` on a lowered module's text; the partitioned ``ir.Module`` and its context.

    ``follow_xla``: partition the matmuls where XLA's SPMD partitioner differs from Shardy's explicit reshards
    as XLA does, and split the all-reduces XLA splits (testbed.runner.gspmd_dots)."""
    from jax.interpreters import mlir as jmlir
    from jaxlib.mlir import ir, passmanager

    from testbed.runner import gspmd_dots

    context = jmlir.make_ir_context()
    with context:
        module = ir.Module.parse(text)
        if not follow_xla:
            passmanager.PassManager.parse(PASSES).run(module.operation)
            return module, context
        propagate, reshard = PASSES.split(",", 1)
        passmanager.PassManager.parse(propagate + ")").run(module.operation)
        gspmd_dots.follow_gspmd(module)
        passmanager.PassManager.parse("builtin.module(" + reshard).run(module.operation)
        gspmd_dots.split_reductions(module)
    return module, context


def _functions(module: Any) -> dict[str, Any]:
    return {str(op.attributes["sym_name"]).strip('"'): op for op in module.body.operations
            if op.operation.name == "func.func"}


def collectives(text: str, axis_sizes: dict[str, int]) -> tuple[list[Reshard], list[str]]:
    """The collectives Shardy inserts into a lowered module (``lowered.as_text()``), and warnings.

    ``axis_sizes``: the mesh's axes in order with their sizes. A loop whose
    trip count cannot be read counts once and is named in the warnings.
    """
    from jaxlib.mlir import ir

    module, context = partition(text)
    order = list(axis_sizes)
    warnings: list[str] = []
    with context:
        functions = _functions(module)
        totals: dict[tuple, Counter] = {}

        def walk(op: Any, times: int, found: Counter, manual: frozenset[str], remat: bool) -> None:
            for region in op.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        name = inner.operation.name
                        if not (name in KINDS or name in MANUAL or name in ("func.call", "call") or len(inner.regions)):
                            continue  # a plain op: nothing to count, nothing inside (its location unread: slow to print)
                        again = remat or _REMAT in str(inner.location)
                        if name in KINDS:
                            found[(*_collective(inner, axis_sizes, order), again)] += times
                        elif name in MANUAL:
                            found[(*_manual(inner, axis_sizes, order, manual), again)] += times
                        elif name in ("func.call", "call"):
                            callee = ir.FlatSymbolRefAttr(inner.attributes["callee"]).value
                            for key, n in function_total(callee, manual, again).items():
                                found[key] += n * times
                        inner_times, inner_manual = times, manual
                        if name == "stablehlo.while":
                            trips = _trip_count(inner)
                            if trips is None:
                                warnings.append("a loop whose trip count is not a constant: its collectives count once")
                            inner_times = times * (trips or 1)
                        if name == "sdy.manual_computation":
                            inner_manual = manual | frozenset(re.findall(r'"([^"]+)"', str(inner.attributes["manual_axes"])))
                        walk(inner, inner_times, found, inner_manual, again)

        def function_total(name: str, manual: frozenset[str] = frozenset(), remat: bool = False) -> Counter:
            key = (name, manual, remat)
            if key not in totals:
                totals[key] = Counter()  # guards recursion; JAX emits none
                found: Counter = Counter()
                walk(functions[name], 1, found, manual, remat)
                totals[key] = found
            return totals[key]

        entry = "main" if "main" in functions else next(iter(functions))
        found = function_total(entry)
    # A group of one device (an axis of size 1) moves nothing.
    out = [Reshard(kind=k, axes=axes, group=g, bytes=b, times=n, shape=shape, dtype=dtype, recomputed=again)
           for (k, axes, g, b, shape, dtype, again), n in found.items() if n > 0 and g > 1]
    out.sort(key=lambda r: (r.axes, r.kind, -r.bytes))
    return out, sorted(set(warnings))


def result_shardings(text: str, axis_sizes: dict[str, int]) -> list[tuple[tuple[str, ...] | None, ...] | None]:
    """Per result of the module's main function, its propagated sharding as PartitionSpec entries.

    Each entry is a dim's axes tuple (or None when unsharded); a result
    whose sharding uses a sub-axis (no PartitionSpec can say it) or has
    none is None. Used to lower a program that takes another's outputs.
    """
    from jaxlib.mlir import ir

    module, context = partition(text)
    out: list[Any] = []
    with context:
        main = _functions(module)["main"]
        attrs = main.attributes["res_attrs"] if "res_attrs" in main.attributes else None
        count = len(ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).results)
        for i in range(count):
            text_i = str(attrs[i]) if attrs is not None else ""
            match = re.search(r"#sdy\.sharding<[^>]*\]>", text_i)
            if not match or ":(" in match.group(0):
                out.append(None)
                continue
            dims = _dims(match.group(0), axis_sizes)
            out.append(tuple(tuple(name for name, _ in dim) or None for dim in dims))
    return out
