"""Bytes NCCL's algorithms put on each link of a group: per GPU over its NVLink and over the network.

The link loads of :mod:`testbed.collectives.nccl`'s algorithms, for the
simulator's shared-link accounting (:func:`testbed.collectives.timing.link_loads`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from testbed.collectives.nccl import NcclGroup, nccl_group
from testbed.collectives.ops import Op
from testbed.topology import Topology

__all__ = ["nccl_traffic", "nccl_link_loads"]


def nccl_traffic(g: NcclGroup, op: Op, algorithm: str) -> tuple[float, float]:
    """(bytes per GPU over its NVLink, bytes per GPU over the network) per byte of the collective, each way."""
    n, ppn = g.n, g.ppn
    multi = g.nodes > 1
    if algorithm in ("nvls", "nvls_tree"):
        intra = (ppn + 1) / ppn if op is Op.ALL_REDUCE else (ppn - 1) / ppn
        inter = (1.0 if algorithm == "nvls" else 2.0 * (n - 1) / n / (2 if g.nodes <= 2 else 1)) / ppn
        return intra, inter if multi else 0.0
    if algorithm == "sharp":
        return 2 * (ppn - 1) / ppn, 1.0 / ppn
    if op is Op.ALL_TO_ALL:
        return (ppn - 1) / n, (n - ppn) / n if multi else 0.0
    factor = 2 * (n - 1) / n if op is Op.ALL_REDUCE else (n - 1) / n
    if algorithm == "nccl_tree":
        factor = 2.0
    return factor if ppn > 1 else 0.0, factor if multi else 0.0


def nccl_link_loads(topology: Topology, op: Op, group: Sequence[int], nbytes: float, algorithm: str) -> dict:
    """Bytes on each directed link of the group's GPUs (their NVLink and NIC links, up and down)."""
    g = nccl_group(topology, group)
    intra, inter = nccl_traffic(g, op, algorithm)
    loads: dict = {}
    s = float(nbytes)
    levels = topology.levels
    blocks = [math.prod(l.size for l in levels[: k + 1]) for k in range(len(levels))]
    spanned = [k for k, level in enumerate(levels)
               if level.size > 1 and len({d // (blocks[k] // level.size) % level.size for d in group}) > 1]
    for d in group:
        for k in spanned:
            per_gpu = (intra if k == 0 else inter) * s
            if per_gpu <= 0:
                continue
            level = levels[k]
            switch = f"{level.name}{d // blocks[k]}"
            below = d if (k == 0 or level.attach == "device") else f"{levels[k - 1].name}{d // blocks[k - 1]}"
            for link in ((below, switch), (switch, below)):
                loads[link] = loads.get(link, 0.0) + per_gpu
    return loads
