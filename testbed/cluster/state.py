"""What testbed keeps on disk about its clusters: state files of kept clusters and owner records of namespaces.

Everything lives in one state folder (``$TESTBED_CLUSTER_STATE``, default
``/run/testbed-cluster``, a tmpfs that a reboot empties together with the
namespaces):

- ``NAME.json``: a kept cluster (``testbed cluster up``), written once it is
  fully built: its topology, scale and MTU. A kept cluster's namespaces
  without it are a build in progress, or one whose builder died;
- ``owners/NS.json``: the owner record of namespace ``NS``, written just
  before ``ip netns add`` (removed again if that fails) and completed right
  after it with the namespace file's inode (so a namespace of the same name
  made later by someone else is not ours), with the token of the process
  that built it; signals are held over the three steps. testbed lists, and ever removes, only the
  namespaces whose record it wrote; another tool's ``tbc-...`` namespace is
  left alone.

Names are checked (:func:`testbed.cluster.spec.check_name`) before a path is
made from them, and every path is checked to resolve inside the folder.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

from testbed.cluster.spec import check_name
from testbed.errors import InputError

__all__ = ["state_dir", "state_path", "write_state", "read_state", "remove_state", "netns_inode",
           "write_owner", "owner_record", "remove_owner", "recorded_namespaces", "name_held"]

#: Where ``ip netns`` keeps its namespaces' files (iproute2's NETNS_RUN_DIR).
NETNS_DIR = Path("/run/netns")
_OWNERS = "owners"
_LOCKS = "locks"


def state_dir() -> Path:
    """The state folder (``$TESTBED_CLUSTER_STATE``, default ``/run/testbed-cluster``)."""
    return Path(os.environ.get("TESTBED_CLUSTER_STATE", "/run/testbed-cluster"))


def _inside(folder: Path, file_name: str, field: str) -> Path:
    """``folder / file_name``, refused unless it resolves to a file directly inside ``folder`` (no link out)."""
    path = folder / file_name
    if path.resolve().parent != folder.resolve() or path.resolve().name != file_name:
        raise InputError(f"{path} does not resolve inside the state folder {folder} (a link?); remove it or set "
                         "TESTBED_CLUSTER_STATE to another folder", field=field)
    return path


def state_path(name: str, field: str = "name") -> Path:
    """The state file of kept cluster ``name`` (the name checked first)."""
    return _inside(state_dir(), f"{check_name(name, field)}.json", field)


def write_state(name: str, topology: str, scale: float, mtu: int) -> Path:
    from testbed.output import write_atomic

    state_dir().mkdir(parents=True, exist_ok=True)
    path = state_path(name)
    write_atomic(path, json.dumps({"topology": topology, "scale": scale, "mtu": mtu}))
    return path


def read_state(name: str, field: str = "name") -> dict[str, object] | None:
    """Kept cluster ``name``'s state (``topology``, ``scale``, ``mtu``), None when it has none; a file that is
    not what :func:`write_state` writes raises InputError naming it."""
    path = state_path(name, field)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InputError(f"cluster `{name}`'s state file is unreadable ({type(exc).__name__}); `testbed cluster down "
                         f"{name}` removes the cluster and it", file=str(path), field=field) from None
    ok = (isinstance(data, dict) and isinstance(data.get("topology"), str)
          and isinstance(data.get("scale"), (int, float)) and not isinstance(data["scale"], bool)
          and math.isfinite(data["scale"]) and data["scale"] > 0
          and isinstance(data.get("mtu"), int) and not isinstance(data["mtu"], bool))
    if not ok:
        raise InputError(f"cluster `{name}`'s state file is not testbed's (it has topology: str, scale: positive "
                         f"number, mtu: int); `testbed cluster down {name}` removes the cluster and it",
                         file=str(path), field=field)
    return data


def remove_state(name: str) -> None:
    state_path(name).unlink(missing_ok=True)


def netns_inode(ns: str) -> int | None:
    """The inode of namespace ``ns``'s file (it identifies that namespace), None when there is none."""
    try:
        return (NETNS_DIR / ns).stat().st_ino
    except OSError:
        return None


def _owner_path(ns: str) -> Path:
    from testbed.cluster.spec import parse_namespace

    if parse_namespace(ns) is None:
        raise ValueError(f"{ns!r} is not a namespace name of this project")
    return _inside(state_dir() / _OWNERS, f"{ns}.json", "namespace")


def write_owner(ns: str, builder: str, *, made: bool = True) -> None:
    """Record that testbed made namespace ``ns`` (just now, in process ``builder``); ``made`` False: that it is about
    to (``ip netns add`` next), so a SIGKILL between the two leaves no namespace without a record."""
    from testbed.output import write_atomic

    (state_dir() / _OWNERS).mkdir(parents=True, exist_ok=True)
    write_atomic(_owner_path(ns), json.dumps({"namespace": ns, "inode": netns_inode(ns) if made else None,
                                              "builder": builder}))


def owner_record(ns: str) -> dict[str, object] | None:
    """Namespace ``ns``'s owner record, if testbed wrote one for the namespace now under that name."""
    try:
        data = json.loads(_owner_path(ns).read_text())
    except (OSError, ValueError, InputError):
        return None
    if not isinstance(data, dict) or data.get("namespace") != ns:
        return None
    return data if data.get("inode") in (None, netns_inode(ns)) else None


def remove_owner(ns: str, builder: str | None = None) -> None:
    """Remove namespace ``ns``'s owner record; with ``builder``, only a record that process wrote (a build that
    lost the name to another leaves the winner's record)."""
    if builder is not None and (owner_record(ns) or {}).get("builder") != builder:
        return
    with contextlib.suppress(OSError, ValueError, InputError):
        _owner_path(ns).unlink(missing_ok=True)


@contextlib.contextmanager
def name_held(name: str):
    """Hold cluster ``name`` against every other testbed process on the machine (an exclusive ``flock`` on
    ``locks/NAME.lock`` in the state folder) while one checks the name is free and builds it: two concurrent
    ``cluster up`` of one name build one cluster, the second finds it taken."""
    import fcntl

    folder = state_dir() / _LOCKS
    folder.mkdir(parents=True, exist_ok=True)
    with open(_inside(folder, f"{check_name(name)}.lock", "name"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def recorded_namespaces() -> list[str]:
    """The namespaces with an owner record in the folder (whether or not they still exist)."""
    folder = state_dir() / _OWNERS
    if not folder.is_dir():
        return []
    return sorted(p.name[:-len(".json")] for p in folder.glob("*.json"))
