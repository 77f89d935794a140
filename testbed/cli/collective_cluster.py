"""`testbed collective OP --execute cluster[:NAME]`: time JAX's collective on an emulated cluster.

``cluster:NAME`` runs on a cluster ``testbed cluster up NAME`` built (its
topology must be ``--topology``); plain ``cluster`` builds one from
``--topology`` at ``--scale`` for this command only and removes it after
(also on Ctrl-C and SIGTERM; after a SIGKILL the next build removes it).
One worker per node runs in its namespace; the measured time (median over
``--repeats`` calls of the slowest process) is shown beside the simulator's
price of the emulated topology with gloo's algorithm (docs/cluster.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from typing import Any

from testbed.cluster import netns
from testbed.cluster.spec import ClusterSpec, cluster_spec
from testbed.collectives.ops import Op
from testbed.errors import InputError
from testbed.text import markup
from testbed.topology import Topology
from testbed.units import format_bandwidth, format_bytes, format_time

__all__ = ["is_cluster", "execute_on_cluster", "render_cluster_execution"]

_OPS = (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER)


def is_cluster(text: str | None) -> bool:
    return text is not None and (text == "cluster" or text.startswith("cluster:"))


@contextlib.contextmanager
def _cluster(text: str, topology: Topology, scale: float | None) -> Iterator[tuple[ClusterSpec, str]]:
    from testbed.cli.cluster import require_privilege, saved_spec

    name = text.partition(":")[2]
    if name:
        spec = saved_spec(name)
        if spec.topology.name != topology.name:
            raise InputError(f"cluster `{name}` was built from {spec.topology.name}, not {topology.name}; pass "
                             f"--topology {spec.topology.name}", field="topology")
        if scale is not None and scale != spec.scale:
            raise InputError(f"cluster `{name}` runs at scale {spec.scale:g}; leave --scale out", field="scale")
        require_privilege("execute")
        yield spec, "keep"
        return
    if scale is None:
        raise InputError("--execute cluster builds a cluster for this command: give --scale (e.g. 0.01 runs "
                         "100 Gb/s links at 1 Gb/s), or use a built one with --execute cluster:NAME", field="scale")
    spec = cluster_spec(topology, name=f"c{os.getpid()}", scale=scale)
    require_privilege("execute", one_shot=True)
    with netns.ephemeral(spec) as owner:
        yield spec, owner


def execute_on_cluster(args: argparse.Namespace, topology: Topology, op: Op, groups: list, nbytes: float
                       ) -> dict[str, Any]:
    """Measured and predicted ``op`` of ``nbytes`` over every device of the emulated cluster."""
    if op not in _OPS:
        raise InputError(f"--execute cluster times {', '.join(map(str, _OPS))}, not {op}", field="execute")
    if len(groups) != 1 or len(groups[0]) != topology.num_devices:
        raise InputError(f"--execute cluster runs one collective over every device; use --over all, not "
                         f"--over {args.over}", field="over")
    if args.repeats < 1:
        raise InputError(f"must be at least 1, got {args.repeats}", field="repeats")
    from testbed.runner.on_cluster import collective_sweep

    with _cluster(args.execute, topology, args.scale) as (spec, owner):
        sweep = collective_sweep(spec, owner, str(op), [int(nbytes)], repeats=args.repeats)
    row = sweep["rows"][0]
    return {**sweep, **row, "cluster": spec.name, "kept": owner == "keep", "ok": row["ok"]}


def render_cluster_execution(console: Any, run: dict[str, Any]) -> None:
    """Measured beside predicted on the emulated cluster."""
    from rich.table import Table

    rates = ", ".join(format_bandwidth(r / 8) for r in run["link_rate_bps"])
    console.print(f"executed {run['op']} on emulated cluster [bold]{markup(run['cluster'])}[/]: {run['nodes']} nodes, "
                  f"{run['ranks']} ranks, links {rates} (scale {run['scale']:g}), {format_bytes(run['bytes'])}")
    table = Table()
    for column in ("", "time", "busbw"):
        table.add_column(column, justify="left" if not column else "right")
    table.add_row(f"predicted ({run['algorithm']}, gloo's)", format_time(run["predicted_s"]),
                  format_bandwidth(run["predicted_busbw"]))
    table.add_row("measured (median of the slowest process)", format_time(run["time_s"]),
                  format_bandwidth(run["busbw"]))
    console.print(table)
    console.print(f"error {run['error']:+.1%}; overhead {format_time(run['overhead_s'])} a round, fitted to a "
                  f"{run['overhead_measured_at_bytes']} B call of {format_time(run['overhead_call_s'])}; check: "
                  f"{'ok' if run['ok'] else 'MISMATCH'}")
