"""Seconds of one collective over every device group of a pipeline stage at once, memoized per placement: the
analytic tier's price of a collective (testbed.explore.analytic), the groups sharing the topology's links
(testbed.collectives.timing.groups_time)."""

from __future__ import annotations

from testbed.collectives.routed import topology_memo
from testbed.collectives.timing import groups_time, timed_groups
from testbed.sim.graph.pricing import collective_flow
from testbed.sim.price.contention import shared_factor
from testbed.plan.spec import MESH_AXES, Axis
from testbed.topology import Topology

__all__ = ["StageCollectives", "Transfer", "stage_groups", "tied_seconds"]

#: One collective of a stage: (op, axes, bytes), as :meth:`StageCollectives.time` prices it.
Transfer = tuple[str, tuple[Axis, ...], float]


def stage_groups(ids, axes: tuple[Axis, ...], stage: int) -> tuple[tuple[int, ...], ...]:
    """All device groups of ``stage`` varying along ``axes`` (mesh order), the representative's first."""
    dims = [MESH_AXES.index(a) for a in axes]
    block = ids[stage]  # dims: MESH_AXES but stage
    keep = [d - 1 for d in range(1, ids.ndim) if d not in dims]
    moved = block.transpose(keep + [d - 1 for d in sorted(dims)])
    size = 1
    for d in dims:
        size *= ids.shape[d]
    return tuple(map(tuple, moved.reshape(-1, size).tolist()))  # Python ints, as int(x) each


#: (placement, axes, stage) -> that stage's device groups along the axes: a pure function of its key, kept
#: across plans since building the groups of a 16,384-device mesh takes longer than pricing them.
_GROUPS: dict = {}
#: At most this many collective prices kept per topology by :meth:`StageCollectives.time`.
_SECONDS = 100_000


class StageCollectives:
    """Seconds of one collective over every group of one stage at once (groups share links)."""

    def __init__(self, topology: Topology, ids) -> None:
        self.topology, self.ids = topology, ids
        self.placement = (ids.shape, ids.tobytes())  # plans of one mesh share their groups (a search meets many)
        self.memo = topology_memo(topology).setdefault("analytic", {})  # one entry of it (its size bounds it)

    def time(self, op: str, axes: tuple[Axis, ...], stage: int, nbytes: float) -> float:
        # Memoized by placement rather than by the groups themselves: groups_time's own memo hashes every group's
        # every rank per call (thousands at 16,384 devices), while the placement's bytes hash once.
        memo = self.memo
        seconds = memo.get((self.placement, axes, stage, op, nbytes))
        if seconds is None:
            key = (self.placement, axes, stage)
            timed = memo.get(key)  # the groups groups_time times for all of them (one, when they are copies)
            if timed is None:
                groups = _GROUPS.get(key)
                if groups is None:
                    if len(_GROUPS) > 4096:
                        _GROUPS.clear()
                    groups = _GROUPS[key] = stage_groups(self.ids, axes, stage)
                timed = memo[key] = timed_groups(self.topology, groups)
            seconds = 0.0 if nbytes <= 0 or len(timed[0]) < 2 else groups_time(self.topology, op, timed,
                                                                                nbytes).time_s
            if len(memo) > _SECONDS:
                memo.clear()
            memo[(self.placement, axes, stage, op, nbytes)] = seconds
        return seconds


    def factor(self, stage: int, a: Transfer, b: Transfer) -> float:
        """The share of its standalone speed each of two collectives of ``stage`` in flight together runs at, as the
        task graph's engine shares their links (testbed.sim.price.contention.shared_factor over their flows,
        testbed.sim.graph.pricing.collective_flow). Memoized per placement."""
        memo = topology_memo(self.topology).setdefault("shared", {})
        key = (self.placement, stage, a, b)
        hit = memo.get(key)
        if hit is None:
            (fa, bandwidth), (fb, _) = self._flow(stage, a), self._flow(stage, b)
            hit = 1.0 if fa is None or fb is None else shared_factor(fa, fb, bandwidth)
            if len(memo) > _SECONDS:
                memo.clear()
            memo[key] = memo[(self.placement, stage, b, a)] = hit
        return hit

    def _flow(self, stage: int, transfer: Transfer):
        """testbed.sim.graph.pricing.collective_flow of ``transfer`` over ``stage``'s groups."""
        op, axes, nbytes = transfer
        groups = _GROUPS.get((self.placement, axes, stage)) or stage_groups(self.ids, axes, stage)
        if nbytes <= 0 or len(groups[0]) < 2:
            return None, {}
        return collective_flow(self.topology, op, groups, nbytes)


def tied_seconds(topology: Topology, ids, nbytes: float) -> float:
    """Seconds of the tied token table's gradient sum (testbed.sim.step.facts.StepFacts.tied_bytes: ``nbytes`` per device)
    over every pair of a first-stage device and its last-stage peer at once (0 where there is none)."""
    if nbytes <= 0 or ids.shape[0] < 2:
        return 0.0
    pairs = tuple(zip(ids[0].ravel().tolist(), ids[-1].ravel().tolist()))  # the representatives' pair first
    return groups_time(topology, "all_reduce", timed_groups(topology, pairs), nbytes).time_s
