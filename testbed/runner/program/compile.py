"""Read a Shardy-partitioned module into blocks of nodes: one device's shapes, costs and structure per op.

testbed.runner.reshards partitions a program lowered on an abstract mesh: after Shardy's propagation
every op carries the sharding of its results and every place where shardings disagree holds an
explicit collective. The shapes are still global; one device's block of a value is its global shape
divided, dim by dim, by the mesh axes its sharding names (block arguments: the function's argument
shardings, a loop's carried shardings; a ``shard_map`` body's values are already local). This module
reads each op once into a :class:`Node` (what it costs on one device, what it reads and writes), so
that :mod:`testbed.runner.program.evaluate` can unroll loops over plain Python data.

Memory-bound ops and fusion (the approximation, documented in docs/program.md): XLA fuses chains of
elementwise ops into one kernel that reads its inputs from HBM once and writes its outputs once. A value
is *materialized* (lives in HBM) when a matmul, convolution, collective, reduction, loop, call, custom
call or data-movement op produces it, when such an op or the program's return consumes it, or when it
is an argument. A memory-bound op costs the bytes of the materialized values it reads plus the bytes of
its results that are materialized; values between fused elementwise ops cost nothing, and so does an
elementwise result that is materialized only because an HBM reader needs it, for its elementwise consumers
(multi-output fusion: testbed.runner.program.evaluate). Reshapes,
broadcasts, transposes and constants move no bytes (XLA folds them into their consumers); their
consumers read the bytes of the source. An elementwise op of constants and index generators alone (a causal
mask's iota, compare and select) is never materialized unless the step returns it: XLA fuses it into each
consumer (testbed.runner.program.evaluate). Slices and gathers read what they produce, an update-slice or
scatter reads and writes its update.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from testbed.errors import InputError
from testbed.model.gemm import Gemm

__all__ = ["Node", "Block", "compile_module", "HOST_CALLBACKS", "FREE_CUSTOM_CALLS"]

#: Ops that move no bytes of their own: their result reads as their first operand does.
PASSTHROUGH = frozenset({
    "stablehlo.reshape", "stablehlo.broadcast_in_dim", "stablehlo.transpose", "stablehlo.bitcast_convert",
    "stablehlo.optimization_barrier", "sdy.sharding_constraint", "sdy.reshard", "stablehlo.get_tuple_element",
    "stablehlo.tuple", "sdy.propagation_barrier",
})
#: Ops that are free and read nothing (constants, index generators).
CONSTANTS = frozenset({"stablehlo.constant", "sdy.constant", "stablehlo.iota", "stablehlo.partition_id",
                       "stablehlo.replica_id", "stablehlo.create_token", "stablehlo.after_all"})
#: Ops that end a fusion: their results are materialized.
ROOTS = frozenset({"stablehlo.reduce", "stablehlo.reduce_window", "stablehlo.sort", "stablehlo.scatter",
                   "stablehlo.select_and_scatter", "stablehlo.gather", "stablehlo.dynamic_slice",
                   "stablehlo.dynamic_update_slice", "stablehlo.rng_bit_generator", "stablehlo.fft",
                   "stablehlo.cholesky", "stablehlo.triangular_solve"})
#: Shardy's slice of a replicated value into this device's shard (no communication; the partitioner's
#: reshard of a broadcast, e.g. a ``vmap`` over the spread data replicas): its result's sharding is its
#: ``out_sharding`` attribute.
LOCAL_SLICES = frozenset({"sdy.all_slice"})
#: Ops that read only as many bytes as they write (a slice of a materialized operand).
SLICES = frozenset({"stablehlo.slice", "stablehlo.dynamic_slice", "stablehlo.gather"}) | LOCAL_SLICES
#: Slices XLA's CSE (HloCSE) merges when they read the same value alike: an unrolled loop's ``weights[0, layer]``
#: sliced again at every tick is one slice (the pipeline program's compiled HLO on 8 emulated devices).
CSE_OPS = frozenset({"stablehlo.slice"})
#: Ops that read and write only their update operand (in place).
UPDATES = {"stablehlo.dynamic_update_slice": 1, "stablehlo.scatter": 2}
#: Custom calls that are annotations, not work.
FREE_CUSTOM_CALLS = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "annotate_device_placement",
                               "X64Combine", "X64SplitLow", "X64SplitHigh", "MoveToHost", "MoveToDevice",
                               "mhlo.sharding", "LayoutConstraint"})
#: Custom call targets of host callbacks (jax.pure_callback, io_callback, jax.debug.callback/print).
HOST_CALLBACKS = ("xla_python_cpu_callback", "xla_python_gpu_callback", "xla_ffi_python_cpu_callback",
                  "xla_ffi_python_gpu_callback", "xla_ffi_partitioned_python_cpu_callback",
                  "xla_ffi_partitioned_python_gpu_callback")
_COLLECTIVE_NAMES = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
                     "all-to-all": "all_to_all", "collective-permute": "collective_permute"}
_DTYPES = {"f32": "fp32", "bf16": "bf16", "f16": "fp16", "f64": "fp32"}
_VALUE_SHARDING = re.compile(r"<@[\w.$-]+, \[[^\[\]]*\]")
_INTS = re.compile(r"(\w+) = \[([\d, ]*)\]")
_CHANNEL = re.compile(r"handle = (\d+)")


@dataclass(slots=True)
class Node:
    """One op, read once: ``kind`` is free, passthrough, gemm, memory, collective, while, call, case, region
    or return. ``reads`` per operand: the bytes reading it costs when it is materialized (None: the
    operand's own bytes); ``writes``: bytes of each result; ``roots``: which results are materialized."""

    kind: str
    name: str
    operands: list
    results: list
    reads: list = field(default_factory=list)
    writes: list = field(default_factory=list)
    roots: list = field(default_factory=list)
    flops: float = 0.0
    gemm: Gemm | None = None
    collective: tuple = ()
    #: A collective's channel id as XLA will see it: the program's own (``channel_handle``; 0 without one),
    #: None for one the partitioner inserts (a reshard: XLA's partitioner gives each a new channel).
    channel: int | None = None
    #: A reduction's combining ops (``stablehlo.add``; ``stablehlo.maximum`` for a ``pmax``): part of what makes
    #: two collectives identical to XLA's CSE (its ``to_apply``).
    reducer: tuple = ()
    blocks: list = field(default_factory=list)
    trips: int = 1
    callee: str = ""
    #: A static slice's attributes (:data:`CSE_OPS`): with its operands, what makes two of them one to XLA's CSE.
    attributes: str = ""
    #: Each result's element type as the module writes it (``f32``, ``bf16``, ``i1``; "" for a token or tuple): what
    #: a device's storage rules read (testbed.runner.program.memory).
    types: list = field(default_factory=list)
    #: A matmul's or convolution's ``precision_config`` (``default`` unless the program asks for ``high`` or
    #: ``highest``): what a device that rounds fp32 matmuls at the default precision reads (``fp32_matmuls``).
    precision: str = "default"


@dataclass(slots=True)
class Block:
    """A region's block: its arguments, nodes in order, and the operands of its terminator."""

    args: list
    nodes: list
    yields: list
    size: int = 0


@dataclass(slots=True)
class Compiled:
    """The module read into blocks: the entry function, the private functions by name, what was found."""

    entry: Block
    functions: dict
    arg_bytes: list
    dtypes: dict
    assumptions: list


def _divisors(sharding: str, sizes: dict[str, int], manual: frozenset = frozenset()) -> list[int]:
    """Per dim, the devices a dim is split over (axes in ``manual`` left out: a shard_map body is local there)."""
    from testbed.runner.reshards import _dims

    return [math.prod(size for name, size in dim if name not in manual) for dim in _dims(sharding, sizes)]


def _local(value: Any, divisors: list[int] | None) -> tuple[tuple[int, ...], int]:
    """(one device's shape, element bytes) of a value; (), 0 for a token or tuple."""
    from jaxlib.mlir import ir
    from testbed.runner.reshards import _dtype_bytes

    try:
        t = ir.RankedTensorType(value.type)
    except (ValueError, TypeError):
        return (), 0
    shape = tuple(int(d) for d in t.shape)
    if divisors and len(divisors) == len(shape):
        shape = tuple(-(-d // max(1, k)) for d, k in zip(shape, divisors))
    return shape, _dtype_bytes(str(t.element_type))


class _Reader:
    """Reads ops into nodes, keeping each value's local shape (from the shardings) as it goes."""

    def __init__(self, sizes: dict[str, int], on_unknown: str) -> None:
        self.sizes = sizes
        self.order = list(sizes)
        self.on_unknown = on_unknown
        self.shape: dict = {}   # value -> (local shape, element bytes)
        self.dtypes: dict[str, float] = {}
        self.assumptions: list[str] = []
        self.unknown: list[str] = []
        self.moved_dots = 0  # dots Shardy partitioned by moving an activation (_moved_to_the_contraction)

    def nbytes(self, value: Any) -> int:
        shape, b = self.shape.get(value, ((), 0))
        return math.prod(shape) * b if b else 0

    def define(self, values: list, shardings: list[str] | None, manual: frozenset = frozenset()) -> None:
        for i, v in enumerate(values):
            div = (_divisors(shardings[i], self.sizes, manual) if shardings and i < len(shardings) and shardings[i]
                   else None)
            self.shape[v] = _local(v, div)

    def block(self, block: Any, shardings: list[str] | None = None, manual: frozenset = frozenset()) -> Block:
        args = list(block.arguments)
        self.define(args, shardings, manual)
        nodes, yields, size = [], [], 0
        for op in block.operations:
            name = op.operation.name
            if name in ("func.return", "stablehlo.return", "sdy.return"):
                yields = list(op.operands)
                continue
            node = self.node(op, name)
            node.types = [_element(r) for r in node.results]
            if node.kind in ("while", "case", "region", "call"):
                node.writes = [self.nbytes(r) for r in node.results]
            size += 1 + sum(b.size for b in node.blocks) * max(1, node.trips)
            nodes.append(node)
        return Block(args=args, nodes=nodes, yields=yields, size=size)

    def vector_shard(self, kind: str, operands: list, results: list) -> int:
        """Elements per device of the shard a collective of rank-1 buffers moves (an all-gather's operand, a
        reduce-scatter's result, one dim of which is wider than 1 on a device; 0: not rank-1, or another kind):
        what XLA:TPU lowers as all-reduces (testbed.sim.xla.xla_tpu.vector_gather_lowers)."""
        value = operands[0] if kind == "all-gather" else results[0] if kind == "reduce-scatter" else None
        shape = self.shape.get(value, ((), 0))[0] if value is not None else ()
        wide = [d for d in shape if d > 1]  # a tensor-split dim of one row a device leaves a rank-1 buffer
        return int(wide[0]) if len(wide) == 1 else 0

    def sequence_scatter(self, kind: str, operands: list, results: list) -> bool:
        """Whether a collective is a reduce-scatter of a rank-3+ buffer holding one row of its leading dim a device,
        scattered along its second (an activation of one sequence a device over its positions, as sequence
        parallelism's reduce-scatters are): what XLA:TPU all-reduces whole
        (testbed.sim.xla.xla_tpu.scatters_whole_sequence)."""
        if kind != "reduce-scatter":
            return False
        before, after = (self.shape.get(v, ((), 0))[0] for v in (operands[0], results[0]))
        split = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
        return len(before) >= 3 and len(before) == len(after) and before[0] == 1 and split == [1]

    def collective(self, op: Any, name: str, operands: list, results: list) -> Node:
        """A collective node: a reshard the partitioner inserts (``reshards.KINDS``) or a shard_map body's own
        (``reshards.MANUAL``): its kind, axes, group, bytes a device, element type, rank-1 shard and whether it
        scatters one sequence a device (XLA:TPU's rules), channel and reducer (XLA's CSE)."""
        from testbed.runner import reshards

        attrs = op.attributes
        read = reshards._collective if name in reshards.KINDS else reshards._manual
        kind, axes, group, nbytes, _, element = read(op, self.sizes, self.order)
        out = str(attrs["out_sharding"]) if "out_sharding" in attrs else None
        self.define(results, [out] * len(results) if out else self._shardings(op))
        if name in reshards.MANUAL:  # one device's block: also split over the body's free axes
            nbytes = self.nbytes(results[0] if kind == "all-gather" else operands[0])
        handle = _CHANNEL.search(str(attrs["channel_handle"])) if "channel_handle" in attrs else None
        channel = None if name in reshards.KINDS else int(handle.group(1)) if handle else 0
        reducer = tuple(inner.operation.name for region in op.regions for b in region.blocks
                        for inner in b.operations)
        vector = self.vector_shard(kind, operands, results)  # a rank-1 buffer's shard (XLA:TPU's rules)
        return Node(kind="collective", name=name, operands=operands, results=results,
                    collective=(_COLLECTIVE_NAMES[kind], axes, group, nbytes, element, vector,
                                self.sequence_scatter(kind, operands, results)),
                    writes=[self.nbytes(r) for r in results], channel=channel, reducer=reducer)

    def node(self, op: Any, name: str) -> Node:
        from testbed.runner import reshards

        operands, results = list(op.operands), list(op.results)
        attrs = op.attributes
        if name in reshards.KINDS or name in reshards.MANUAL:
            return self.collective(op, name, operands, results)
        if name in LOCAL_SLICES:  # its results are sharded as its out_sharding says (no sdy.sharding attribute)
            self.define(results, [str(attrs["out_sharding"])] * len(results))
        else:
            self.define(results, self._shardings(op))
        if name == "stablehlo.while":
            carried = self._shardings(op)
            body = self.block(op.regions[1].blocks[0], carried)
            trips = reshards._trip_count(op)
            if trips is None:
                self.assumptions.append("a while loop whose trip count is not a constant: its body priced once")
            return Node(kind="while", name=name, operands=operands, results=results, blocks=[body], trips=trips or 1)
        if name in ("stablehlo.case", "stablehlo.if"):
            branches = [self.block(r.blocks[0]) for r in op.regions]
            return Node(kind="case", name=name, operands=operands, results=results, blocks=branches)
        if name == "sdy.manual_computation" or name == "sdy.named_computation":
            # A shard_map body is local along its manual axes; its operands' free axes still split its values.
            manual = frozenset(re.findall(r'"([^"]+)"', str(op.attributes["manual_axes"]))
                               if "manual_axes" in op.attributes else ())
            if "out_shardings" in op.attributes:  # its results are global, sharded as it says
                self.define(results, _VALUE_SHARDING.findall(str(op.attributes["out_shardings"])))
            return Node(kind="region", name=name, operands=operands, results=results,
                        blocks=[self.block(op.regions[0].blocks[0], self._in_shardings(op), manual)])
        if name in ("func.call", "call"):
            from jaxlib.mlir import ir

            return Node(kind="call", name=name, operands=operands, results=results,
                        callee=ir.FlatSymbolRefAttr(attrs["callee"]).value)
        if name in CONSTANTS:
            return Node(kind="free", name=name, operands=[], results=results)
        if name in PASSTHROUGH:
            return Node(kind="passthrough", name=name, operands=operands, results=results)
        if name == "stablehlo.dot_general":
            return self.dot(op, operands, results)
        if name == "stablehlo.convolution":
            return self.convolution(op, operands, results)
        if name == "stablehlo.custom_call":
            return self.custom_call(op, operands, results)
        node = self.memory(name, operands, results)
        node.attributes = ";".join(f"{k}={attrs[k]}" for k in attrs) if name in CSE_OPS else ""
        return node

    def _shardings(self, op: Any) -> list[str] | None:
        if "sdy.sharding" not in op.attributes:
            return None
        return _VALUE_SHARDING.findall(str(op.attributes["sdy.sharding"]))

    def _in_shardings(self, op: Any) -> list[str] | None:
        if "in_shardings" not in op.attributes:
            return None
        return _VALUE_SHARDING.findall(str(op.attributes["in_shardings"]))

    def memory(self, name: str, operands: list, results: list) -> Node:
        writes = [self.nbytes(r) for r in results]
        reads: list = [None] * len(operands)
        if name in SLICES and operands:
            reads = [sum(writes)] + [None] * (len(operands) - 1)
        elif name in UPDATES and len(operands) > UPDATES[name]:
            k = UPDATES[name]
            update = self.nbytes(operands[k])
            reads = [0] * len(operands)
            reads[k] = update
            writes = [update] * len(results)
        roots = [name in ROOTS] * len(results)
        return Node(kind="memory", name=name, operands=operands, results=results, reads=reads, writes=writes,
                    roots=roots)

    def dot(self, op: Any, operands: list, results: list) -> Node:
        dims = dict(_INTS.findall(str(op.attributes["dot_dimension_numbers"])))
        ints = {k: [int(x) for x in v.split(",") if x.strip()] for k, v in dims.items()}
        lhs, _ = self.shape.get(operands[0], ((), 0))
        out, _ = self.shape.get(results[0], ((), 0))
        nb = len(ints.get("lhs_batching_dimensions", []))
        n_lhs_free = len(lhs) - nb - len(ints.get("lhs_contracting_dimensions", []))
        batch = math.prod(out[:nb])
        m = math.prod(out[nb:nb + n_lhs_free])
        n = math.prod(out[nb + n_lhs_free:])
        k = math.prod(lhs[d] for d in ints.get("lhs_contracting_dimensions", []))
        self._dtype(operands[0])
        self.moved_dots += _moved_to_the_contraction(operands, results)
        node = self._gemm("stablehlo.dot_general", operands, results, Gemm(m=max(1, m), n=max(1, n), k=max(1, k),
                                                                         batch=max(1, batch)))
        node.precision = _precision(op)
        return node

    def convolution(self, op: Any, operands: list, results: list) -> Node:
        """A convolution as its implicit GEMM: (batch x output positions) by output features, reducing over the
        kernel window and the input features of a group (feature groups as a batch of GEMMs); its left operand read
        as the input it is (``Gemm.stored_lhs``), not as the window matrix it stands for."""
        text = str(op.attributes["dimension_numbers"])
        lists = [[x.strip() for x in part.split(",")] for part in re.findall(r"\[([^\]]*)\]", text)]
        kernel_dims, out_dims = lists[1], lists[2]
        lhs, _ = self.shape.get(operands[0], ((), 0))
        kernel, _ = self.shape.get(operands[1], ((), 0))
        out, _ = self.shape.get(results[0], ((), 0))
        groups = 1
        for attr in ("feature_group_count", "batch_group_count"):
            if attr in op.attributes:
                groups = max(groups, int(re.search(r"(\d+)", str(op.attributes[attr])).group(1)))
        m = math.prod(out[i] for i, d in enumerate(out_dims) if d != "f")
        n = math.prod(out[i] for i, d in enumerate(out_dims) if d == "f")
        k = math.prod(kernel[i] for i, d in enumerate(kernel_dims) if d != "o")
        self._dtype(operands[0])
        stored = math.prod(lhs) // groups if lhs else 0  # the input an implicit GEMM reads (Gemm.stored_lhs)
        gemm = Gemm(m=max(1, m), n=max(1, n // groups), k=max(1, k), batch=groups,
                    stored_lhs=stored if 0 < stored < m * k else 0)
        node = self._gemm("stablehlo.convolution", operands, results, gemm)
        node.precision = _precision(op)
        return node

    def _gemm(self, name: str, operands: list, results: list, gemm: Gemm) -> Node:
        return Node(kind="gemm", name=name, operands=operands, results=results, flops=gemm.flops, gemm=gemm,
                    writes=[self.nbytes(r) for r in results], roots=[True] * len(results))

    def _dtype(self, value: Any) -> None:
        from jaxlib.mlir import ir

        element = str(ir.RankedTensorType(value.type).element_type)
        key = "fp8" if element.startswith("f8") else _DTYPES.get(element, "fp32")
        self.dtypes[key] = self.dtypes.get(key, 0) + 1

    def custom_call(self, op: Any, operands: list, results: list) -> Node:
        target = str(op.attributes["call_target_name"]).strip('"')
        if target in FREE_CUSTOM_CALLS:
            return Node(kind="passthrough" if operands else "free", name=target, operands=operands, results=results)
        what = f"host callback `{target}` (jax.pure_callback, io_callback or jax.debug)" \
            if target in HOST_CALLBACKS or "callback" in target else f"custom call `{target}`"
        if self.on_unknown == "refuse":
            self.unknown.append(what)
        else:
            self.assumptions.append(f"{what}: priced as a memory-bound op reading its operands and writing its "
                                    "results once (its own time is unknown)")
        node = self.memory("stablehlo.custom_call", operands, results)
        node.roots = [True] * len(results)
        return node


def _element(value: Any) -> str:
    """A value's element type as the module writes it (``f32``, ``bf16``, ``i1``); "" for a token or tuple."""
    from jaxlib.mlir import ir

    try:
        return str(ir.RankedTensorType(value.type).element_type)
    except (ValueError, TypeError):
        return ""


def _precision(op: Any) -> str:
    """A matmul's or convolution's precision: ``highest`` or ``high`` where its ``precision_config`` names one for
    an operand, else ``default`` (no config, or ``DEFAULT`` for each: jax's ``Precision.DEFAULT``)."""
    text = str(op.attributes["precision_config"]).upper() if "precision_config" in op.attributes else ""
    return "highest" if "HIGHEST" in text else "high" if "HIGH" in text else "default"


def _op_name(owner: Any) -> str:
    return str(getattr(getattr(owner, "operation", owner), "name", ""))


def _moved_to_the_contraction(operands: list, results: list) -> bool:
    """Whether Shardy partitioned a dot by moving an operand with an all-to-all onto the contracting dim and
    all-reducing the partial product: its resolution of a weight sharded on its contracting dim against an
    activation sharded on the same axis (FSDP in plain ``jit``). XLA's SPMD partitioner (GSPMD, which XLA's compile
    runs after Shardy's propagation: its pass dump, ``shardy-xla`` then ``spmd-partitioning``) gathers that weight
    whole instead, so the compiled collectives differ there (docs/program.md, "Where XLA partitions otherwise")."""
    moved = any(_op_name(v.owner) == "sdy.all_to_all" for v in operands)
    return moved and any(_op_name(use.owner) == "sdy.all_reduce" for r in results for use in r.uses)


#: The assumption a workload states when Shardy moved activations where XLA gathers weights (one per program).
MOVED_DOTS = ("{n} matmul{s} partitioned by Shardy's explicit reshards: an activation moved onto the contracting dim "
              "with an all-to-all and the partial products all-reduced, against a weight sharded on that dim (FSDP in "
              "plain jit); XLA's SPMD partitioner partitions such matmuls otherwise (it gathers the weight whole), so "
              "the compiled step's collectives differ. Gather the weights explicitly (jax.lax.with_sharding_constraint(w, P())) for a "
              "trace that follows XLA (docs/program.md, \"Where XLA partitions otherwise\")")


def compile_module(module: Any, context: Any, sizes: dict[str, int], on_unknown: str = "refuse") -> Compiled:
    """Read a partitioned module (testbed.runner.reshards.partition) into blocks.

    ``on_unknown``: ``"refuse"`` raises InputError naming every custom call or host callback the
    simulator cannot price; ``"assume"`` prices each as a memory-bound op and says so in the assumptions.
    """
    if on_unknown not in ("refuse", "assume"):
        raise ValueError(f"on_unknown must be 'refuse' or 'assume', got {on_unknown!r}")
    reader = _Reader(sizes, on_unknown)
    with context:
        funcs = {str(op.attributes["sym_name"]).strip('"'): op for op in module.body.operations
                 if op.operation.name == "func.func"}
        entry_name = "main" if "main" in funcs else next(iter(funcs))
        blocks = {}
        for name, func in funcs.items():
            attrs = func.attributes["arg_attrs"] if "arg_attrs" in func.attributes else None
            n_args = len(func.regions[0].blocks[0].arguments)
            shardings = [(_VALUE_SHARDING.findall(str(attrs[i])) or [""])[0] if attrs is not None else ""
                         for i in range(n_args)]
            blocks[name] = reader.block(func.regions[0].blocks[0], shardings)
        entry = blocks.pop(entry_name)
        arg_bytes = [reader.nbytes(a) for a in entry.args]
    if reader.moved_dots:
        reader.assumptions.append(MOVED_DOTS.format(n=reader.moved_dots, s="s" * (reader.moved_dots > 1)))
    if reader.unknown:
        found = sorted(set(reader.unknown))
        raise InputError(f"the program holds {', '.join(found)}, which the simulator cannot price: its time is "
                         "not in the program's text. Remove it from the traced step, or trace with "
                         "on_unknown='assume' (CLI: --unknown-ops assume) to price each as a memory-bound op.")
    return Compiled(entry=entry, functions=blocks, arg_bytes=arg_bytes, dtypes=dict(reader.dtypes),
                    assumptions=sorted(set(reader.assumptions)))
