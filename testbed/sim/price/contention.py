"""Sharing links between transfers in flight: max-min fair progressive filling.

Each transfer in flight has a standalone duration ``T`` (what the collectives
module predicts with the links to itself) and the bytes it moves over each
directed link. It progresses as a fraction of its work per second: alone at
``1/T``; with others, every transfer is slowed by the same factor until some
link is full, those on the full link are frozen, and the rest keep filling
(max-min fairness on the slowdown factor). A link never carries more than
its bandwidth, and a transfer alone runs exactly at its standalone speed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Mapping, Sequence

__all__ = ["Flow", "LinkLedger", "fair_rates", "normalised_loads", "shared_factor"]

Link = Hashable


class Flow:
    """A transfer in flight: cap (fraction of its work per second alone) and bytes per link."""

    __slots__ = ("cap", "loads")

    def __init__(self, cap: float, loads: Mapping[Link, float]) -> None:
        self.cap = cap
        self.loads = loads

    def __repr__(self) -> str:
        return f"Flow(cap={self.cap:.3g}, links={len(self.loads)})"


def normalised_loads(standalone_s: float, loads: Mapping[Link, float], own: Mapping[Link, float],
                     bandwidth: Mapping[Link, float]) -> dict[Link, float]:
    """Scale ``loads`` so that the transfer's ``own`` traffic alone fits in ``standalone_s``.

    ``own`` is what one group moves; ``loads`` is what all groups running the
    same collective at once move (>= own on every link). When the closed form
    behind ``standalone_s`` is faster than ``own`` bytes over the slowest link
    would allow (another algorithm, overlapping phases), the loads shrink so
    that the transfer alone is never slower than its standalone time; the
    extra traffic of the other groups still slows it.
    """
    if standalone_s <= 0:
        return {}
    need = max((b / bandwidth[link] for link, b in own.items() if b > 0), default=0.0)
    scale = 1.0 if need <= standalone_s else standalone_s / need
    return {link: b * scale for link, b in loads.items() if b > 0}


def fair_rates(flows: Sequence[Flow], bandwidth: Mapping[Link, float]) -> list[float]:
    """Rates (fraction of work per second) of ``flows`` sharing links of ``bandwidth`` bytes/s.

    Progressive filling on the common slowdown factor ``f`` in (0, 1]: rate_i = f_i * cap_i.
    """
    index: dict[Link, int] = {}
    ids, demands = [], []
    for flow in flows:
        ids.append([index.setdefault(link, len(index)) for link in flow.loads])
        demands.append([flow.cap * b for b in flow.loads.values()])
    factor = _fill(ids, demands, [bandwidth[link] for link in index])
    return [float(f) * flow.cap if math.isfinite(flow.cap) else math.inf for f, flow in zip(factor, flows)]


def shared_factor(a: Flow, b: Flow, bandwidth: Mapping[Link, float]) -> float:
    """The share of its standalone speed each of two transfers in flight together runs at (:func:`fair_rates`: the
    same for both, as they freeze on the link they fill together; 1 where they fill none): how the engine shares
    their links, for a tier that plays the two side by side without it (testbed.explore.held_blocks)."""
    if not a.loads or not b.loads or not math.isfinite(a.cap) or a.cap <= 0:
        return 1.0
    return min(1.0, fair_rates((a, b), bandwidth)[0] / a.cap)


def _fill(ids: Sequence[Sequence[int]], demands: Sequence[Sequence[float]], capacity: Sequence[float]) -> list[float]:
    """Slowdown factor of each flow (link numbers ``ids[i]`` into ``capacity``, demand at full speed ``demands[i]``).

    Progressive filling, event by event: while a link's demand is unchanged the
    level at which it fills, ``level_then + remaining_then / demand``, is
    fixed, so the links wait in a heap by that level (ties: the link met
    first) and only the links of the flows a filled link freezes are updated.
    A step costs a few heap operations instead of a pass over every link, and
    only links oversubscribed at full speed are tracked at all.
    """
    n = len(ids)
    demand: dict[int, float] = {}
    for links, wants in zip(ids, demands):
        for link, d in zip(links, wants):
            demand[link] = demand.get(link, 0.0) + d
    # Only a link oversubscribed at full speed can fill before everyone runs at it (demands only fall as
    # flows freeze), so the others are never tracked; with none, everyone runs at its standalone speed.
    demand = {link: d for link, d in demand.items() if d > capacity[link] * (1 + 1e-12)}
    if not demand:
        return [1.0] * n
    users: dict[int, list[int]] = {link: [] for link in demand}
    for i, links in enumerate(ids):
        for link in links:
            if link in users:
                users[link].append(i)
    order = {link: k for k, link in enumerate(demand)}
    unfrozen = {link: len(members) for link, members in users.items()}
    remaining = {link: float(capacity[link]) for link in demand}
    since = dict.fromkeys(demand, 0.0)  # level at which remaining[link] was last brought up to date
    version = dict.fromkeys(demand, 0)
    heap = [(remaining[link] / d, order[link], link, 0) for link, d in demand.items() if d > 0]
    heapq.heapify(heap)
    factor = [1.0] * n
    frozen = [False] * n
    level = 0.0
    while heap:
        reach, _, link, v = heapq.heappop(heap)
        if v != version[link]:
            continue  # its demand changed since: a newer entry stands for it
        if reach >= 1.0:
            break  # no link fills before everyone runs at full speed
        level = reach
        version[link] = -1  # full: no longer considered
        for i in users[link]:
            if frozen[i]:
                continue
            factor[i], frozen[i] = level, True
            for other, d in zip(ids[i], demands[i]):
                if version.get(other, -1) < 0:
                    continue  # full, or never oversubscribed
                remaining[other] = max(0.0, remaining[other] - (level - since[other]) * demand[other])
                since[other] = level
                unfrozen[other] -= 1
                # exactly zero once no unfrozen flow uses the link
                demand[other] = demand[other] - d if unfrozen[other] else 0.0
                version[other] += 1
                if demand[other] > 0:
                    heapq.heappush(heap, (level + remaining[other] / demand[other], order[other], other,
                                          version[other]))
    return factor


class LinkLedger:
    """Transfers in flight and their demand per link; rates only re-filled when they can have changed.

    Links are numbered once, as flows arrive, and each flow keeps its link
    numbers and demands, so a re-fill does not hash links again. A flow that
    arrives or leaves without crossing a link oversubscribed at full speed
    cannot change anyone's share (only such links ever fill, and it is on none),
    so the last rates are kept, with the newcomer at its cap.
    """

    def __init__(self, bandwidth: Mapping[Link, float]) -> None:
        self.bandwidth = bandwidth
        self.flows: dict[Hashable, Flow] = {}
        self.demand: dict[Link, float] = {}
        self.over: set[Link] = set()
        self.number: dict[Link, int] = {}
        self.capacity: list[float] = []
        self.arrays: dict[Hashable, tuple[list[int], list[float]]] = {}
        self.last: dict[Hashable, float] | None = None  # rates of the flows in flight, while still valid

    def _full(self, link: Link) -> bool:
        return self.demand[link] > self.bandwidth[link] * (1 + 1e-12)

    def add(self, key: Hashable, flow: Flow) -> None:
        self.flows[key] = flow
        ids, wants, full = [], [], False
        demand, bandwidth, number_of = self.demand, self.bandwidth, self.number
        for link, b in flow.loads.items():
            want = flow.cap * b
            d = demand.get(link, 0.0) + want
            demand[link] = d
            bw = bandwidth[link]
            if d > bw * (1 + 1e-9):
                self.over.add(link)
            full = full or d > bw * (1 + 1e-12)  # as :meth:`_full` once every link is added (each once)
            number = number_of.get(link)
            if number is None:
                number = number_of[link] = len(self.capacity)
                self.capacity.append(bw)
            ids.append(number)
            wants.append(want)
        self.arrays[key] = (ids, wants)
        if self.last is not None:
            if full:
                self.last = None
            else:
                self.last[key] = flow.cap

    def remove(self, key: Hashable) -> None:
        flow = self.flows.pop(key)
        del self.arrays[key]
        full = False
        demand, bandwidth = self.demand, self.bandwidth
        for link, b in flow.loads.items():
            before, bw = demand[link], bandwidth[link]
            full = full or before > bw * (1 + 1e-12)  # as :meth:`_full` before the flow leaves
            d = demand[link] = before - flow.cap * b
            if d <= bw * (1 + 1e-9):
                self.over.discard(link)
        if self.last is not None:
            if full:
                self.last = None
            else:
                self.last.pop(key, None)

    def rates(self) -> dict[Hashable, float]:
        """Rate of every transfer in flight (its cap unless some link is oversubscribed)."""
        if not self.over:
            self.last = {key: flow.cap for key, flow in self.flows.items()}
            return dict(self.last)
        if self.last is None:
            keys = list(self.flows)
            factor = _fill([self.arrays[k][0] for k in keys], [self.arrays[k][1] for k in keys], self.capacity)
            self.last = {k: float(f) * self.flows[k].cap if math.isfinite(self.flows[k].cap) else math.inf
                         for k, f in zip(keys, factor)}
        return dict(self.last)
