"""Partition a traced program's matmuls as XLA's SPMD partitioner does, where Shardy's explicit reshards differ.

XLA compiles a jitted step by running Shardy's propagation and then its own SPMD partitioner (GSPMD), not
Shardy's ``insert-explicit-reshards``. The two agree on most matmuls; they differ on the FSDP pattern (a weight
sharded on its contracting dim against an activation sharded on the same axis): Shardy moves the activation with
an all-to-all and all-reduces the partial products, GSPMD gathers the weight whole. Read off the compiled HLO of
``benchmarks/heldout/fsdp_adamw.py`` on 8 emulated devices: every forward matmul gathers its weight, the input
gradients reuse the gathered weight (XLA's CSE, so it stays live from the forward to the backward), and the weight
gradients are local products all-reduced whole.

:func:`follow_gspmd` imposes GSPMD's base-case choices (``xla/service/spmd/dot_handler.cc``, ``PartitionBaseCase``)
on the propagated module before Shardy inserts its reshards, as explicit ``sdy.reshard`` ops Shardy then
lowers to collectives:

- both operands sharded alike on the contracting dims: the local product, all-reduced over those axes, then
  resharded to the result's sharding (a slice);
- one operand's batch and free dims sharded as the result's and its contracting dims whole: the other operand
  resharded to match (contracting dims whole, its free dims as the result's), one reshard per value and target
  in a block (XLA's CSE).

:func:`split_reductions` then follows XLA's ``AllReduceSplitter`` (``xla/service/all_reduce_splitter.cc``): an
all-reduce over axes A whose result is sliced over S (a proper subset of A) is an all-reduce over S of the
whole buffer, the slice, and an all-reduce over A minus S of the slice. Any other dot is left to Shardy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["Sharding", "parse_sharding", "dot_plan", "follow_gspmd", "split_reductions"]

_ONE = re.compile(r"<@([\w.$-]+), \[([^\[\]]*)\]([^<>]*)>?")
_DIM = re.compile(r"\{([^{}]*)\}")
_NAME = re.compile(r'"([^"]+)"')


@dataclass(frozen=True, slots=True)
class Sharding:
    """A value's sharding: the mesh's name and, per dim, the axes it is split over (major first)."""

    mesh: str
    dims: tuple[tuple[str, ...], ...]

    def __post_init__(self) -> None:
        used = [a for d in self.dims for a in d]
        if len(used) != len(set(used)):
            raise ValueError(f"an axis shards two dims: {self.dims}")

    def text(self) -> str:
        dims = ", ".join("{" + ", ".join(f'"{a}"' for a in d) + "}" for d in self.dims)
        return f"#sdy.sharding<@{self.mesh}, [{dims}]>"


def parse_sharding(text: str) -> Sharding | None:
    """One ``<@mesh, [{...}, ...]>`` text as a Sharding; None where it holds an open dim, a sub-axis or unreduced
    axes (left to Shardy)."""
    match = _ONE.search(text)
    if not match or "unreduced" in match.group(3):
        return None
    dims = _DIM.findall(match.group(2))
    if any("?" in d or ":" in d for d in dims):
        return None
    try:
        return Sharding(match.group(1), tuple(tuple(_NAME.findall(d)) for d in dims))
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class DotDims:
    """A dot_general's dimension numbers."""

    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    lhs_contract: tuple[int, ...]
    rhs_contract: tuple[int, ...]

    def free(self, rank: int, lhs: bool) -> list[int]:
        taken = (self.lhs_batch + self.lhs_contract) if lhs else (self.rhs_batch + self.rhs_contract)
        return [d for d in range(rank) if d not in taken]


@dataclass(frozen=True, slots=True)
class DotPlan:
    """GSPMD's choice for one dot: ``contract`` (the dot's own result sharded ``sharding``, then resharded to the
    propagated one) or ``reshard`` (operand ``operand`` resharded to ``sharding`` before the dot)."""

    kind: str
    sharding: Sharding
    operand: int = -1


def dot_plan(lhs: Sharding, rhs: Sharding, out: Sharding, dims: DotDims) -> DotPlan | None:
    """GSPMD's base case for a dot whose operands and result are sharded so (module docstring), or None where
    Shardy's own partitioning stands (it already agrees, or neither rule applies)."""
    lf, rf = dims.free(len(lhs.dims), True), dims.free(len(rhs.dims), False)
    nb = len(dims.lhs_batch)
    out_b, out_lf, out_rf = out.dims[:nb], out.dims[nb:nb + len(lf)], out.dims[nb + len(lf):]
    pairs = list(zip(dims.lhs_contract, dims.rhs_contract))
    if (any(lhs.dims[a] for a, _ in pairs) and all(lhs.dims[a] == rhs.dims[b] for a, b in pairs)
            and all(lhs.dims[a] == rhs.dims[b] for a, b in zip(dims.lhs_batch, dims.rhs_batch))):
        local = tuple(lhs.dims[b] for b in dims.lhs_batch) + tuple(lhs.dims[d] for d in lf) + \
            tuple(rhs.dims[d] for d in rf)
        try:
            own = Sharding(out.mesh, local)
        except ValueError:
            return None
        return None if own == out else DotPlan("contract", own)
    sides = ((lhs, dims.lhs_batch, dims.lhs_contract, lf, out_lf, rhs, dims.rhs_batch, dims.rhs_contract, rf,
              out_rf, 1),
             (rhs, dims.rhs_batch, dims.rhs_contract, rf, out_rf, lhs, dims.lhs_batch, dims.lhs_contract, lf,
              out_lf, 0))
    for s, sb, sc, sf, out_sf, t, tb, tc, tf, out_tf, other in sides:
        if any(s.dims[d] for d in sc) or tuple(s.dims[b] for b in sb) != out_b or \
                tuple(s.dims[d] for d in sf) != out_sf:
            continue
        target = [()] * len(t.dims)
        for i, b in enumerate(tb):
            target[b] = out_b[i]
        for j, d in enumerate(tf):
            target[d] = out_tf[j]
        wanted = Sharding(t.mesh, tuple(target))
        return None if wanted == t else DotPlan("reshard", wanted, other)
    return None


def _value_sharding(value: Any) -> Sharding | None:
    """The propagated sharding of an op's result or of a function's or a while loop's block argument."""
    from jaxlib.mlir import ir

    if isinstance(value, ir.OpResult):
        op, index = value.owner, value.result_number
        attrs = op.attributes
        key = "sdy.sharding" if "sdy.sharding" in attrs else "sharding" if "sharding" in attrs else None
        if key is None:
            return None
        found = _ONE.findall(str(attrs[key]))
        return parse_sharding("<@{}, [{}]{}>".format(*found[index])) if index < len(found) else None
    owner = value.owner.owner  # the block's parent op
    name = owner.operation.name if owner is not None else ""
    if name == "func.func" and "arg_attrs" in owner.attributes:
        return parse_sharding(str(ir.ArrayAttr(owner.attributes["arg_attrs"])[value.arg_number]))
    if name == "stablehlo.while" and "sdy.sharding" in owner.attributes:
        found = _ONE.findall(str(owner.attributes["sdy.sharding"]))
        index = value.arg_number
        return parse_sharding("<@{}, [{}]{}>".format(*found[index])) if index < len(found) else None
    return None


def _dot_dims(op: Any) -> DotDims:
    from jaxlib.mlir.dialects import stablehlo

    numbers = stablehlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
    return DotDims(tuple(numbers.lhs_batching_dimensions), tuple(numbers.rhs_batching_dimensions),
                   tuple(numbers.lhs_contracting_dimensions), tuple(numbers.rhs_contracting_dimensions))


def _reshard(value: Any, sharding: Sharding, at: Any, location: Any) -> Any:
    """An ``sdy.reshard`` of ``value`` to ``sharding`` at insertion point ``at``."""
    from jaxlib.mlir import ir

    op = ir.Operation.create("sdy.reshard", results=[value.type], operands=[value],
                             attributes={"sharding": ir.Attribute.parse(sharding.text())}, loc=location, ip=at)
    return op.results[0]


def _apply(op: Any, plan: DotPlan, cache: dict) -> None:
    """Rewrite one dot as ``plan`` says: its operand resharded before it (one per value, target and block), or its
    result sharded as the local product is and resharded to the propagated sharding after it."""
    from jaxlib.mlir import ir

    if plan.kind == "reshard":
        value = op.operands[plan.operand]
        key = (value, plan.sharding, op.operation.block)
        if key not in cache:
            cache[key] = _reshard(value, plan.sharding, ir.InsertionPoint(op), op.location)
        op.operands[plan.operand] = cache[key]
        return
    result = op.results[0]
    propagated = _value_sharding(result)
    op.attributes["sdy.sharding"] = ir.Attribute.parse(
        f"#sdy.sharding_per_value<[{plan.sharding.text().removeprefix('#sdy.sharding')}]>")
    moved = _reshard(result, propagated, ir.InsertionPoint.after(op), op.location)
    result.replace_all_uses_except(moved, moved.owner.operation)


def _dots(op: Any) -> list:
    """The dot_generals under ``op`` in program order, outside shard_map bodies (local there)."""
    found = []
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                name = inner.operation.name
                if name == "stablehlo.dot_general":
                    found.append(inner)
                elif name != "sdy.manual_computation":
                    found.extend(_dots(inner))
    return found


def follow_gspmd(module: Any) -> int:
    """Impose GSPMD's choices on every dot of a propagated module where they differ from Shardy's (module
    docstring); the number of dots rewritten. Call inside the module's context."""
    cache: dict = {}
    changed = 0
    for func in module.body.operations:
        for op in _dots(func):
            shardings = [_value_sharding(v) for v in (op.operands[0], op.operands[1], op.results[0])]
            if None in shardings or len({s.mesh for s in shardings}) > 1:
                continue
            plan = dot_plan(*shardings, _dot_dims(op))
            if plan is not None:
                _apply(op, plan, cache)
                changed += 1
    return changed


def _axes(text: str) -> list[str]:
    return _NAME.findall(text)


def _collective(kind: str, value: Any, attributes: dict, at: Any, location: Any) -> Any:
    from jaxlib.mlir import ir

    op = ir.Operation.create(kind, results=[value.type], operands=[value],
                             attributes={k: ir.Attribute.parse(v) for k, v in attributes.items()},
                             loc=location, ip=at)
    return op.results[0]


def split_reductions(module: Any) -> int:
    """XLA's AllReduceSplitter on a partitioned module (module docstring): each ``sdy.all_reduce`` over A whose one
    use is an ``sdy.all_slice`` over S, S a proper subset of A, becomes an all-reduce over S, the slice, and an
    all-reduce over A minus S; the number split. Call inside the module's context."""
    from jaxlib.mlir import ir

    split = 0
    for func in module.body.operations:
        for op in _ops(func, "sdy.all_reduce"):
            uses = list(op.results[0].uses)
            if len(uses) != 1 or uses[0].owner.operation.name != "sdy.all_slice":
                continue
            sliced = uses[0].owner
            reduced, over = _axes(str(op.attributes["reduction_axes"])), set(_axes(str(sliced.attributes["slicing_axes"])))
            if not over or not over < set(reduced):
                continue
            first = _collective("sdy.all_reduce", op.operands[0], {
                "reduction_axes": "#sdy<axis_ref_list{" + ", ".join(f'"{a}"' for a in reduced if a in over) + "}>",
                "out_sharding": str(op.attributes["out_sharding"])}, ir.InsertionPoint(op), op.location)
            sliced.operands[0] = first
            rest = _collective("sdy.all_reduce", sliced.results[0], {
                "reduction_axes": "#sdy<axis_ref_list{" + ", ".join(f'"{a}"' for a in reduced if a not in over) + "}>",
                "out_sharding": str(sliced.attributes["out_sharding"])}, ir.InsertionPoint.after(sliced),
                sliced.location)
            sliced.results[0].replace_all_uses_except(rest, rest.owner.operation)
            op.operation.erase()
            split += 1
    return split


def _ops(op: Any, name: str) -> list:
    found = []
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                if inner.operation.name == name:
                    found.append(inner)
                found.extend(_ops(inner, name))
    return found
