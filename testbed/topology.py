"""Topologies: devices, switches and links as a frozen networkx graph.

A :class:`Topology` is one of three forms (DESIGN.md):

- ``levels``: hierarchical tiers, innermost first (8 GPUs on an NVSwitch per
  ``node``, nodes on an InfiniBand switch across the ``cluster``). A tier
  spans everything inside it, so ``--over cluster`` means every device of the
  cluster.
- ``torus``: named dims (``x``, ``y``, ``z``) with per-dim wraparound; dims
  are orthogonal, so ``--over x`` is one line of chips along x.
- ``graph``: explicit devices, switches and links, optionally with named
  groups of consecutive devices as levels.

Device nodes are the integers ``0..n-1`` (the device ids placement and the
runner use); switch nodes are strings. Every edge carries ``bandwidth``
(bytes/s per direction), ``latency`` (seconds per hop) and ``kind``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

import networkx as nx

from testbed.errors import InputError, unknown_key_message

__all__ = ["LinkKind", "DeviceSpec", "Level", "LinkSpec", "Calibration", "Topology", "Form"]


class LinkKind(StrEnum):
    NVLINK = "nvlink"
    NVSWITCH = "nvswitch"
    PCIE = "pcie"
    ETHERNET = "ethernet"
    INFINIBAND = "infiniband"
    ICI = "ici"
    DCN = "dcn"
    HOST = "host"


class Form(StrEnum):
    LEVELS = "levels"
    TORUS = "torus"
    GRAPH = "graph"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """One accelerator: peak FLOP/s per dtype, memory bytes and memory bandwidth."""

    name: str
    peak_flops: Mapping[str, float]
    memory_bytes: float
    memory_bandwidth: float

    def __post_init__(self) -> None:
        if not self.peak_flops:
            raise InputError("needs at least one dtype with its peak FLOP/s, e.g. {bf16: 989TFLOP/s}", field="device.flops")
        for dtype, value in self.peak_flops.items():
            if not value > 0:
                raise InputError(f"peak FLOP/s must be positive, got {value}", field=f"device.flops.{dtype}")
        if not self.memory_bytes > 0:
            raise InputError(f"must be positive, got {self.memory_bytes}", field="device.memory")
        if not self.memory_bandwidth > 0:
            raise InputError(f"must be positive, got {self.memory_bandwidth}", field="device.memory_bandwidth")
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (``fp32``, ``bf16``); falls back to the slowest listed."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        return min(self.peak_flops.values())


@dataclass(frozen=True, slots=True, kw_only=True)
class Level:
    """A named tier (levels form), dim (torus form) or group (graph form).

    ``bandwidth``/``latency``/``kind`` describe the links of this level: the
    link from each member to the level's switch (``attach='device'``: one NIC
    per device) or from each inner switch to it (``attach='switch'``: one
    uplink per inner group); on a torus, each link along this dim.
    """

    name: str
    size: int
    bandwidth: float | None = None
    latency: float = 0.0
    kind: LinkKind | None = None
    attach: str = "device"
    wraparound: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise InputError(f"size must be a positive whole number, got {self.size!r}", field=f"level {self.name}")
        if self.bandwidth is not None and not self.bandwidth > 0:
            raise InputError(f"bandwidth must be positive, got {self.bandwidth}", field=f"level {self.name}.bandwidth")
        if self.latency < 0:
            raise InputError(f"latency must be non-negative, got {self.latency}", field=f"level {self.name}.latency")
        if self.attach not in ("device", "switch"):
            raise InputError(f"attach must be `device` or `switch`, got {self.attach!r}", field=f"level {self.name}.attach")


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSpec:
    """An explicit link of a graph-form topology (either end a device id or a switch name)."""

    a: int | str
    b: int | str
    bandwidth: float
    latency: float = 0.0
    kind: LinkKind = LinkKind.PCIE

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise InputError(f"bandwidth must be positive, got {self.bandwidth}", field=f"links[{self.a}-{self.b}].bandwidth")
        if self.latency < 0:
            raise InputError(f"latency must be non-negative, got {self.latency}", field=f"links[{self.a}-{self.b}].latency")


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """Fields fitted by ``testbed calibrate`` (defaults: an ideal machine).

    compute_efficiency: fraction of peak FLOP/s a large matmul reaches.
    efficiency_half_flops: FLOPs of one kernel at which it reaches half of
        ``compute_efficiency`` (small kernels are latency bound).
    memory_efficiency: fraction of peak memory bandwidth reached.
    replicated_passes, split_passes: memory passes, at the calibrated
        bandwidth, over each byte of activations a compute task writes
        (testbed.model.layer_traffic_bytes), replicated on every tensor rank
        or split over them: the memory-bound kernels between the matmuls
        (LayerNorm, GELU, softmax, residual adds, layout copies), added to
        the matmul roofline. A compiler that fuses them has few passes;
        XLA:CPU many. Both 0 (the default) leave them out.
    cache_bytes, cached_passes: a compute task whose ``[tokens, d_model]``
        activation is at most ``cache_bytes`` (a pass reads one such tensor
        and writes another: half the core's L2) makes its passes from cache,
        ``cached_passes`` over its replicated and split bytes instead (XLA:CPU
        on a 512 KiB-L2 host: a pass over 256 KiB tensors costs a third of
        one over 512 KiB ones). ``cache_bytes`` 0 (the default): none does.
    launch_overhead_s: fixed cost per compute task (kernel/program dispatch).
    collective_overhead_s: software cost per round of a collective.
    host_cores: if > 0, devices share this many host cores (emulated CPU
        devices): ``n`` devices computing at once run at ``min(1, cores / n)``
        of their speed alone.
    host_throughput: measured instead (``calibrate``): pairs ``(n, T)``, the
        work of ``T`` devices alone that ``n`` devices computing at once get
        done (``T(1) = 1``; linear between points, flat after the last), so
        each runs at ``T(n) / n``. Measured on a 2-core host: two XLA:CPU
        devices at once get 1.0-1.4 devices' worth done, not the 2 a core
        count says. Overrides ``host_cores`` when given.
    controller_overhead_s: host time the single controller spends per program
        it dispatches (one per pipeline action and its sends, testbed.program);
    controller_step_s: host time it spends once per step besides (making and
        placing the batch, summing the loss).
    controller_pipeline_step_s: what a pipeline step (MPMD: one program per
        action) costs it per step beyond that (splitting the batch into
        microbatches and placing them per stage).
    controller_buffer_s: host time per device buffer a dispatched program
        takes or returns (arrays x devices, testbed.dispatch). All three 0
        leave the controller out of the simulation.
    """

    compute_efficiency: float = 1.0
    efficiency_half_flops: float = 0.0
    memory_efficiency: float = 1.0
    replicated_passes: float = 0.0
    split_passes: float = 0.0
    cache_bytes: float = 0.0
    cached_passes: float = 0.0
    launch_overhead_s: float = 0.0
    collective_overhead_s: float = 0.0
    host_cores: int = 0
    host_throughput: tuple[tuple[int, float], ...] = ()
    controller_overhead_s: float = 0.0
    controller_step_s: float = 0.0
    controller_pipeline_step_s: float = 0.0
    controller_buffer_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "memory_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1.5:
                raise InputError(f"must be in (0, 1.5], got {value}", field=f"calibration.{name}")
        for name in ("efficiency_half_flops", "replicated_passes", "split_passes", "cache_bytes", "cached_passes", "launch_overhead_s",
                     "collective_overhead_s", "controller_overhead_s", "controller_step_s",
                     "controller_pipeline_step_s", "controller_buffer_s"):
            if getattr(self, name) < 0:
                raise InputError(f"must be non-negative, got {getattr(self, name)}", field=f"calibration.{name}")
        if self.host_cores < 0:
            raise InputError(f"must be non-negative, got {self.host_cores}", field="calibration.host_cores")
        curve = tuple((int(n), float(t)) for n, t in self.host_throughput)
        object.__setattr__(self, "host_throughput", curve)
        if curve and (curve[0] != (1, 1.0) or any(b[0] <= a[0] for a, b in zip(curve, curve[1:]))
                      or any(not 0 < t <= n for n, t in curve)):
            raise InputError(f"must map device counts 1 < n2 < ... to 0 < T(n) <= n, starting at 1: 1.0; got "
                             f"{dict(curve)}", field="calibration.host_throughput")

    def caches(self, tensor_bytes: float) -> bool:
        """Whether a task whose ``[tokens, d_model]`` activation is ``tensor_bytes`` makes its passes from cache."""
        return 0 < tensor_bytes <= self.cache_bytes

    @property
    def shares_host(self) -> bool:
        """Whether devices computing at once slow each other (emulated devices of one host)."""
        return bool(self.host_throughput) or self.host_cores > 0

    def host_share(self, computing: float) -> float:
        """Fraction of its speed alone each of ``computing`` devices (at once) runs at."""
        if computing <= 1:
            return 1.0
        if self.host_throughput:
            curve = self.host_throughput
            done = curve[-1][1]
            for (n0, t0), (n1, t1) in zip(curve, curve[1:]):
                if computing <= n1:
                    done = t0 + (t1 - t0) * (computing - n0) / (n1 - n0)
                    break
            return min(1.0, done / computing)
        return min(1.0, self.host_cores / computing) if self.host_cores > 0 else 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """A frozen interconnect of identical devices; build with testbed.generators or load YAML."""

    name: str
    form: Form
    device: DeviceSpec
    levels: tuple[Level, ...]
    num_devices: int
    links: tuple[LinkSpec, ...] = ()
    switches: tuple[str, ...] = ()
    calibration: Calibration = field(default_factory=Calibration)
    description: str = ""
    graph: nx.Graph = field(init=False, repr=False, compare=False)
    _routes: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from testbed import generators  # generators import this module's types

        object.__setattr__(self, "levels", tuple(self.levels))
        names = [level.name for level in self.levels]
        if len(set(names)) != len(names) or "all" in names:
            raise InputError(f"level names must be distinct and not `all`, got {names}", field="levels")
        if self.form is not Form.GRAPH and math.prod(l.size for l in self.levels) != self.num_devices:
            raise InputError("the product of level sizes must equal the device count", field="levels")
        graph = generators.build_graph(self)
        if self.num_devices > 1 and not nx.is_connected(graph):
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

    def route(self, src: int, dst: int) -> tuple[tuple[int | str, int | str], ...]:
        """Directed links (u, v) a transfer from device src to dst crosses.

        Dimension-ordered on tori (shortest direction, ties go +), through the
        lowest common switch on hierarchies, fewest hops then least latency on
        explicit graphs. Cached: routes are pure functions of the topology.
        """
        key = (src, dst)
        cached = self._routes.get(key)
        if cached is None:
            from testbed import generators

            cached = generators.route(self, src, dst)
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
        from dataclasses import replace

        levels = tuple(replace(l, bandwidth=None if l.bandwidth is None else l.bandwidth * factor) for l in self.levels)
        links = tuple(replace(l, bandwidth=l.bandwidth * factor) for l in self.links)
        return replace(self, levels=levels, links=links)

    def with_flops_scaled(self, factor: float) -> "Topology":
        from dataclasses import replace

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
