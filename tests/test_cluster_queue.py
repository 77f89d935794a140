"""A link end's queue (testbed.cluster.queue): the tc commands of the sparse-first tree and of the FIFO, pure.

The tree built for real, its fallback to the FIFO where htb is refused, and teardown are in
tests/test_cluster_netns.py (root only)."""

from __future__ import annotations

import pytest

from testbed.cluster import queue
from testbed.cluster.netns import bucket_bytes


def _after(command: list[str], word: str) -> str:
    return command[command.index(word) + 1]


@pytest.mark.parametrize("rate", [1e7, 3e7, 1e8, 1e10])
def test_sparse_first_keeps_tbfs_rate_bucket_and_queue(rate):
    """tbf at the root with the FIFO's own rate, bucket and limit (50 ms of the rate plus the bucket, what
    ``latency 50ms`` gave); under it htb with two classes, each a bfifo of that same limit."""
    bucket = bucket_bytes(rate, 1500)
    fifo = queue.fifo_commands("ns", "eth0", rate, bucket)
    tree = queue.sparse_first_commands("ns", "eth0", rate, bucket, 1500)
    assert len(fifo) == 1 and tree[0] == fifo[0]
    tbf = tree[0]
    assert tbf[tbf.index("root"):tbf.index("tbf") + 1] == ["root", "handle", "1:", "tbf"]
    assert _after(tbf, "rate") == f"{int(rate)}bit" and _after(tbf, "burst") == str(bucket)
    assert int(_after(tbf, "limit")) == int(rate / 8 * 0.05) + bucket == queue.queue_bytes(rate, bucket)
    htb = tree[1]
    assert _after(htb, "parent") == "1:1" and _after(htb, "handle") == "10:" and "htb" in htb
    assert _after(htb, "default") == "2"  # what no filter matches is bulk
    classes = [c for c in tree if "class" in c]
    assert [(_after(c, "classid"), _after(c, "prio")) for c in classes] == [("10:1", "0"), ("10:2", "1")]
    for c in classes:  # never the limiter: tbf sets the pace
        assert int(_after(c, "rate").removesuffix("bit")) >= 10 * rate
        assert _after(c, "ceil") == _after(c, "rate") and int(_after(c, "burst")) >= 2 * 1514
    leaves = [c for c in tree if "bfifo" in c]
    assert [_after(c, "parent") for c in leaves] == ["10:1", "10:2"]
    assert {_after(c, "limit") for c in leaves} == {_after(tbf, "limit")}
    (u32,) = [c for c in tree if "filter" in c]
    assert _after(u32, "protocol") == "ip" and _after(u32, "flowid") == "10:1" and _after(u32, "at") == "2"


@pytest.mark.parametrize("below", [64, 128, 256, 512, 1024, 32768])
def test_the_length_match_takes_exactly_the_packets_under_the_threshold(below):
    """u32 matches ``total length & mask == 0``: every IPv4 length under ``below`` and none at or above it."""
    mask = queue.length_mask(below)
    assert all(((length & mask) == 0) == (length < below) for length in range(65536))
    command = queue.sparse_first_commands("ns", "eth0", 3e7, 3028, 1500, below)[-1]
    assert command[command.index("u16") + 1:command.index("at")] == ["0", f"{mask:#06x}"]


@pytest.mark.parametrize("below", [0, 63, 100, 300, 65536])
def test_a_threshold_the_mask_cannot_express_is_refused(below):
    with pytest.raises(ValueError, match="power of two"):
        queue.length_mask(below)


def test_the_default_threshold_lies_between_control_packets_and_full_segments():
    """A pure ACK (at most 80 bytes of IP) and a gloo message (48 bytes with TCP/IP and timestamps: 100) go first;
    a full segment at MTU 1500 does not."""
    assert 80 < 100 < queue.SPARSE_BELOW < 1500
