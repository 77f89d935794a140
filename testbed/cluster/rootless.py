"""Rootless clusters: a user namespace where the kernel allows one, in which this process is root.

Building namespaces, veths and qdiscs needs CAP_NET_ADMIN. An unprivileged
user can get it inside a new user namespace (``unshare --user
--map-root-user``) where the kernel allows unprivileged user namespaces
(``user.max_user_namespaces`` > 0 and no distribution switch such as
``kernel.unprivileged_userns_clone = 0`` or AppArmor's restriction).
Everything built in it - the cluster's network namespaces, their links and
qdiscs - belongs to that user namespace and disappears with the command, and
``ip netns`` needs a private ``/run`` (a tmpfs in a new mount namespace).

So a one-shot command (``testbed collective OP --execute cluster --scale
S``) re-executes itself inside one (:func:`reexec_rootless`), while a kept
cluster (``testbed cluster up`` and later commands with ``--cluster NAME``)
cannot outlive the command that made it: for those the message says how to
run a whole session inside one namespace. :func:`userns_problem` tries it
(an ``unshare`` of ``true``), so the message says what this kernel does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from testbed.interpreter import python_argv, python_env

__all__ = ["ENV", "userns_problem", "rootless_argv", "reexec_rootless", "session_recipe"]

#: Set in the re-executed command, so it never re-executes again.
ENV = "TESTBED_ROOTLESS"
_UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--mount"]
_PRIVATE_RUN = "mount -t tmpfs none /run && exec \"$0\" \"$@\""


def session_recipe() -> str:
    """The command that opens a shell with a private ``/run`` as root of a new user namespace."""
    return f"{' '.join(_UNSHARE)} sh -c 'mount -t tmpfs none /run && exec \"${{SHELL:-sh}}\"'"


def userns_problem() -> str | None:
    """Why this user cannot enter a user namespace that maps it to root, or None when it can (tried)."""
    if shutil.which("unshare") is None:
        return "`unshare` (util-linux) is not installed"
    limit = Path("/proc/sys/user/max_user_namespaces")
    try:
        if limit.exists() and int(limit.read_text().strip() or 0) == 0:
            return "user namespaces are disabled (user.max_user_namespaces = 0)"
    except (OSError, ValueError):
        pass
    try:
        tried = subprocess.run([*_UNSHARE, "true"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`unshare --user` failed: {exc}"
    if tried.returncode != 0:
        return f"the kernel refuses an unprivileged user namespace: {tried.stderr.strip() or tried.returncode}"
    return None


def rootless_argv(argv: list[str]) -> list[str]:
    """``argv`` (a command line) run as root of a new user namespace, with private network and ``/run``."""
    return [*_UNSHARE, "sh", "-c", _PRIVATE_RUN, *argv]


def reexec_rootless() -> bool:
    """Replace this process by itself inside a new user namespace, if that is allowed and not done yet.

    Returns False (and does nothing) when it is not possible; never returns otherwise.
    """
    script = sys.argv[0] if sys.argv else ""
    started_as_testbed = Path(script).name == "testbed" or script.endswith(str(Path("testbed", "cli", "__main__.py")))
    if os.environ.get(ENV) or not started_as_testbed or userns_problem() is not None:
        return False  # (a `main([...])` called from Python, e.g. a test, is never re-executed)
    # The same command line, whether it was started as the `testbed` script or `python -m testbed.cli`.
    # ... without the working directory on sys.path (testbed.interpreter).
    argv = rootless_argv(python_argv("-m", "testbed.cli", *sys.argv[1:]))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, {**python_env(), ENV: "1"})
    return True  # pragma: no cover - execvpe does not return
