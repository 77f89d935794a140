"""How NCCL's multi-node collectives run short of its own tuning model: :class:`MultiNodeFit`, fitted.

:mod:`testbed.collectives.nccl` picks NCCL's algorithm and protocol by NCCL's
model and times the pick under this fit across nodes; the fit's category, its
refit and its leave-out errors are ``benchmarks/published/collectives.py``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["MultiNodeFit", "MULTINODE_FIT"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MultiNodeFit:
    """How NCCL's multi-node collectives run short of its tuning model (fitted, not NCCL's constants).

    NCCL's model picks the algorithm; measured across nodes, NVLS-tree runs
    below its modelled bandwidth, every Simple-protocol collective pays a
    pipeline start-up the model leaves out, and LL128 runs at a bandwidth that
    is lower on three nodes or more than on two. Four numbers, fitted together
    over
    every published multi-node nccl-tests case of
    ``benchmarks/published/nccl_tests.yaml`` (sweeps of 1 MiB to 8 GiB on 2 to
    8 nodes), with the fit and its leave-out errors printed by
    ``benchmarks/published/collectives.py``:

    - ``nvls_tree_efficiency``: NVLS-tree's rate across nodes over NCCL's
      model of it, on its NVSwitch part (one node's reduction waits on the
      network's) and on its network part alike (NCCL runs it on fewer channels
      than saturate the NICs: ``NCCL_MIN_CTAS=24`` raises 365 to over 380 GB/s
      on 4 x 8 H100, NCCL maintainer, NVIDIA/nccl-tests#309);
    - ``simple_latency_per_level_us``: start-up of a Simple-protocol
      collective per level of the tree, ``b * log2(nodes)`` microseconds (the
      pipeline fills one tree level after another);
    - ``ll128_busbw``, ``ll128_busbw_deep``: LL128's bus bandwidth (GB/s
      per GPU) on two nodes and on three or more. NCCL's tuning tables index
      every per-channel cap by the same node classes (``index2``: one node,
      two, more; ``perChMaxTreeLL128Bws`` for Hopper 36.7, 36.7, 29.0 GB/s per
      channel, ``src/graph/tuning.cc``), and LL128 runs slower in the deeper
      class: the 2-node sweeps' LL128 sizes reach 150+ GB/s, the 8-node
      sweep's (1-8 MiB) lie on one line of about 69 GB/s. The measured drop
      is larger than NCCL's table has it, so the two rates are fitted.

    These four fit 5.3% / 24.1% (median / max; left out 5.5% / 25.3%); the
    five- and three-number forms compared with them: docs/collectives.md,
    "Across nodes: what NCCL's model leaves out".
    """

    nvls_tree_efficiency: float = 1.0
    simple_latency_per_level_us: float = 0.0
    ll128_busbw: float = math.inf
    ll128_busbw_deep: float = math.inf

    def __post_init__(self) -> None:
        if not 0 < self.nvls_tree_efficiency <= 1:
            raise ValueError("nvls_tree_efficiency must be in (0, 1]")
        if self.simple_latency_per_level_us < 0 or self.ll128_busbw <= 0 or self.ll128_busbw_deep <= 0:
            raise ValueError("simple_latency_per_level_us must be >= 0, ll128_busbw and ll128_busbw_deep > 0")

    def ll128_cap(self, nodes: int) -> float:
        """LL128's bus bandwidth across ``nodes`` (bytes/s): NCCL's node class, two nodes or more."""
        return (self.ll128_busbw if nodes <= 2 else self.ll128_busbw_deep) * 1e9


#: The fit over benchmarks/published/nccl_tests.yaml (``python benchmarks/published/collectives.py``).
MULTINODE_FIT = MultiNodeFit(nvls_tree_efficiency=0.857, simple_latency_per_level_us=23.516, ll128_busbw=161.25,
                             ll128_busbw_deep=111.25)
