"""The task graph's fsdp blocks played span by span (testbed.sim.block_spans), a mixin of testbed.sim.program.

Where an action gathers its sharded parameters block by block and the blocks are the runner's own pieces (the
embedding, each layer, the head), the runner's program runs each span's blocking tensor collectives (Megatron's
all-reduces; under sequence parallelism its all-gathers and reduce-scatters) right after that span, before the
next span computes, not all after the action's compute. Measured against the traced program
(``simulate_workload(trace_plan(plan), topology)``, fsdp x tensor on tpu-v5e-16x16), three more rules of XLA's
schedule of that program (its latency-hiding scheduler, testbed.sim.overlap) hold, and the graph plays them:

- A block's weight gradients (what it computes beyond its spans' input gradients, which no tensor collective
  waits for) are computed just before the gradient reduce-scatter that reads them: after the block's last
  collectives where the block releases a bucket, else in the first later block that does. Under sequence
  parallelism the program runs them among the spans, beside each span's all-gather and reduce-scatter: there
  they are spread over the spans in proportion to the spans' input-gradient FLOPs. The first layer's go with
  the embedding's block, after its table's reduce-scatter has left (that merge reads only the scatter-add).
- A block is done, for the gathers that wait for it to free its weights (the prefetch rule), once its last
  span's collectives are: the next gathers do not contend with them on the links.
- The forward's embedding lookup, and its vocab-parallel sum, read only the table, the block's first gather.

On GPU topologies, and without a tensor axis, actions have no spans (testbed.model.spans): nothing changes.
The analytic tier (testbed.explore.play) keeps the action's order.
"""

from __future__ import annotations

from testbed.model.gemm import scaled
from testbed.sim.block_spans import block_spans
from testbed.sim.facts import ActionWork, ChunkFacts
from testbed.sim.tasks import TaskKind

__all__ = ["SpanPlay"]


class SpanPlay:
    """Methods of testbed.sim.program's task graph that play an fsdp action's blocks span by span (module
    docstring); they read its builder ``b``, ``plan``, ``facts``, ``reps`` and its ``_tensor_chain``/``_bucket``."""

    def _block_spans(self, chunk: ChunkFacts, work: ActionWork, pieces: int) -> tuple:
        """testbed.sim.block_spans' spans of each of an action's ``pieces`` blocks (empty: the action's tensor
        collectives follow its compute)."""
        if work.overlap is not None or not work.spans or pieces != chunk.blocks or \
                not chunk.block_shares(work.kind, pieces):
            return ()
        return block_spans(chunk.cost, work.kind, work.spans, work.tensor,
                           chunk.cost.has_head and self.facts.gathers("B"), pieces)

    def _span_block(self, s: int, chunk: ChunkFacts, work: ActionWork, label: str, k: int, pieces: int,
                    spans: tuple, matmuls: tuple, deps: list[int], lookup: list[int] | None, reduce: bool
                    ) -> tuple[int, list[int], list[int], int]:
        """Block ``k`` of ``pieces`` (its ``spans``; ``matmuls``: :meth:`_spans`' work), then, where it releases a
        gradient bucket, the weight gradients held so far (``self.held``) and the buckets. Returns the block's
        last compute task, what the next block waits for, the compute tasks, and when the block is done."""
        name, cost = f"{label}/{k}", chunk.cost
        last, deps, tasks, rest = self._spans(s, chunk, name, spans, matmuls, deps, lookup)
        done = deps[-1]
        self.held.append((name, rest, k))
        buckets = chunk.bucket(pieces, k) if reduce else []
        first_layer = work.kind == "B" and cost.has_embedding and k == pieces - 2
        if reduce and (not buckets or first_layer) and k < pieces - 1:
            return last, deps, tasks, done  # its weight gradients wait for the bucket that reads them
        after = last if k < pieces - 1 else deps[-1]
        # The embedding's first merge (its table's gradient) reads only its scatter-add.
        first = int(reduce and work.kind == "B" and k == pieces - 1 and cost.has_embedding
                    and any(r for _, r, _ in self.held[:-1]))
        self._span_buckets(s, chunk, label, after, k, buckets[:first])
        for name_i, rest_i, _ in self.held:
            if rest_i:
                last = self._span(s, chunk, f"{name_i} weights", *rest_i, matmuls, 0.0, deps)
                tasks.append(last)
                deps, after = [last], last
        for _, _, k_i in self.held[:-1]:
            self._span_buckets(s, chunk, label, after, k_i, chunk.bucket(pieces, k_i) if reduce else [])
        self._span_buckets(s, chunk, label, after, k, buckets[first:])
        self.held = []
        return last, deps, tasks, done

    def _span_buckets(self, s: int, chunk: ChunkFacts, label: str, after: int, k: int, buckets) -> None:
        """Block ``k``'s gradient ``buckets`` (ChunkFacts.bucket), reduced after ``after``."""
        for fraction, count in buckets:
            self._bucket(s, after, (chunk.reduced[1] * fraction, chunk.special(fraction, self.facts.reduce_bytes),
                                    f"{label}/{k}", count, (0.0, 0.0)))

    def _spans(self, s: int, chunk: ChunkFacts, name: str, spans: tuple, matmuls: tuple, deps: list[int],
               lookup: list[int] | None) -> tuple[int, list[int], list[int], tuple | None]:
        """One block's spans on the compute stream, each a roofline of its share of the action's ``matmuls``
        (the action's FLOPs, the block's share of them, its GEMMs, kernels, bytes: :meth:`_span`) and its bytes,
        its tensor collectives after it before the next span (the first after ``lookup`` where given, module
        docstring). Returns the last compute task, what the next span waits for, the compute tasks, and the
        block's weight gradients (FLOPs, GEMMs) not played yet (None: none; under sequence parallelism they are
        spread over the spans)."""
        flops, part, gemms = matmuls[:3]
        block, done, tasks = flops * part, 0.0, []
        dx = sum(min(block, flops * share) for share, _, _ in spans)
        total = sum(nbytes for _, nbytes, _ in spans) or 1.0
        spread = block - dx if self.plan.sequence_parallel and dx > 0 and block - dx > 1e-6 * block else 0.0
        for j, (share, nbytes, transfers) in enumerate(spans):
            f = min(block - done, flops * share)
            done += f
            first = lookup is not None and j == 0
            tasks.append(self._span(s, chunk, f"{name}.{j}", f, scaled(gemms, f / block) if block else gemms,
                                    matmuls, nbytes, lookup if first else deps, nbytes / total))
            waiting = [x for x in deps if x not in lookup] if first else []
            deps = [self._tensor_chain(s, f"tp {name}.{j}", transfers, (tasks[-1],))] if transfers else [tasks[-1]]
            deps += waiting
            if spread and f:  # this span's share of the weight gradients, beside its collectives
                w = spread * f / dx
                done += w
                tasks.append(self._span(s, chunk, f"{name}.{j} weights", w, scaled(gemms, w / block), matmuls, 0.0,
                                        [tasks[-1]]))
                deps = [tasks[-1], *deps] if transfers else [tasks[-1]]
        rest = (block - done, scaled(gemms, 1 - done / block)) if block - done > 1e-6 * block else None
        return tasks[-1], deps, tasks, rest

    def _span(self, s: int, chunk: ChunkFacts, name: str, flops: float, gemms, matmuls: tuple, nbytes: float,
              deps: list[int], passes: float = 0.0) -> int:
        """One span of ``flops`` on the compute stream (:meth:`_spans`): a roofline of its matmuls and its
        ``nbytes`` (testbed.sim.compute's spans), its FLOPs' share of the block's kernels, and ``passes`` (its
        share of the block's bytes) of the activations' bytes an elementwise calibration prices instead
        (``matmuls``: the action's FLOPs, the block's share, GEMMs, kernels, replicated and split bytes)."""
        whole, part, _, kernels, replicated, split = matmuls
        return self.b.add(name=name, device=self.reps[s], stream="compute", kind=TaskKind.COMPUTE, deps=tuple(deps),
                          flops=flops, hbm_bytes=nbytes, replicated_bytes=replicated * part * passes,
                          split_bytes=split * part * passes, tensor_bytes=chunk.cost.tensor_bytes,
                          kernels=max(1, round(kernels * flops / (whole * part))) if whole * part else max(1, kernels),
                          pipeline=True, gemms=gemms, spans=((1.0, nbytes),))
