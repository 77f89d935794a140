"""`testbed cluster up|down|status`: an emulated cluster on this machine (network namespaces, shaped links).

``up --topology T --scale S [--name N]`` builds one namespace per node of a
levels topology, a bridge per switch and tbf shaping both ways at the
levels' bandwidths times ``S``, sparse packets first where the kernel allows (the output says which queue the
links have; docs/cluster.md); it stays until ``down N``
(or ``down --all``, which removes every cluster of this project, including
leftovers of killed commands). ``status`` lists them. Commands that run on a
cluster (``testbed collective OP --execute cluster:N``) read the cluster's
topology and scale from a small state file ``up`` writes (in
``$TESTBED_CLUSTER_STATE``, default ``/run/testbed-cluster``).

``up`` and ``down`` need root or CAP_NET_ADMIN; without, they exit 2 saying so.
Names are checked before any file or namespace is touched; every signal
during ``up`` removes what it built; only namespaces testbed recorded as its
own are listed or removed (:mod:`testbed.cluster.state`).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from testbed.cluster import netns, state
from testbed.cluster.signals import leaving_on_signals, signals_held
from testbed.cluster.spec import ClusterSpec, check_name, cluster_spec
from testbed.cluster.state import state_dir
from testbed.errors import InputError
from testbed.output import CommandResult
from testbed.text import markup
from testbed.topology.io import load_topology
from testbed.units import format_bandwidth

__all__ = ["add_arguments", "execute", "state_dir", "saved_spec", "require_privilege"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("up", "down", "status"), help="build, remove or list clusters")
    parser.add_argument("name", nargs="?", default="tb", help="the cluster's name (1-12 of a-z0-9; default tb)")
    parser.add_argument("--topology", default=None, help="with up: a levels topology (bundled name or YAML path)")
    parser.add_argument("--scale", type=float, default=None,
                        help="with up: link rate = level bandwidth x SCALE (0.01: 100 Gb/s runs at 1 Gb/s); every "
                             "link must come out at 8 kb/s..100 Gb/s, what tc shapes")
    parser.add_argument("--mtu", type=int, default=1500, help="with up: the links' MTU in bytes (default 1500)")
    parser.add_argument("--all", action="store_true", help="with down: every cluster of this project, leftovers too")


def require_privilege(field: str = "cluster", *, one_shot: bool = False) -> None:
    """Exit 2 (an InputError) naming what is missing when this process cannot build namespaces.

    ``one_shot`` (a command that builds and removes its own cluster): without privilege, re-execute the
    command as root of a new user namespace where the kernel allows it (:mod:`testbed.cluster.rootless`).
    """
    problem = netns.privilege_problem()
    if problem and one_shot:
        from testbed.cluster import rootless

        rootless.reexec_rootless()  # returns only when that is not possible
    if problem:
        raise InputError(f"an emulated cluster cannot be built here: {problem}", field=field)


def saved_spec(name: str, field: str = "execute") -> ClusterSpec:
    """The spec of a cluster ``testbed cluster up`` built, from its state file (the name checked first)."""
    check_name(name, field)
    kept = {c.name for c in netns.clusters() if c.owner == "keep" and c.complete}
    saved = state.read_state(name, field) if name in kept else None
    if saved is None:
        known = ", ".join(sorted(kept)) or "none"
        raise InputError(f"no cluster `{name}` is up (up: {known}); build it with `testbed cluster up {name} "
                         "--topology T --scale S`", field=field)
    return cluster_spec(load_topology(str(saved["topology"])), name=name, scale=float(saved["scale"]),  # type: ignore[arg-type]
                        mtu=int(saved["mtu"]))  # type: ignore[call-overload]


def _topology_source(text: str) -> str:
    """A bundled name as given, a YAML path made absolute (later commands run elsewhere)."""
    path = Path(text)
    return str(path.resolve()) if path.suffix in (".yaml", ".yml") and path.exists() else text


def _up(args: argparse.Namespace) -> dict[str, object]:
    check_name(args.name)
    if args.topology is None or args.scale is None:
        raise InputError("up needs --topology (a levels topology) and --scale (e.g. 0.01)", field="topology")
    spec = cluster_spec(load_topology(args.topology), name=args.name, scale=args.scale, mtu=args.mtu)
    require_privilege()
    with state.name_held(spec.name):  # the check and the build as one: a concurrent `up` waits, then finds it taken
        return _build_kept(spec, args.topology)


def _build_kept(spec: ClusterSpec, topology: str) -> dict[str, object]:
    """Build kept cluster ``spec`` unless its name is taken (the caller holds the name): ``up``'s result."""
    removed = netns.remove_leftovers()
    if any(c.name == spec.name for c in netns.clusters()):
        raise InputError(f"a cluster `{spec.name}` is already up (or being built); `testbed cluster down {spec.name}` "
                         "first or pick another name", field="name")
    with leaving_on_signals():  # any signal from here on removes what was built: no half-built cluster
        try:
            made = netns.build(spec, "keep")
        except netns.ClusterError as exc:
            raise InputError(f"building cluster `{spec.name}` failed, nothing of it is left: {exc}",
                             field="name") from None
        try:
            state.write_state(spec.name, _topology_source(topology), spec.scale, spec.mtu)
            queue = netns.queue_in_use(spec, "keep")
        except BaseException:
            with signals_held():
                netns.remove(spec.name, "keep")
                state.remove_state(spec.name)
            raise
    return {"action": "up", "cluster": spec.to_dict(), "namespaces": made, "removed_leftovers": removed,
            "queue": queue}


def _down(args: argparse.Namespace) -> dict[str, object]:
    if not args.all:
        check_name(args.name)
    require_privilege()
    if args.all:
        count = netns.remove_all()
        folder = state.state_dir()
        for path in folder.glob("*.json") if folder.is_dir() else []:
            with contextlib.suppress(InputError):
                state.remove_state(check_name(path.stem))
        return {"action": "down", "all": True, "namespaces_removed": count}
    count = netns.remove(args.name)
    state.remove_state(args.name)  # testbed's own file, under the state folder: a stale one goes too
    if count == 0:
        raise InputError(f"no cluster `{args.name}` is up; `testbed cluster status` lists them", field="name")
    return {"action": "down", "name": args.name, "namespaces_removed": count}


def _status() -> dict[str, object]:
    rows = []
    for c in netns.clusters():
        saved, problem = None, None
        if c.owner == "keep":
            try:
                saved = state.read_state(c.name)
            except InputError as exc:
                problem = exc.render()
        rows.append({"name": c.name, "owner": c.owner, "owner_alive": c.alive, "namespaces": list(c.namespaces),
                     "nodes": sum(1 for ns in c.namespaces if not ns.endswith("-sw")), "saved": saved,
                     "complete": c.complete, "state_problem": problem})
    return {"action": "status", "clusters": rows}


def execute(args: argparse.Namespace) -> CommandResult:
    if args.action == "up":
        data = _up(args)
    elif args.action == "down":
        data = _down(args)
    else:
        data = _status()

    def render(console) -> None:
        if args.action == "up":
            spec = data["cluster"]
            rates = sorted({link["rate_bps"] for link in spec["links"]})
            console.print(f"cluster [bold]{markup(spec['name'])}[/] up: {len(spec['nodes'])} nodes of "
                          f"{markup(spec['topology'])} at "
                          f"scale {spec['scale']:g}, links {', '.join(format_bandwidth(r / 8) for r in rates)}, "
                          f"{len(data['namespaces'])} namespaces")
            queue = data["queue"]
            console.print(f"queue: {queue['kind']}, {queue['limit_bytes']} bytes a link end"
                          + (f", IPv4 packets under {queue['sparse_below_bytes']} bytes first"
                             if queue["kind"] == "sparse-first" else f" ({markup(str(queue['why']))})"))
        elif args.action == "down":
            console.print(f"removed {data['namespaces_removed']} namespace(s)")
        else:
            if not data["clusters"]:
                console.print("no emulated cluster is up")
            for c in data["clusters"]:
                state = "running" if c["owner_alive"] else "gone"
                owner = "kept" if c["owner"] == "keep" else f"owner {c['owner']} ({state})"
                if not c["complete"]:
                    owner += ", being built (or its build stopped)"
                console.print(f"{markup(c['name'])}: {c['nodes']} nodes, {owner}"
                              + (f"; {markup(c['state_problem'], 300)}" if c["state_problem"] else ""))

    return CommandResult(data, render)
