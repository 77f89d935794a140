"""Collectives as NCCL runs them on NVIDIA GPUs: algorithms, protocols and NCCL's own choice.

The routed step programs (:mod:`~testbed.collectives.timing`) move bytes at
the links' line rate. NCCL does not: it runs a few algorithms (ring, tree,
NVLS, NVLS-tree, CollNet/SHARP), each in one of three protocols, on many
channels at once, and picks the (algorithm, protocol) its tuning model
predicts fastest for every call. This module is that model, on the topology's
levels, for GPU topologies (a ``levels`` form whose innermost level is an
``nvswitch``/``nvlink`` level of a GPU generation NCCL knows). Every constant
of the model is NCCL's (``src/graph/tuning.cc``, ``src/graph/topo.h``,
``src/transport/nvls.cc`` of NVIDIA/nccl, master 2025) or a vendor's
(docs/collectives.md lists them). Across nodes, measured collectives run
short of that model; :class:`MultiNodeFit` (four numbers fitted over every
published multi-node nccl-tests case, with leave-one-out errors) prices
that, while NCCL still picks its algorithm and protocol by its own model.

A collective of ``S`` bytes takes ``latency(a, p) + S / algbw(a, p)``
(``ncclTopoGetAlgoTime``), latencies in NCCL's microseconds
(``baseLat + steps * hwLat``), and:

- NVLink data rate: NCCL's per-link bandwidth (``SM80_NVLINK_BW`` 20.0 GB/s,
  ``SM90_NVLINK_BW`` 20.6, ``SM100_NVLINK_BW`` 40.1) over the link's line
  rate (25 GB/s per direction for NVLink 2-4, 50 for NVLink 5): the level's
  bandwidth times that ratio (0.80 on A100, 0.824 on H100: "with the
  protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of
  370GB/s", NCCL maintainer, NVIDIA/nccl-tests#212). A NIC delivers 0.96 of
  its line rate (NCCL maintainers: 24 GB/s on 200 Gb/s HDR, NVIDIA/nccl#412;
  48-49 GB/s on 400 Gb/s NDR, NVIDIA/nccl-tests#267).
- ring (every op but all-to-all): bus bandwidth = the slower of the NVLink
  rate per GPU and the NICs of a node; LL: ``min(llMaxBw, bw/2)``; LL128:
  ``0.92 bw`` (120 of 128 bytes are data); Simple: ``bw``; algbw =
  ``busbw * n / nsteps``. Latency ``baseLat + (nsteps - nInter) * intraLat +
  nInter * interLat`` (the plateau factor 1.4 of multi-node Simple rings).
- tree (all-reduce): ``min(0.92 bw, ...)`` (on two nodes the NICs carry half: ``bw`` at
  most twice theirs), LL ``/3.8``, LL128 ``* 7/9``
  (one node) or ``120/128``; algbw = busbw / 2; latency ``baseLat + 2((ppn-1)
  intraLat + log2(nNodes) interLat)``, with NCCL's tree correction factors
  by size.
- nvls (level declares ``in_network_reduction: nvls``; all-reduce,
  all-gather, reduce-scatter): the NVSwitch reduces (``multimem.ld_reduce``)
  and multicasts (``multimem.st``), so a GPU moves ``(ppn+1)/ppn * S`` each
  way for an all-reduce and ``(ppn-1)/ppn * S`` for the others, at the NVLink
  rate times NCCL's ``nvlsEfficiency`` (0.85 Hopper, 0.74 Blackwell). Across
  nodes it needs SHARP on the network (CollNet), the node's NICs then carry
  ``S`` each way, pipelined with the NVSwitch part.
- nvls_tree (all-reduce over nodes with NVLS but no SHARP): NVLS inside,
  tree across nodes (``2S`` per node each way, ``S`` on two nodes), pipelined.
- sharp (all-reduce over nodes, network declares ``sharp``, NVSwitch without
  NVLS): CollNet direct, reduce-scatter over NVLink, SHARP across, all-gather
  over NVLink, pipelined; ``* 0.85`` on Hopper as NCCL has it.
- all-to-all: NCCL's point-to-point send/receive, every pair at once: the
  NVLink rate for the bytes staying in the node, the node's NICs for the rest.

What is left out: per-channel caps (``perChMax*Bw``; they bind only with
fewer channels than NCCL opens on NVSwitch systems), the channel and thread
count heuristics, PAT, and reductions/broadcasts (timed by the routed
programs). The calibration's ``collectives.overhead_s`` is not added: NCCL's
latencies already hold its software cost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from testbed.collectives.algorithms import NCCL_ALGORITHMS  # NCCL's RING, TREE, NVLS, NVLS_TREE, COLLNET_DIRECT
from testbed.collectives.nccl_fit import MULTINODE_FIT, MultiNodeFit
from testbed.collectives.ops import Op
from testbed.topology import Form, LinkKind, Topology

__all__ = ["NCCL_ALGORITHMS", "PROTOCOLS", "NcclGroup", "nccl_group", "nccl_algorithms", "nccl_time", "nccl_best",
           "nccl_predictions", "arch_of",
           "MultiNodeFit", "MULTINODE_FIT"]

PROTOCOLS: tuple[str, ...] = ("LL", "LL128", "Simple")

_OPS = {
    "nccl_ring": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL),
    "nccl_tree": (Op.ALL_REDUCE,),
    "nvls": (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER),
    "nvls_tree": (Op.ALL_REDUCE,),
    "sharp": (Op.ALL_REDUCE,),
}

# -- NCCL's constants (NVIDIA/nccl src/graph/tuning.cc, ncclTunerConstantsDefaults) ---------------------

#: GPU generations, found by the device's name (NCCL reads the compute capability).
_ARCH_NAMES = (("GB200", "blackwell"), ("B200", "blackwell"), ("B100", "blackwell"), ("GH200", "hopper"),
               ("H100", "hopper"), ("H200", "hopper"), ("H800", "hopper"), ("H20", "hopper"),
               ("A100", "ampere"), ("A800", "ampere"), ("V100", "volta"))
_ARCH_INDEX = {"volta": 0, "ampere": 1, "hopper": 2, "blackwell": 3}
#: NCCL's NVLink bandwidth per link (topo.h SM70/SM80/SM90/SM100_NVLINK_BW, GB/s) and the line rate of
#: that NVLink generation per link and direction (NVIDIA V100/A100/H100/B200 datasheets: 300/600/900/1800
#: GB/s bidirectional over 6/12/18/18 links).
_NVLINK_BW = {"volta": (20.0, 25.0), "ampere": (20.0, 25.0), "hopper": (20.6, 25.0), "blackwell": (40.1, 50.0)}
#: nvlsEfficiency (tuning.cc), indexed like _ARCH_INDEX.
_NVLS_EFFICIENCY = (0.0, 0.0, 0.85, 0.74)
#: baseLatencies [algorithm][LL, LL128, Simple] (us).
_BASE_LAT = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "collnet_direct": (0.0, 0.0, 0.0),
             "nvls": (0.0, 0.0, 0.0), "nvls_tree": (0.0, 0.0, 0.0)}
#: hwLatencies [NVLINK / PCI / NET][algorithm][LL, LL128, Simple] (us).
_HW_LAT = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "collnet_direct": (0.0, 0.0, 3.7),
               "nvls": (0.0, 0.0, 25.0), "nvls_tree": (0.0, 0.0, 25.0)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "collnet_direct": (0.0, 0.0, 3.7),
            "nvls": (0.0, 0.0, 0.0), "nvls_tree": (0.0, 0.0, 0.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "collnet_direct": (0.0, 0.0, 31.0),
            "nvls": (0.0, 0.0, 18.0), "nvls_tree": (0.0, 0.0, 20.9)},
}
#: llMaxBws [arch for one node / CPU (Intel) for more][N1, N2, N4] (GB/s).
_LL_MAX_BW = ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0), (282.0, 90.0, 70.0))
#: treeCorrectionFactor [LL, LL128, Simple][log2(bytes / 64)], 64 B to 256 MB.
_TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)
#: getNetOverhead (x86 Intel: 1 us; x3 for Simple).
_NET_OVERHEAD_US = 1.0
#: Plateau factor of multi-node Simple rings (compute capability >= 8.0).
_RING_PLATEAU = 1.4
#: CollNet direct on Hopper: busBw *= .85.
_COLLNET_HOPPER = 0.85
_MAX_CHANNELS = 32  # MAXCHANNELS (src/include/device.h)
#: Data rate of an InfiniBand NIC over its line rate (HDR: 24 of 25 GB/s, NVIDIA/nccl#412; NDR: 48-49 of 50,
#: NVIDIA/nccl-tests#267).
NET_EFFICIENCY = 0.96


def arch_of(topology: Topology) -> str | None:
    """NCCL's GPU generation of the topology's device (by name), or None (not an NCCL GPU)."""
    name = topology.device.name.upper()
    return next((arch for key, arch in _ARCH_NAMES if key in name), None)


@dataclass(frozen=True, slots=True)
class NcclGroup:
    """A group as NCCL sees it: ranks per node, nodes, and the data rates it runs at (bytes/s)."""

    arch: str
    n: int
    ppn: int
    nodes: int
    nvlink_bw: float  # per GPU and direction, after NCCL's NVLink efficiency
    net_bw: float  # per node and direction (its NICs together); inf on one node
    net_latency: float  # seconds of the network's links on a route (topology latency)
    nvls: bool
    sharp: bool


def nccl_group(topology: Topology, group: Sequence[int]) -> NcclGroup | None:
    """The group's NCCL view, or None when NCCL's model does not apply (not an NVLink GPU hierarchy, not a grid)."""
    group = tuple(group)
    return topology.memo(("__nccl_group__", group), lambda: _nccl_group(topology, group))


def _nccl_group(topology: Topology, group: tuple[int, ...]) -> NcclGroup | None:
    arch = arch_of(topology)
    if arch is None or topology.form is not Form.LEVELS or len(group) < 2:
        return None
    levels = topology.levels
    inner = levels[0]
    if inner.kind not in (LinkKind.NVSWITCH, LinkKind.NVLINK):
        return None
    if len(set(group)) != len(group):
        return None
    # The spanned sizes per level, and a check that the group is a full product over those levels.
    first = topology.coords(group[0])
    dims = [1] * len(levels)
    seen: list[set] = [set() for _ in levels]
    for d in group:
        for i, c in enumerate(topology.coords(d)):
            seen[i].add(c)
    dims = [len(s) for s in seen]
    if math.prod(dims) != len(group):
        return None
    del first
    ppn = dims[0]
    nodes = len(group) // ppn
    efficiency = _NVLINK_BW[arch][0] / _NVLINK_BW[arch][1]
    nvlink_bw = float(inner.bandwidth) * efficiency
    net_bw, net_latency, sharp = math.inf, 0.0, False
    spanned = [i for i in range(1, len(levels)) if dims[i] > 1]
    if spanned:
        sharing = 1
        sharp = True
        for i in range(1, len(levels)):
            level = levels[i]
            if i > max(spanned):
                break
            per_node = float(level.bandwidth) * ppn if level.attach == "device" else float(level.bandwidth) / sharing
            net_bw = min(net_bw, per_node * NET_EFFICIENCY)
            net_latency += 2 * float(level.latency)
            if level.kind not in (LinkKind.INFINIBAND, LinkKind.ETHERNET, LinkKind.DCN):
                return None  # NVLink across nodes (NVL72-like) is not modelled here
            if i in spanned and level.in_network_reduction != "sharp":
                sharp = False
            sharing *= dims[i]
        if not any(levels[i].in_network_reduction == "sharp" for i in spanned):
            sharp = False
    nvls = inner.in_network_reduction == "nvls" and _NVLS_EFFICIENCY[_ARCH_INDEX[arch]] > 0 and ppn > 1
    return NcclGroup(arch=arch, n=len(group), ppn=ppn, nodes=nodes, nvlink_bw=nvlink_bw, net_bw=net_bw,
                     net_latency=net_latency, nvls=nvls, sharp=sharp)


def nccl_algorithms(topology: Topology, op: Op, group: Sequence[int]) -> list[str]:
    """NCCL algorithms that run ``op`` on ``group`` (empty where NCCL's model does not apply)."""
    g = nccl_group(topology, group)
    if g is None:
        return []
    out = []
    for name in NCCL_ALGORITHMS:
        if op not in _OPS[name]:
            continue
        if name == "nvls" and not (g.nvls and (g.nodes == 1 or (g.sharp and op is Op.ALL_REDUCE))):
            continue
        if name == "nvls_tree" and not (g.nvls and g.nodes > 1 and g.ppn > 1):
            continue
        if name == "sharp" and not (g.sharp and g.nodes > 1 and not g.nvls):
            continue
        if name == "nccl_tree" and g.n < 2:
            continue
        out.append(name)
    return out


def _log2i(x: int) -> int:
    return max(0, int(x).bit_length() - 1)


def _protocol_index(protocol: str) -> int:
    return PROTOCOLS.index(protocol)


def nccl_time(g: NcclGroup, op: Op, algorithm: str, protocol: str, nbytes: float,
              fit: MultiNodeFit = MULTINODE_FIT) -> float | None:
    """Seconds of ``op`` by (algorithm, protocol) on the group, or None where NCCL does not run that pair.

    On one node this is NCCL's own model; across nodes ``fit`` (:class:`MultiNodeFit`)
    scales NVLS-tree's bandwidth, adds the Simple protocol's start-up and caps LL128.
    """
    t = _model_time(g, op, algorithm, protocol, nbytes, fit)
    if t is None:
        return None
    lat, seconds = t
    if g.nodes == 1 or float(nbytes) <= 0:
        return lat + seconds
    if protocol == "Simple":
        lat += fit.simple_latency_per_level_us * math.log2(g.nodes) * 1e-6
    elif protocol == "LL128":
        bus = 2 * (g.n - 1) / g.n if op is Op.ALL_REDUCE else (g.n - 1) / g.n
        seconds = max(seconds, float(nbytes) * bus / fit.ll128_cap(g.nodes))
    return lat + seconds


def _model_time(g: NcclGroup, op: Op, algorithm: str, protocol: str, nbytes: float,
                fit: MultiNodeFit) -> tuple[float, float] | None:
    """NCCL's model of (algorithm, protocol): (latency seconds, seconds of data), or None where it does not run."""
    p = _protocol_index(protocol)
    if algorithm == "nccl_ring":
        return _ring_time(g, op, p, float(nbytes))
    if algorithm == "nccl_tree":
        return _tree_time(g, p, float(nbytes)) if op is Op.ALL_REDUCE else None
    if p != 2:
        return None  # NVLS, NVLS tree and CollNet run Simple only
    return _in_network_time(g, op, algorithm, float(nbytes), fit)


def _rates(g: NcclGroup) -> tuple[float, float, float, float]:
    """(NVLink bytes/s per GPU, NICs' bytes/s per node, LL's cap bytes/s, network latency us) of the group."""
    multi = g.nodes > 1
    index2 = 0 if g.nodes == 1 else (1 if g.nodes == 2 else 2)
    ll_max = _LL_MAX_BW[_ARCH_INDEX[g.arch] if not multi else 0][index2] * 1e9  # multi-node: by CPU (Intel x86)
    nvlink = g.nvlink_bw if g.ppn > 1 else math.inf
    net = g.net_bw if multi else math.inf
    return nvlink, net, ll_max, g.net_latency * 1e6


def _ring_time(g: NcclGroup, op: Op, p: int, s: float) -> tuple[float, float] | None:
    """NCCL's ring (and all-to-all as point-to-point) in protocol ``p``: (latency s, data s)."""
    n, ppn, nodes, multi = g.n, g.ppn, g.nodes, g.nodes > 1
    nvlink, net, ll_max, net_lat_us = _rates(g)
    nsteps = 2 * (n - 1) if op is Op.ALL_REDUCE else (n - 1 if op in (Op.ALL_GATHER, Op.REDUCE_SCATTER) else n)
    bw = min(nvlink, net)
    if op is Op.ALL_TO_ALL:
        if p != 2:
            return None
        # point-to-point to every peer at once: in-node bytes over NVLink, the rest over the node's NICs
        local = (ppn - 1) / n * s / nvlink if ppn > 1 else 0.0
        remote = (n - ppn) / n * s * ppn / net if multi else 0.0
        lat = _BASE_LAT["ring"][2] + _HW_LAT["nvlink"]["ring"][2] + (
            _HW_LAT["net"]["ring"][2] + 2 * net_lat_us if multi else 0.0)
        return lat * 1e-6, max(local, remote)
    if p == 0:
        bw = min(ll_max, bw * 0.5)
    elif p == 1:
        bw = bw * 0.92
    algbw = bw * n / nsteps
    intra = _HW_LAT["nvlink"]["ring"][p]
    inter = _HW_LAT["net"]["tree" if ppn == 1 else "ring"][p] + net_lat_us * (2 if p == 2 else 1)
    if multi:
        intra = max(intra, _NET_OVERHEAD_US * (3 if p == 2 else 1))
    n_inter = 0 if not multi else (2 * (nodes - 1) if op is Op.ALL_REDUCE else nodes - 1)
    lat = _BASE_LAT["ring"][p] + (nsteps - n_inter) * intra + n_inter * inter
    if p == 2 and multi and op is Op.ALL_REDUCE and s / (_MAX_CHANNELS * n) >= 64:
        lat *= _RING_PLATEAU
    return lat * 1e-6, s / algbw


def _tree_time(g: NcclGroup, p: int, s: float) -> tuple[float, float]:
    """NCCL's tree all-reduce in protocol ``p``: (latency s, data s), with NCCL's correction by size."""
    nvlink, net, ll_max, net_lat_us = _rates(g)
    # NCCL's two trees over two nodes root one on each: a node's NICs carry half the data each way
    # (tuning.cc prices two-node trees at the intra-node bandwidth, bwIntra)
    bw = min(nvlink, net * (2 if g.nodes == 2 else 1)) * 0.92
    if p == 0:
        bw = min(bw / 3.8, ll_max)
    elif p == 1:
        bw = bw * (7.0 / 9.0 if g.nodes == 1 else 120.0 / 128.0)
    algbw = bw * 0.5
    log_size = _log2i(int(s) >> 6)
    if 0 <= log_size < len(_TREE_CORRECTION[p]) and int(s) >> 6:
        algbw *= _TREE_CORRECTION[p][log_size]
    intra = _HW_LAT["nvlink"]["tree"][p]
    inter = _HW_LAT["net"]["tree"][p] + net_lat_us * (2 if p == 2 else 1)
    lat = _BASE_LAT["tree"][p] + 2 * ((g.ppn - 1) * intra + _log2i(g.nodes) * inter)
    return lat * 1e-6, s / algbw


def _in_network_time(g: NcclGroup, op: Op, algorithm: str, s: float,
                     fit: MultiNodeFit) -> tuple[float, float] | None:
    """NVLS, NVLS-tree and SHARP (CollNet direct), Simple only: (latency s, data s)."""
    n, ppn, nodes, multi = g.n, g.ppn, g.nodes, g.nodes > 1
    nvlink, net, _, net_lat_us = _rates(g)
    arch = _ARCH_INDEX[g.arch]
    eff = _NVLS_EFFICIENCY[arch]
    if algorithm == "nvls":
        traffic = (ppn + 1) / ppn if op is Op.ALL_REDUCE else (ppn - 1) / ppn
        seconds = s * traffic / (nvlink * eff)
        lat = _HW_LAT["nvlink"]["nvls"][2]
        if multi:  # NVLS + SHARP: the node's NICs carry S each way, pipelined with the NVSwitch
            seconds = max(seconds, s / net)
            lat += _HW_LAT["net"]["nvls"][2] + 2 * net_lat_us
        return lat * 1e-6, seconds
    if algorithm == "nvls_tree":
        intra = s * (ppn + 1) / ppn / (nvlink * eff * fit.nvls_tree_efficiency)
        inter = s * 2 * (n - 1) / n / (net * fit.nvls_tree_efficiency * (2 if nodes <= 2 else 1))
        lat = _HW_LAT["nvlink"]["nvls_tree"][2] + 2 * _log2i(nodes) * (
            _HW_LAT["net"]["nvls_tree"][2] + 2 * net_lat_us)
        return lat * 1e-6, max(intra, inter)
    if algorithm == "sharp":
        hopper = _COLLNET_HOPPER if arch >= _ARCH_INDEX["hopper"] else 1.0
        intra = s * 2 * (ppn - 1) / ppn / nvlink if ppn > 1 else 0.0
        intra_lat = _HW_LAT["nvlink"]["collnet_direct"][2]
        lat = (2 * (min(1, ppn - 1) * intra_lat + (ppn - 1) * 0.4) + _HW_LAT["net"]["collnet_direct"][2]
               + 2 * net_lat_us)
        return lat * 1e-6, max(intra, s / net) / hopper
    return None


def nccl_best(topology: Topology, op: Op, group: Sequence[int], nbytes: float,
              algorithm: str | None = None, fit: MultiNodeFit = MULTINODE_FIT) -> tuple[str, str, float] | None:
    """(algorithm, protocol, seconds) NCCL would pick (among ``algorithm``'s protocols when named), or None.

    NCCL picks by its tuning model, which has the protocols' per-channel caps and start-up latencies
    (``fit``'s LL128 cap and Simple start-up stand for them) but not NVLS-tree's network shortfall; the
    seconds are the pick's under the whole ``fit``.
    """
    g = nccl_group(topology, group)
    if g is None:
        return None
    names = [algorithm] if algorithm else nccl_algorithms(topology, op, group)
    own = replace(fit, nvls_tree_efficiency=1.0)
    best = None
    for name in names:
        for protocol in PROTOCOLS:
            t = nccl_time(g, op, name, protocol, nbytes, own)
            if t is not None and (best is None or t < best[2]):
                best = (name, protocol, t)
    if best is None:
        return None
    return best[0], best[1], nccl_time(g, op, best[0], best[1], nbytes, fit)


def nccl_predictions(topology: Topology, op: Op, group: Sequence[int], nbytes: float,
                     fit: MultiNodeFit = MULTINODE_FIT) -> dict[str, tuple[str, float]]:
    """Per NCCL algorithm, (its best protocol, seconds) by NCCL's own tuning model: what :func:`nccl_best`
    compares to pick (no NVLS-tree network shortfall), so a table can say why the pick is not the fastest."""
    g = nccl_group(topology, group)
    if g is None:
        return {}
    own = replace(fit, nvls_tree_efficiency=1.0)
    out: dict[str, tuple[str, float]] = {}
    for name in nccl_algorithms(topology, op, group):
        times = [(protocol, t) for protocol in PROTOCOLS
                 if (t := nccl_time(g, op, name, protocol, nbytes, own)) is not None]
        if times:
            out[name] = min(times, key=lambda pt: pt[1])
    return out
