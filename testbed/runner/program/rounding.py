"""fp32 matmul inputs stored in bf16, as a device that rounds them keeps them (``DeviceSpec.fp32_matmuls: bf16``).

XLA:TPU runs an fp32 matmul at the default precision on its operands rounded to bf16 and writes the rounded copy in
the producer's kernel: where only such matmuls read a value, the copy is what stays in HBM, half the bytes, not the
f32. Its compiles of the held-out fp32 programs (benchmarks/tpu_chip/programs.json's programs compiled deviceless
with libtpu 0.0.42.1, their memory-usage reports and live ranges) hold the tensor-parallel transformer's q, k and v
as ``bf16[16,512,1024]`` buffers, its GELU outputs as ``bf16[16,512,4096]`` and the CNN's ReLU outputs as
``bf16[256,8,8,256]``. testbed.runner.program.memory applies these rules on a fusing compiler
(``DeviceSpec.fuses_into_matmuls``): :func:`matmul_only` for a matmul's, collective's or reduction's result,
:class:`BF16Copies` for an elementwise result a matmul would otherwise compute in its own kernel.

Each function takes ``reads``: node -> (the values its operands read, the values its nested blocks read), each
taken through passthroughs to the value whose buffer it reads.
"""

from __future__ import annotations

__all__ = ["matmul_only", "BF16Copies"]

_NOT_READERS = ("passthrough", "free")


def _elementwise(node) -> bool:
    return node.kind == "memory" and not any(node.roots)


def matmul_only(nodes: list, reads, yields: set, elementwise: bool) -> set:
    """The f32 results of ``nodes`` (elementwise ones, or the others) that only default-precision matmuls read: a
    value any other op, a nested block or the block's end reads stays f32."""
    other = set(yields)
    matmul: set = set()
    for node in nodes:
        if node.kind in _NOT_READERS:
            continue
        operands, inner = reads(node)
        (matmul if node.kind == "gemm" and node.precision == "default" else other).update(operands)
        other.update(inner)
    return {r for node in nodes if _elementwise(node) == elementwise
            for r, t in zip(node.results, node.types or [""] * len(node.results))
            if t == "f32" and r in matmul and r not in other}


class BF16Copies:
    """The elementwise f32 values whose bf16 copy a rounding matmul reads: each only such matmuls read (see
    :func:`matmul_only`) that the matmul cannot compute again in its own kernel from values in HBM anyway, that is
    whose chain of elementwise producers reads something other than the block's arguments, constants and values an
    op reads directly at the matmul or later. XLA:TPU computes the rest in the matmul's kernel: the held-out
    MLP-Mixer's backward makes each GELU's bf16 input again from its f32 pre-activation, kept for the GELU's
    derivative (one ``bf16[256,64,2048]`` beside four f32 pre-activations at its peak); the CNN keeps its ReLU
    outputs' copies, their pre-activations read no more once the masks are made (``pred[256,16,16,128]``).
    ``last`` (the estimate's value -> index of its last reader) gets each copy's last reader, keyed
    ``("bf16", value)``; ``values``: the values with a copy."""

    def __init__(self, nodes: list, reads, args: list, yields: set, last: dict) -> None:
        self.reads, self.args, self.last = reads, set(args), last
        self.only = matmul_only(nodes, reads, yields, elementwise=True)
        self.direct: dict = {v: len(nodes) for v in yields}  # value -> index of the last op reading it directly
        self.maker: dict = {}
        self.values: set = set()
        for i, node in enumerate(nodes):
            self.maker.update((r, node) for r in node.results)
            if node.kind not in _NOT_READERS:
                operands, inner = reads(node)
                self.direct.update((v, i) for v in [*operands, *inner])

    def serves(self, v, i: int, matmul) -> bool:
        """Whether ``matmul``, the node at ``i``, reads ``v``'s bf16 copy (then recorded as its last reader so far):
        a default-precision matmul reading a value of :attr:`only` it cannot compute again (class docstring)."""
        if matmul.precision != "default" or v not in self.only or self._again(v, i, 0):
            return False
        self.values.add(v)
        self.last[("bf16", v)] = i
        return True

    def _again(self, v, i: int, depth: int) -> bool:
        node = self.maker.get(v)
        if node is None or not _elementwise(node) or depth > 64:
            return False
        return all(self._held(o, i, depth) for o in self.reads(node)[0])

    def _held(self, v, i: int, depth: int) -> bool:
        node = self.maker.get(v)
        if v in self.args or (node is not None and node.kind == "free") or self.direct.get(v, -1) >= i:
            return True
        return self._again(v, i, depth + 1)
