"""Pictures: the topology drawing (and shared matplotlib setup for other plots).

Matplotlib is imported lazily with the Agg backend so that commands without
``--png`` stay fast and nothing needs a display. Every figure is written
atomically.
"""

from __future__ import annotations

from pathlib import Path

from testbed.output import atomic_path
from testbed.text import plot_label
from testbed.topology import Form, LinkKind, Topology
from testbed.units import format_bandwidth

__all__ = ["pyplot", "save_figure", "draw_topology", "LINK_COLOURS"]

LINK_COLOURS = {
    LinkKind.NVLINK: "#76b900", LinkKind.NVSWITCH: "#4c9a2a", LinkKind.PCIE: "#1f77b4",
    LinkKind.ETHERNET: "#ff7f0e", LinkKind.INFINIBAND: "#d62728", LinkKind.ICI: "#9467bd",
    LinkKind.DCN: "#8c564b", LinkKind.HOST: "#7f7f7f",
}


def pyplot():
    """matplotlib.pyplot on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    """Save a matplotlib figure atomically as PNG and close it."""
    plt = pyplot()
    with atomic_path(path, "png") as tmp:
        fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format="png")
    plt.close(fig)
    return Path(path)


def _layout(topology: Topology) -> dict:
    import networkx as nx

    graph = topology.graph
    dims = [l for l in topology.levels if not l.switched]  # a multi-slice torus: the slices' dims
    if topology.form is Form.TORUS and len(dims) <= 3:
        pos = {}
        sizes = [l.size for l in dims] + [1, 1]
        for d in range(topology.num_devices):
            c = list(topology.coords(d)) + [0, 0]
            s = c[len(dims)] if topology.slice_level is not None else 0
            c = c[:len(dims)] + [0, 0]
            # Draw z planes side by side so a 3-D torus stays readable; slices one below another.
            pos[d] = (c[0] + c[2] * (sizes[0] + 1), -c[1] - s * (sizes[1] + 1))
        if topology.slice_level is not None and topology.levels[-1].size > 1:  # the DCN switch, left of them
            pos[f"{topology.levels[-1].name}0"] = (-2.0, -(topology.levels[-1].size * (sizes[1] + 1) - 2) / 2)
        return pos
    if topology.form is Form.LEVELS:
        return _tree_layout(topology)
    return nx.spring_layout(graph, seed=0)


def _tree_layout(topology: Topology) -> dict:
    """Devices on the bottom row, each tier's switches above the devices they join."""
    pos = {d: (float(d), 0.0) for d in range(topology.num_devices)}
    for node, data in topology.graph.nodes(data=True):
        if data.get("kind") != "switch":
            continue
        k = topology.level_names.index(data["level"])
        block = 1
        for level in topology.levels[: k + 1]:
            block *= level.size
        index = int(node[len(data["level"]):])
        pos[node] = (index * block + (block - 1) / 2.0, float(k + 1))
    return pos


def draw_topology(topology: Topology, path: str | Path) -> Path:
    """Devices, switches and links coloured by kind, with a bandwidth legend."""
    import networkx as nx

    plt = pyplot()
    graph = topology.graph
    n_nodes = graph.number_of_nodes()
    width = min(24.0, max(6.0, n_nodes ** 0.5 * 1.6))
    fig, ax = plt.subplots(figsize=(width, width * 0.6))
    pos = _layout(topology)
    devices = [n for n, d in graph.nodes(data=True) if d.get("kind") == "device"]
    switches = [n for n, d in graph.nodes(data=True) if d.get("kind") == "switch"]
    legend = {}
    for (u, v, data) in graph.edges(data=True):
        kind = LinkKind(data["kind"])
        key = f"{kind.value} {format_bandwidth(data['bandwidth'])}"
        colour = LINK_COLOURS[kind]
        legend[key] = colour
        nx.draw_networkx_edges(graph, pos, edgelist=[(u, v)], edge_color=colour, ax=ax,
                               width=1.0 + min(3.0, data["bandwidth"] / 1e11))
    small = n_nodes <= 80
    nx.draw_networkx_nodes(graph, pos, nodelist=devices, node_color="#2b6cb0", node_shape="s",
                           node_size=300 if small else 40, ax=ax)
    nx.draw_networkx_nodes(graph, pos, nodelist=switches, node_color="#e2e8f0", edgecolors="#4a5568",
                           node_shape="o", node_size=500 if small else 60, ax=ax)
    if small:
        nx.draw_networkx_labels(graph, pos, labels={d: str(d) for d in devices}, font_color="white", font_size=7, ax=ax)
        nx.draw_networkx_labels(graph, pos, labels={s: plot_label(s, 24) for s in switches}, font_size=6, ax=ax)
    for key, colour in legend.items():
        ax.plot([], [], color=colour, linewidth=3, label=key)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), title="links (per direction)", fontsize=8)
    ax.set_title(plot_label(f"{topology.name}: {topology.num_devices} x {topology.device.name}"
                            + (f"  ({', '.join(topology.level_names)})" if topology.levels else ""), 160))
    ax.set_axis_off()
    return save_figure(fig, path)
