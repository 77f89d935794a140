"""Ring attention's tasks in the step's task graph (context parallelism; testbed.model.ring decides the ring).

An F or B action of a plan with ``mesh.context`` > 1 becomes, on the
representative's streams: the action's work but the ring's attention steps
(``compute``), then each :class:`~testbed.model.ring.RingPhase` as a compute
task for its steps' attention (the ``s_l x s_l`` block of step 0, or the
``s_l x s_l / 2`` halves of later steps, :func:`testbed.model.gemm.ring_step_gemms`)
beside a send task on the ``ring`` stream carrying the phase's messages to the
next rank of the representative's context ring. A phase's sends start when
the compute before the phase is done; its compute waits for the previous
phase's sends (the block it works on). So the engine leaves exposed, per
phase, ``max(0, sends - compute)``: testbed.model.ring's overlap rule, with
the sends of every ring of the stage on the links at once (a send task's
``instances``: every rank and its ring neighbour) and sharing them with
whatever else is in flight. The layers of one action are played as one
stretch per phase (all layers' step-0 blocks, then their later steps): layers
are identical, so the sums equal the layer-by-layer ones.

testbed.sim.graph.program emits the :class:`RingTask` list; the analytic tier
(testbed.explore.analytic) prices the same list with
:func:`ring_action_seconds`.
"""

from __future__ import annotations

from testbed.collectives.timing import send_time
from testbed.model import ring
from testbed.model.gemm import Gemm, ring_step_gemms, scaled, without
from testbed.plan.spec import Plan
from testbed.sim.price.compute import compute_seconds
from testbed.sim.step.pieces import ActionTask
from testbed.topology import Topology

__all__ = ["RING_STREAM", "RingTask", "ring_tasks", "ring_neighbours", "layers_share", "ring_action_seconds",
           "exposed_ring_s"]

#: The representative's stream of ring sends.
RING_STREAM = "ring"


#: One task of an action under context parallelism: compute, or the ring's sends on the ``ring`` stream
#: (``count`` messages of ``nbytes`` each, to the next rank of the ring).
RingTask = ActionTask


def layers_share(layers: int, pieces: int, k: int) -> int:
    """Layers of gradient bucket ``k`` of ``pieces`` (as even as whole layers allow; every bucket >= 1 layer)."""
    return layers // pieces + (1 if k < layers % pieces else 0)


def ring_neighbours(groups: tuple[tuple[int, ...], ...], rep: int
                    ) -> tuple[tuple[int, int], tuple[tuple[int, int], ...]]:
    """(the representative's (itself, next rank) pair, every rank's pair in all ``groups``): one ring step's sends."""
    pairs = tuple((g[i], g[(i + 1) % len(g)]) for g in groups for i in range(len(g)))
    return next(pair for pair in pairs if pair[0] == rep), pairs


def ring_tasks(plan: Plan, kind: str, name: str, layers: int, fraction: float, work: tuple[float, float, float, float],
               gemms: tuple[Gemm, ...], kernels: int) -> list[RingTask]:
    """The tasks of ``fraction`` of an F or B action (``layers`` layers of it; a gradient bucket's share) under
    context parallelism, in order; empty when the plan has no ring (or ``kind`` is W). ``work`` is the action's
    (FLOPs, HBM bytes, replicated bytes, split bytes) and ``gemms`` its GEMMs, all of its ring steps included."""
    phases = ring.ring_phases(plan, kind)
    if not phases or layers < 1:
        return []
    units = ring.step_units(plan.mesh.context)
    steps = [scaled(ring_step_gemms(plan, ph.kind, ph.first), layers * ph.units / (units[0] if ph.first else units[1]))
             for ph in phases]
    ring_flops = layers * sum(ph.units * ring.unit_flops(plan, ph.kind) for ph in phases)
    flops, hbm, replicated, split = work
    out = [RingTask(name=name, flops=flops * fraction - ring_flops, hbm_bytes=hbm * fraction,
                    replicated_bytes=replicated * fraction, split_bytes=split * fraction,
                    kernels=max(1, round(kernels * fraction)),
                    gemms=without(scaled(gemms, fraction), tuple(g for gs in steps for g in gs)))]
    compute, sending = 0, None  # indices of the last compute task and of the last send task
    for ph, gs in zip(phases, steps):
        sent = None
        if ph.sends:
            sent = len(out)
            out.append(RingTask(name=f"{ph.name} {name}", stream=RING_STREAM, after=(compute,), nbytes=ph.nbytes,
                                count=layers * ph.sends))
        if ph.units:
            blocks = ph.units // (units[0] if ph.first else units[1])
            out.append(RingTask(name=f"{name} {ph.name}",
                                after=(sending,) if ph.after_ring and sending is not None else (),
                                flops=layers * ph.units * ring.unit_flops(plan, ph.kind),
                                kernels=max(1, layers * blocks),
                                gemms=gs))
            compute = len(out) - 1
        if sent is not None:
            sending = sent
    merges = layers * sum(_merges(plan, ph, ph.units // (units[0] if ph.first else units[1])) for ph in phases)
    if merges:  # runtime.context_merge_fp32: eager kernels of their own after the attention (their sum, one task)
        out.append(RingTask(name=f"{name} ring merges", after=(), hbm_bytes=merges, kernels=max(1, layers * len(phases))))
    return out


def _merges(plan: Plan, phase: ring.RingPhase, steps: int) -> float:
    """Bytes of ``runtime.context_merge_fp32``'s merges of one layer's ``steps`` ring steps of ``phase`` (a forward
    phase that is step 0 holds its first step's casts)."""
    if phase.kind == "F" and phase.first:
        return ring.merge_bytes(plan, "F", True) + (steps - 1) * ring.merge_bytes(plan, "F", False)
    return steps * ring.merge_bytes(plan, phase.kind, False)


def ring_action_seconds(plan: Plan, topology: Topology, dtype: str, pair: tuple[int, int], kind: str, layers: int,
                        work: tuple[float, float, float, float], gemms: tuple[Gemm, ...], kernels: int,
                        tensor_bytes: float) -> tuple[float, float, float] | None:
    """(compute seconds, exposed ring seconds, all the ring's send seconds) of a whole F or B action's
    :func:`ring_tasks`, each compute task priced as the task graph prices it (testbed.sim.price.compute) and each message
    as a send from ``pair[0]`` to ``pair[1]``; a phase leaves ``max(0, sends - its compute)`` exposed
    (testbed.model.ring's overlap rule), the home send all of it. None without a ring: the analytic tier's price of
    what the engine plays."""
    tasks = ring_tasks(plan, kind, "", layers, 1.0, work, gemms, kernels)
    if not tasks:
        return None
    compute, exposed, pending, sent = 0.0, 0.0, 0.0, 0.0  # pending: the sends of the phase whose compute comes next
    for i, t in enumerate(tasks):
        if t.transfer:
            exposed += pending
            pending = send_time(topology, pair[0], pair[1], t.nbytes) * t.count
            sent += pending
            continue
        seconds = compute_seconds(topology, dtype, t.flops, t.hbm_bytes, t.kernels, t.replicated_bytes,
                                  t.split_bytes, tensor_bytes, t.gemms)
        compute += seconds
        if i and tasks[i - 1].transfer:  # the sends beside this compute (their phase's), or before it when it
            # waits for them (runtime.context_all_gather's gather)
            exposed += pending if i - 1 in (t.after or ()) else max(0.0, pending - seconds)
            pending = 0.0
    return compute, exposed + pending, sent


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def exposed_ring_s(timeline) -> float:
    """Seconds the busiest representative of a simulated step (a testbed.sim.report.timeline.Timeline) spends sending
    ring messages while computing nothing: the ring's share of the report's exposed communication."""
    if not timeline.representatives:
        return 0.0
    spans = list(timeline.spans(timeline.busiest()))
    ring_spans = [(x.start, x.end) for x in spans if x.stream == RING_STREAM]
    compute = [(x.start, x.end) for x in spans if x.category == "compute"]
    return _union(ring_spans + compute) - _union(compute) if ring_spans else 0.0
