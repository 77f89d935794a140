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

import math
from collections.abc import Hashable, Mapping, Sequence

__all__ = ["Flow", "LinkLedger", "fair_rates", "normalised_loads"]

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
    n = len(flows)
    factor = [0.0] * n
    frozen = [False] * n
    # Per link: flows crossing it with their demand at full speed (cap * bytes).
    users: dict[Link, list[tuple[int, float]]] = {}
    for i, flow in enumerate(flows):
        for link, b in flow.loads.items():
            users.setdefault(link, []).append((i, flow.cap * b))
    # Common case: nothing oversubscribed, everyone runs at its standalone speed.
    if all(sum(d for _, d in members) <= bandwidth[link] * (1 + 1e-12) for link, members in users.items()):
        return [flow.cap for flow in flows]
    remaining = {link: bandwidth[link] for link in users}
    level = 0.0
    left = n
    while left:
        # The next level at which some link fills (or 1: everyone at full speed).
        best, best_link = 1.0, None
        for link, members in users.items():
            demand = sum(d for i, d in members if not frozen[i])
            if demand <= 0:
                continue
            reach = level + remaining[link] / demand
            if reach < best:
                best, best_link = reach, link
        step = best - level
        for link, members in users.items():
            demand = sum(d for i, d in members if not frozen[i])
            if demand > 0:
                remaining[link] = max(0.0, remaining[link] - step * demand)
        level = best
        if best_link is None:
            for i in range(n):
                if not frozen[i]:
                    factor[i], frozen[i] = level, True
            break
        for i, _ in users[best_link]:
            if not frozen[i]:
                factor[i], frozen[i] = level, True
                left -= 1
        del users[best_link]
    return [f * flow.cap if math.isfinite(flow.cap) else math.inf for f, flow in zip(factor, flows)]


class LinkLedger:
    """Transfers in flight and their demand per link; rates only re-filled when a link is oversubscribed."""

    def __init__(self, bandwidth: Mapping[Link, float]) -> None:
        self.bandwidth = bandwidth
        self.flows: dict[Hashable, Flow] = {}
        self.demand: dict[Link, float] = {}
        self.over: set[Link] = set()

    def add(self, key: Hashable, flow: Flow) -> None:
        self.flows[key] = flow
        for link, b in flow.loads.items():
            d = self.demand.get(link, 0.0) + flow.cap * b
            self.demand[link] = d
            if d > self.bandwidth[link] * (1 + 1e-9):
                self.over.add(link)

    def remove(self, key: Hashable) -> None:
        flow = self.flows.pop(key)
        for link, b in flow.loads.items():
            d = self.demand[link] - flow.cap * b
            self.demand[link] = d
            if d <= self.bandwidth[link] * (1 + 1e-9):
                self.over.discard(link)

    def rates(self) -> dict[Hashable, float]:
        """Rate of every transfer in flight (its cap unless some link is oversubscribed)."""
        if not self.over:
            return {key: flow.cap for key, flow in self.flows.items()}
        keys = list(self.flows)
        return dict(zip(keys, fair_rates([self.flows[k] for k in keys], self.bandwidth)))
