"""Multi-process runs listen on loopback only: the coordinator and every gloo socket of the workers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from helpers import CHILD_XLA_FLAGS
from test_launch import _ours as _workers  # live processes whose environment carries a token

PLAN = """
name: small-dp
model: {kind: gpt, layers: 1, d_model: 16, heads: 2, d_ff: 32, seq_len: 8, vocab: 32}
batch: {global_batch: 8, microbatches: 1}
mesh: {data: 2, fsdp: 1, tensor: 1, stage: 1}
"""


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    except OSError:
        pass
    return inodes


def _address(hex_address: str) -> str:
    """``0100007F:1F90`` (/proc/net/tcp, little-endian words) -> ``127.0.0.1``; IPv6 as 32 hex digits."""
    host = hex_address.rpartition(":")[0]
    raw = bytes.fromhex(host)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return ".".join(str(b) for b in words)
    if words[:12] == b"\0" * 10 + b"\xff\xff":  # IPv4-mapped IPv6
        return ".".join(str(b) for b in words[12:])
    return words.hex()


def _listening(inodes: set[str]) -> set[str]:
    """Local addresses of the LISTEN sockets among ``inodes``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                found.add(_address(fields[1]))
    return found


def test_workers_listen_on_loopback_only(tmp_path: Path) -> None:
    plan = tmp_path / "dp.yaml"
    plan.write_text(PLAN)
    token = f"testbed-listen-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-m", "testbed.cli", "run", "--plan", str(plan), "--devices",
                             "emulated:2", "--processes", "2", "--steps", "30", "--json", "--timeout", "200"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "XLA_FLAGS": CHILD_XLA_FLAGS, "TESTBED_LISTEN_TOKEN": token})
    seen: set[str] = set()
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        for pid in _workers(token):
            if pid != proc.pid:
                seen |= _listening(_socket_inodes(pid))
        time.sleep(0.1)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    assert seen, "no listening socket of the workers was seen"
    assert seen <= {"127.0.0.1"}, f"workers listen beyond loopback: {sorted(seen)}"
