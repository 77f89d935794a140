"""Walk a compiled module's blocks in program order and emit one device's ops with their dependencies.

Loops from ``lax.scan`` / ``fori_loop`` are unrolled (each iteration's ops depend on the previous one's
through the carried values, so a collective of layer ``i`` can overlap the compute of layer ``i + 1``)
while the unrolled program stays under :data:`UNROLL_NODES` op visits; a larger loop's body is walked
once with every op repeated ``trips`` times back to back (its collectives then overlap only within one
iteration). Calls are inlined; of a conditional's branches the costliest (FLOPs, then bytes) is taken.
Which ops move HBM bytes follows testbed.runner.program.compile's fusion approximation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from testbed.runner.program.compile import Block, Compiled, Node
from testbed.sim.xla.workload import OpKind, TracedOp

__all__ = ["emit", "UNROLL_NODES"]

#: Most op visits loops are unrolled into (a 4096-device GPT's scan over microbatches stays well under it).
UNROLL_NODES = 60_000
#: Nodes whose operands live in HBM (the fusion approximation's consumers that end a fusion).
_SINKS = frozenset({"gemm", "collective", "while", "call", "case", "region"})


@dataclass(frozen=True, slots=True)
class _Val:
    """What a consumer of a value needs: the ops it depends on, whether it lives in HBM, its bytes there,
    (a value inside a fusion) the HBM values its fusion has read already (read once per fusion), and
    and, for an output of an elementwise fusion written to HBM because a matmul, a collective or the return
    needs it, the matmuls and collectives emitted before it (``region``; -1 otherwise): elementwise
    consumers before the next matmul or collective fuse with its fusion and read it from registers."""

    deps: frozenset
    materialized: bool
    read: int
    fused: frozenset = frozenset()
    region: int = -1
    #: Computed from constants and index generators alone (a causal mask's iota, compare and select): XLA
    #: fuses such a chain into each of its consumers, recomputing it in registers, so it is never in HBM.
    constant: bool = False
    #: The collectives (op indices) whose result this value is as a checkpoint's recomputation reads it: the same
    #: collective of the same values behind an optimization barrier, which the CSE merged (``TracedOp.again``).
    again: frozenset = frozenset()
    #: Out of an optimization barrier: the ops the barrier waits for (its operands' producers), and so a
    #: recomputation behind it (``TracedOp.barrier``).
    wall: frozenset = frozenset()


_EMPTY = _Val(frozenset(), False, 0)
_CONSTANT = _Val(frozenset(), False, 0, constant=True)


def _block_cost(block: Block) -> tuple[float, float]:
    return (sum(n.flops for n in block.nodes), sum(sum(n.writes) for n in block.nodes))


class _Emitter:
    def __init__(self, compiled: Compiled) -> None:
        self.functions = compiled.functions
        self.ops: list[TracedOp] = []
        self.count = 1
        self.visits = 0
        self.env: dict = {}
        self.sunk: dict[int, frozenset] = {}
        self.notes: list[str] = []
        self.barriers = 0  # matmuls and collectives emitted: a multi-output fusion does not reach past one
        self.computed: dict = {}  # (scope, collective, result bytes, operand identities) -> (operands, results)
        self.scope = self.scopes = 0  # one per loop iteration walked: XLA runs a while body's collectives each time
        self.loops: list[tuple[int, ...]] = []  # each unrolled loop's iterations (their scopes), in order
        self.returned = _returned(compiled.entry)  # values the step returns: written to HBM even if constant
        self.behind: dict[int, tuple] = {}  # id of a value out of an optimization barrier -> (it, the value in)

    def sinks(self, block: Block) -> frozenset:
        """Values of ``block`` that a HBM-reading consumer (or the terminator) reads, through passthroughs."""
        key = id(block)
        if key not in self.sunk:
            out = set(block.yields)
            for node in reversed(block.nodes):
                if node.kind in _SINKS or node.name == "stablehlo.custom_call":
                    out.update(node.operands)
                elif node.kind == "passthrough" and any(r in out for r in node.results):
                    out.update(node.operands)
            self.sunk[key] = frozenset(out)
        return self.sunk[key]

    def add(self, op: TracedOp, values: list | None = None) -> frozenset:
        """Emit ``op``; its ``again``: the recomputed collectives ``values`` (its operands) read that it depends on, and
        ``barrier``: what their optimization barrier waits for."""
        again = frozenset().union(*(v.again for v in values or ())) & set(op.deps)
        if again:
            wall = frozenset().union(*(v.wall for v in values if v.again & again))
            op = replace(op, again=tuple(sorted(again)), barrier=tuple(sorted(wall)))
        self.barriers += op.kind is not OpKind.MEMORY
        self.ops.append(op)
        return frozenset((len(self.ops) - 1,))

    def deps(self, values: list) -> frozenset:
        out: frozenset = frozenset()
        for v in values:
            out = out | self.env.get(v, _EMPTY).deps
        return out

    def run(self, block: Block, args: list[_Val]) -> list[_Val]:
        for a, v in zip(block.args, args):
            self.env[a] = v
        sunk = self.sinks(block)
        for node in block.nodes:
            self.visits += 1
            self.node(node, sunk)
        return [self.env.get(v, _EMPTY) for v in block.yields]

    def node(self, node: Node, sunk: frozenset) -> None:
        env, kind = self.env, node.kind
        if kind == "free":
            for r in node.results:
                env[r] = _CONSTANT
        elif kind == "passthrough":
            sources = node.operands if len(node.operands) == len(node.results) else \
                node.operands[:1] * len(node.results)
            wall = self.deps(node.operands) if node.name == "stablehlo.optimization_barrier" else None
            for r, o in zip(node.results, sources):
                env[r] = env.get(o, _EMPTY) if wall is None else self.barrier(env.get(o, _EMPTY), wall)
        elif kind == "gemm":
            ids = self.add(TracedOp(name=node.name.split(".")[-1], kind=OpKind.GEMM, deps=tuple(sorted(
                self.deps(node.operands))), flops=node.flops, gemms=(node.gemm,), count=self.count,
                iteration=self.scope), [env.get(o, _EMPTY) for o in node.operands])
            for r, w in zip(node.results, node.writes):
                env[r] = _Val(ids, True, w)
        elif kind == "collective":
            self.collective(node)
        elif kind == "memory" and node.attributes:
            self.once(node, sunk)
        elif kind == "memory":
            self.memory(node, sunk)
        else:
            self.structure(node)

    def collective(self, node: Node) -> None:
        """A collective, or nothing when the same collective of the same values ran before: XLA's common
        subexpression elimination keeps one (a checkpoint's backward gathering its saved input again, as
        Megatron's sequence parallelism does for the weight gradient, reuses the forward's gather; the
        compiled step has none: tests/test_check_sharding.py).

        Same means identical to XLA's CSE (HloInstruction::Identical), channel id and reduction included (a ``psum``
        and a ``pmax`` of one value are two all-reduces): the program's own
        collectives (a shard_map's: JAX lowers them all with channel handle 1) merge with each other; one
        the partitioner inserts (a reshard, e.g. where a value enters a map's body in another sharding) gets
        a channel of its own from XLA's SPMD partitioner, so it never merges with the program's gather of the
        same value (XLA:CPU's compiled fsdp x tensor SP step keeps both: tests/test_program_trace.py); two of the
        partitioner's reshards of one value alike are one (its per-value reshard cache,
        ``PartitionedHlo::Reshard``: an FSDP step's input gradient all-to-all'd once for its two users)."""
        vals = [self.env.get(o, _EMPTY) for o in node.operands]
        key = (self.scope, node.collective, node.reducer, node.channel, tuple(node.writes), self.identities(vals))
        if vals and not any(v == _EMPTY or v.constant for v in vals) and key in self.computed:
            earlier, out = self.computed[key]
            recomputed = any(a is not b for a, b in zip(vals, earlier))  # one side behind a checkpoint's barrier
            for r, v in zip(node.results, out):
                self.env[r] = replace(v, again=v.deps, wall=frozenset().union(*(x.wall for x in vals))) \
                    if recomputed else v
            return
        op, axes, group, nbytes, element, vector, sequence = node.collective
        ids = self.add(TracedOp(name=f"{op} {'+'.join(axes) or '-'}", kind=OpKind.COLLECTIVE,
                                deps=tuple(sorted(self.deps(node.operands))), collective=op, axes=tuple(axes),
                                group=group, nbytes=float(nbytes), element=element, count=self.count,
                                iteration=self.scope, vector=vector, sequence=sequence), vals)
        out = [_Val(ids, True, w) for w in node.writes]
        for r, v in zip(node.results, out):
            self.env[r] = v
        if key is not None:
            self.computed[key] = (vals, out)  # the operands kept alive: their ids stay theirs

    def barrier(self, value: _Val, wall: frozenset) -> _Val:
        """``value`` out of an optimization barrier that waits for ``wall`` (JAX's checkpoint puts one before a
        recomputation): a value of its own, the same to the CSE (:meth:`identities`), whose collectives
        :meth:`collective` marks as recomputed."""
        if value == _EMPTY or value.constant:
            return value
        inner = self.behind.get(id(value), (value, value))[1]
        out = replace(inner, wall=wall)
        self.behind[id(out)] = (out, inner)
        return out

    def identities(self, values: list) -> tuple[int, ...]:
        """What XLA:CPU's CSE tells ``values`` apart by: each one's identity, through optimization barriers."""
        return tuple(id(self.behind.get(id(v), (v, v))[1]) for v in values)

    def once(self, node: Node, sunk: frozenset) -> None:
        """A static slice, or nothing when the same slice of the same values ran before in this scope (XLA's CSE)."""
        vals = [self.env.get(o, _EMPTY) for o in node.operands]
        key = (self.scope, node.name, node.attributes, self.identities(vals))
        if key in self.computed:
            for r, v in zip(node.results, self.computed[key][1]):
                self.env[r] = v
            return
        self.memory(node, sunk)
        self.computed[key] = (vals, [self.env.get(r, _EMPTY) for r in node.results])

    def memory(self, node: Node, sunk: frozenset) -> None:
        """An elementwise or data-movement op: the materialized values its fusion has not read yet, plus the
        results it must write. A fusion's output that an HBM reader also needs is written once and stays
        fusible for elementwise consumers up to the next matmul or collective (XLA's multi-output fusion,
        which may not make a cycle through one: Adam's new moments are written and
        read by the parameter update in one kernel)."""
        env = self.env
        reads = 0
        vals = [env.get(o, _EMPTY) for o in node.operands]
        if vals and all(v.constant for v in vals) and not any(node.roots) and self.returned.isdisjoint(node.results):
            for r in node.results:  # a chain of constants: fused into each consumer (``_Val.constant``)
                env[r] = _CONSTANT
            return
        near = [v.region == self.barriers for v in vals]
        fused = frozenset().union(*(v.fused for v, n in zip(vals, near) if not v.materialized or n))
        for o, r, val, n in zip(node.operands, node.reads, vals, near):
            if val.materialized and not n and o not in fused:
                reads += val.read if r is None else r
                fused = fused | {o}
        kept = [root or r in sunk for r, root in zip(node.results, node.roots)]
        writes = sum(w for w, k in zip(node.writes, kept) if k)
        deps = self.deps(node.operands)
        if reads + writes > 0:
            deps = self.add(TracedOp(name=node.name.split(".")[-1], kind=OpKind.MEMORY, deps=tuple(sorted(deps)),
                                     hbm_bytes=float(reads + writes), count=self.count,
                                     iteration=self.scope), vals)
            again = wall = frozenset()
        else:  # fused into its readers: they read what it reads
            again = frozenset().union(*(v.again for v in vals))
            wall = frozenset().union(*(v.wall for v in vals if v.again))
        for r, w, k, root in zip(node.results, node.writes, kept, node.roots):
            env[r] = _Val(deps, k, w if k else 0, fused if not root else frozenset(),
                          self.barriers if k and not root else -1, again=again, wall=wall)

    def structure(self, node: Node) -> None:
        """Loops, conditionals, shard_map bodies and calls: their blocks run with the node's operands."""
        args = [self.env.get(o, _EMPTY) for o in node.operands]
        if node.kind == "while":
            body = node.blocks[0]
            outer = self.scope
            if self.visits + node.trips * body.size <= UNROLL_NODES:
                iterations = []
                for _ in range(node.trips):
                    self.scope = self.scopes = self.scopes + 1
                    iterations.append(self.scope)
                    args = self.run(body, args)
                self.loops.append(tuple(iterations))
            else:
                self.notes.append(f"a loop of {node.trips} iterations priced as its body repeated back to back "
                                  f"(unrolled it would exceed {UNROLL_NODES} ops)")
                saved, self.count = self.count, self.count * node.trips
                self.scope = self.scopes = self.scopes + 1
                args = self.run(body, args)
                self.count = saved
            self.scope = outer
            out = [_Val(a.deps, True, a.read) for a in args]
        elif node.kind == "case":
            out = self.run(max(node.blocks, key=_block_cost), [])  # branches capture, they take no arguments
        elif node.kind == "call":
            out = self.run(self.functions[node.callee], args)
        else:  # shard_map body (sdy.manual_computation) or a named computation
            out = self.run(node.blocks[0], args)
        for r, v in zip(node.results, out):
            self.env[r] = v


def _returned(block: Block) -> frozenset:
    """The values ``block`` yields, and through passthroughs (reshapes, broadcasts) the values they are made of."""
    out = set(block.yields)
    for node in reversed(block.nodes):
        if node.kind == "passthrough" and any(r in out for r in node.results):
            out.update(node.operands)
    return frozenset(out)


def emit(compiled: Compiled) -> tuple[list[TracedOp], list[str], tuple[tuple[int, ...], ...]]:
    """One device's ops in program order (loops unrolled or counted), notes on what was approximated, and each
    unrolled loop's iterations in order (``Workload.loops``)."""
    emitter = _Emitter(compiled)
    emitter.run(compiled.entry, [_Val(frozenset(), True, b) for b in compiled.arg_bytes])
    return emitter.ops, sorted(set(emitter.notes)), tuple(emitter.loops)
