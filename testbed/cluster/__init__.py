"""An emulated cluster on one machine: network namespaces, bridges and shaped veth links.

:mod:`testbed.cluster.spec` (pure) turns a levels topology into namespaces,
bridges, links and rates; :mod:`testbed.cluster.netns` builds and removes
them with ``ip`` and ``tc``, each link end's queue as
:mod:`testbed.cluster.queue` writes it (sparse packets first); :mod:`testbed.cluster.probe` measures the
host's TCP on it (loopback throughput, per-hop latency) for the simulator.
"""

from testbed.cluster.spec import ClusterSpec, NodeSpec, ShapedLink, cluster_spec, goodput_fraction

__all__ = ["ClusterSpec", "NodeSpec", "ShapedLink", "cluster_spec", "goodput_fraction"]
