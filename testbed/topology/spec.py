"""Topologies: devices, switches and links as a frozen networkx graph.

A :class:`Topology` is one of three forms (DESIGN.md):

- ``levels``: hierarchical tiers, innermost first (8 GPUs on an NVSwitch per
  ``node``, nodes on an InfiniBand switch across the ``cluster``). A tier
  spans everything inside it, so ``--over cluster`` means every device of the
  cluster.
- ``torus``: named dims (``x``, ``y``, ``z``) with per-dim wraparound; dims
  are orthogonal, so ``--over x`` is one line of chips along x. A multi-slice
  torus adds one last, *switched* dim (``slice``): copies of the torus whose
  chips meet at one data-center-network switch, each over its own link, so
  ``--over slice`` is the chips at one position of every slice.
- ``graph``: explicit devices, switches and links, optionally with named
  groups of consecutive devices as levels.

Device nodes are the integers ``0..n-1`` (the device ids placement and the
runner use); switch nodes are strings. Every edge carries ``bandwidth``
(bytes/s per direction), ``latency`` (seconds per hop) and ``kind``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import networkx as nx

from testbed.errors import InputError, unknown_key_message
from testbed.topology import routing
from testbed.topology.calibration import Calibration
from testbed.topology.parts import DeviceSpec, Form, Level, LinkSpec

__all__ = ["Topology", "level_sizes", "check_price", "PRICE_RANGE"]

#: Dollars per device-hour a price may be (a price outside makes costs overflow or vanish in plots and JSON).
PRICE_RANGE = (1e-6, 1e6)


def check_price(value: Any, field_name: str = "price_per_device_hour") -> float:
    """``value`` as a price per device-hour in :data:`PRICE_RANGE`; InputError naming ``field_name`` otherwise."""
    low, high = PRICE_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise InputError(f"must be a price in dollars per device-hour from {low:g} to {high:g}, got {value!r}",
                         field=field_name)
    return float(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """A frozen interconnect of identical devices; build with testbed.topology.generators or load YAML."""

    name: str
    form: Form
    device: DeviceSpec
    levels: tuple[Level, ...]
    num_devices: int
    links: tuple[LinkSpec, ...] = ()
    switches: tuple[str, ...] = ()
    calibration: Calibration = field(default_factory=Calibration)
    description: str = ""
    price_per_device_hour: float | None = None
    graph: nx.Graph = field(init=False, repr=False, compare=False)
    _routes: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", tuple(self.levels))
        if self.price_per_device_hour is not None:
            check_price(self.price_per_device_hour)
        names = [level.name for level in self.levels]
        if len(set(names)) != len(names) or "all" in names:
            raise InputError(f"level names must be distinct and not `all`, got {names}", field="levels")
        if self.form is not Form.GRAPH and math.prod(l.size for l in self.levels) != self.num_devices:
            raise InputError("the product of level sizes must equal the device count", field="levels")
        switched = [i for i, level in enumerate(self.levels) if level.switched]
        if switched and (self.form is not Form.TORUS or switched != [len(self.levels) - 1]):
            raise InputError("only a torus has slices (one switched level, its last, outermost): "
                             f"got switched levels {[self.levels[i].name for i in switched]} in a {self.form} topology",
                             field="torus.slices")
        graph = routing.build_graph(self)
        # Tori and hierarchies are connected by construction; only explicit graphs need the check.
        if self.form is Form.GRAPH and self.num_devices > 1 and not nx.is_connected(graph):
            parts = [sorted(map(str, c))[:4] for c in nx.connected_components(graph)]
            raise InputError(
                f"topology is disconnected ({len(parts)} parts, e.g. {parts[:2]}); every device must reach every other",
                field="links",
            )
        object.__setattr__(self, "graph", nx.freeze(graph))
        object.__setattr__(self, "_routes", {})

    # -- groups --------------------------------------------------------------
    @property
    def nested(self) -> bool:
        """True when levels are nested tiers (a tier spans those inside it)."""
        return self.form is not Form.TORUS

    @property
    def slice_level(self) -> int | None:
        """Index of the switched level joining the slices of a multi-slice torus (its last), else None."""
        if self.levels and self.levels[-1].switched:
            return len(self.levels) - 1
        return None

    @property
    def level_names(self) -> tuple[str, ...]:
        return tuple(level.name for level in self.levels)

    def coords(self, device: int) -> tuple[int, ...]:
        """Mixed-radix coordinates of ``device``, innermost level first."""
        out = []
        for level in self.levels:
            out.append(device % level.size)
            device //= level.size
        return tuple(out)

    def spanned(self, over: Iterable[str] | str) -> tuple[int, ...]:
        """Indices of the levels a group ``over`` spans (tiers include those inside)."""
        if isinstance(over, str):
            over = [part.strip() for part in over.split(",") if part.strip()]
        over = list(over)
        if not over:
            raise InputError("name at least one level", field="over")
        if "all" in over:
            return tuple(range(len(self.levels)))
        indices = set()
        for name in over:
            if name not in self.level_names:
                raise InputError(unknown_key_message(name, [*self.level_names, "all"], what="level"), field="over")
            index = self.level_names.index(name)
            indices.update(range(index + 1) if self.nested else [index])
        return tuple(sorted(indices))

    def groups(self, over: Iterable[str] | str) -> list[tuple[int, ...]]:
        """Disjoint device groups that vary along the levels ``over`` and fix the rest."""
        spanned = set(self.spanned(over))
        if self.form is Form.GRAPH and not self.levels:
            return [tuple(range(self.num_devices))]
        buckets: dict[tuple[int, ...], list[int]] = {}
        for device in range(self.num_devices):
            c = self.coords(device)
            key = tuple(v for i, v in enumerate(c) if i not in spanned)
            buckets.setdefault(key, []).append(device)
        return [tuple(members) for members in buckets.values()]

    # -- links and routes ------------------------------------------------------
    def link(self, u: int | str, v: int | str) -> Mapping[str, object]:
        """Attributes of the link between nodes u and v."""
        return self.graph.edges[u, v]

    def memo(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per ``key`` for this topology (results may be None): derived facts such as
        a group's symmetry or a collective's profile are pure functions of the topology."""
        cache = self._routes
        if key not in cache:
            cache[key] = compute()
        return cache[key]

    def route(self, src: int, dst: int) -> tuple[tuple[int | str, int | str], ...]:
        """Directed links (u, v) a transfer from device src to dst crosses.

        Dimension-ordered on tori (shortest direction, ties go +; across slices
        last, up to the data-center switch and down), through the
        lowest common switch on hierarchies, fewest hops then least latency on
        explicit graphs. Cached: routes are pure functions of the topology.
        """
        key = (src, dst)
        cached = self._routes.get(key)
        if cached is None:
            cached = routing.route(self, src, dst)
            self._routes[key] = cached
        return cached

    def path_latency(self, src: int, dst: int) -> float:
        return sum(self.graph.edges[u, v]["latency"] for u, v in self.route(src, dst))

    def path_bandwidth(self, src: int, dst: int) -> float:
        """The slowest link's bandwidth on the route (inf for src == dst)."""
        hops = self.route(src, dst)
        return min((self.graph.edges[u, v]["bandwidth"] for u, v in hops), default=math.inf)

    def with_bandwidth_scaled(self, factor: float) -> "Topology":
        """The same topology with every link bandwidth multiplied by ``factor``."""
        levels = tuple(replace(l, bandwidth=None if l.bandwidth is None else l.bandwidth * factor) for l in self.levels)
        links = tuple(replace(l, bandwidth=l.bandwidth * factor) for l in self.links)
        return replace(self, levels=levels, links=links)

    def with_flops_scaled(self, factor: float) -> "Topology":
        device = replace(self.device, peak_flops={k: v * factor for k, v in self.device.peak_flops.items()})
        return replace(self, device=device)

    def summary(self) -> dict[str, object]:
        return {
            "name": self.name,
            "form": str(self.form),
            "devices": self.num_devices,
            "levels": list(self.level_names),
            "device": self.device.name,
        }


def level_sizes(levels: Sequence[Level]) -> tuple[int, ...]:
    return tuple(level.size for level in levels)
