"""Closed-form alpha-beta times for collectives on symmetric groups.

Two symmetric shapes are recognised (:func:`symmetry`):

- ``switch``: every pair of ranks meets at the same switch level and each rank
  reaches it over links no other rank of the group uses (e.g. GPUs of one
  NVSwitch node, or one GPU per node on the IB switch). A transfer costs
  ``alpha = route latency`` and its rank's links carry what it sends and
  receives, at bandwidth ``B`` (route bottleneck).
  On a multi-slice torus, chips at one position of different slices
  (``--over slice``) are such a group: each reaches the data-center switch
  over its own link.
- ``ring``: the group is one full wraparound line of a torus in coordinate
  order; neighbours are one link apart (``alpha`` = link latency, ``B`` =
  link bandwidth), and each direction of a link is its own resource.

With ``u = alpha + collectives.overhead_s`` (calibration) per round, ``S`` bytes and ``n``
ranks (``p`` the largest power of two <= n; where gloo's own ring runs a round is
``max(overhead_s, alpha + S/(nB))`` instead, :func:`testbed.collectives.gloo.round_s`):

=================================== =======================================
ring / bidir_ring all-reduce        2(n-1) (u + S/(nB))   (bidir on a ring: S/(2nB))
ring / bidir_ring all-gather, r-s   (n-1) (u + S/(nB))    (bidir on a ring: S/(2nB))
ring broadcast (P-piece chain)      (n+P-2) (u + S/(PB))
direct all-reduce (two-shot)        2 (u + (n-1)S/(nB))
direct all-gather / r-s / all-to-all u + (n-1)S/(nB)
direct broadcast                    u + (n-1)S/B
one_shot all-reduce                 u + (n-1)S/B
pairwise all-to-all                 (n-1) (u + S/(nB))
halving_doubling all-reduce         2 log2(p) u + 2(p-1)/p S/B [+ 2(u + S/B) if n > p]
halving_doubling all-gather / r-s   log2(n) u + (n-1)/n S/B    (n a power of two)
halving_doubling broadcast          ceil(log2 n) (u + S/B)
send                                u + S/B
=================================== =======================================

These equal the routed step-program time on those groups (tested within
2%). On a torus, ``torus`` and ``multidim`` over a whole sub-torus (and
``ring``/``bidir_ring`` over one whole line) are timed round by round from
one rank's links by :mod:`testbed.collectives.torus`, exactly, at any size;
so is ``hierarchical`` over every device under one switch of a hierarchy
(:mod:`testbed.collectives.hierarchy`); anything else returns None and is
timed from its program.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from testbed.collectives.algorithms import TREE_PIECES
from testbed.collectives.gloo import gloo_pipelined, round_s
from testbed.collectives.ops import Op, parse_op
from testbed.collectives.hierarchy import hierarchical_time
from testbed.collectives.torus import TORUS_FORMS, torus_time
from testbed.topology import Form, Topology

__all__ = ["symmetry", "closed_form_time"]


def _switch_symmetry(topology: Topology, group: Sequence[int]) -> tuple[float, float] | None:
    coords = [topology.coords(d) for d in group]
    levels = len(topology.levels)
    k = next((k for k in range(levels) if len({c[k + 1:] for c in coords}) == 1), None)
    if k is None or len({c[k] for c in coords}) != len(group):
        return None
    return topology.path_latency(group[0], group[1]), topology.path_bandwidth(group[0], group[1])


def _ring_symmetry(topology: Topology, group: Sequence[int]) -> tuple[float, float] | None:
    if list(group) != sorted(group) or len(set(group)) != len(group):
        return None
    coords = [topology.coords(d) for d in group]
    varying = [i for i in range(len(topology.levels)) if len({c[i] for c in coords}) > 1]
    if len(varying) != 1:
        return None
    level = topology.levels[varying[0]]
    if not level.wraparound or level.size != len(group) or level.size < 3:
        return None
    link = topology.link(group[0], group[1])
    return float(link["latency"]), float(link["bandwidth"])


def _slice_symmetry(topology: Topology, group: Sequence[int]) -> tuple[float, float] | None:
    """(latency, bandwidth) of the route between two members when ``group`` is distinct slices' chips at one
    position of a multi-slice torus (each behind its own link to the data-center switch), else None."""
    k = topology.slice_level
    if k is None:
        return None
    coords = [topology.coords(d) for d in group]
    if len({c[:k] for c in coords}) != 1 or len({c[k] for c in coords}) != len(group):
        return None
    return topology.path_latency(group[0], group[1]), topology.path_bandwidth(group[0], group[1])


def symmetry(topology: Topology, group: Sequence[int]) -> tuple[str, float, float] | None:
    """('switch' | 'ring', alpha seconds, bandwidth bytes/s) for a symmetric group, else None (memoized)."""
    group = tuple(group)
    key = ("__symmetry__", group)
    cache = topology._routes
    if key in cache:
        return cache[key]
    result = None
    if len(group) >= 2:
        if topology.form is Form.LEVELS:
            found = _switch_symmetry(topology, group)
            result = ("switch", *found) if found else None
        elif topology.form is Form.TORUS:
            found = _ring_symmetry(topology, group)
            result = ("ring", *found) if found else None
            if result is None:
                found = _slice_symmetry(topology, group)
                result = ("switch", *found) if found else None
    cache[key] = result
    return result


def closed_form_time(topology: Topology, op: Op | str, algorithm: str, group: Sequence[int],
                     nbytes: float) -> tuple[float, int] | None:
    """(seconds, rounds) by formula when ``group`` is symmetric and the formula exists, else None."""
    op = parse_op(op)
    n = len(group)
    if n == 1:
        return 0.0, 0
    if topology.form is Form.TORUS and algorithm in TORUS_FORMS:
        found = torus_time(topology, op, algorithm, group, nbytes)
        if found is not None or algorithm not in ("ring", "bidir_ring"):
            return found
    if algorithm == "hierarchical":
        return hierarchical_time(topology, op, group, nbytes)
    shape = symmetry(topology, group)
    if shape is None:
        return None
    kind, alpha, bandwidth = shape
    u = alpha + topology.calibration.collectives.overhead_s
    s = float(nbytes)
    beta = 1.0 / bandwidth
    if kind == "ring" and algorithm not in ("ring", "bidir_ring"):
        return None
    if algorithm in ("ring", "bidir_ring"):
        return _ring_form(topology, op, algorithm, kind, n, alpha, s, beta)
    if algorithm == "direct":
        if op is Op.ALL_REDUCE:
            return 2 * (u + (n - 1) * s / n * beta), 2
        if op in (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL):
            return u + (n - 1) * s / n * beta, 1
        if op is Op.BROADCAST:
            return u + (n - 1) * s * beta, 1
        return u + s * beta, 1
    if algorithm == "one_shot":
        return u + (n - 1) * s * beta, 1
    if algorithm == "pairwise":
        return (n - 1) * (u + s / n * beta), n - 1
    if algorithm == "halving_doubling":
        return _halving_doubling_form(op, n, u, s, beta)
    return None


def _ring_form(topology: Topology, op: Op, algorithm: str, kind: str, n: int, alpha: float, s: float,
               beta: float) -> tuple[float, int] | None:
    """(seconds, rounds) of a (bidirectional) ring over a symmetric group of ``n`` with per-hop ``alpha`` and
    seconds per byte ``beta``; a broadcast is a pipelined chain of ``TREE_PIECES`` pieces."""
    u = alpha + topology.calibration.collectives.overhead_s
    if op is Op.BROADCAST:
        if algorithm == "bidir_ring":
            return None
        pieces = min(TREE_PIECES, n)
        rounds = n - 1 + pieces - 1
        return rounds * (u + s / pieces * beta), rounds
    share = s / n / (2 if kind == "ring" and algorithm == "bidir_ring" else 1)
    rounds = (2 if op is Op.ALL_REDUCE else 1) * (n - 1)
    overhead = topology.calibration.collectives.overhead_s
    return rounds * round_s(alpha + share * beta, overhead, gloo_pipelined(topology, op, algorithm)), rounds


def _halving_doubling_form(op: Op, n: int, u: float, s: float, beta: float) -> tuple[float, int] | None:
    """(seconds, rounds) of recursive halving/doubling over ``n`` ranks (a power of two, or all-reduce and
    broadcast on any ``n``); ``u`` is one round's latency, ``beta`` seconds per byte."""
    p = 1 << (n.bit_length() - 1)
    steps = p.bit_length() - 1
    if op is Op.BROADCAST:
        rounds = math.ceil(math.log2(n))
        return rounds * (u + s * beta), rounds
    if op is Op.ALL_REDUCE:
        time = 2 * steps * u + 2 * (p - 1) / p * s * beta
        rounds = 2 * steps
        if n > p:
            time += 2 * (u + s * beta)
            rounds += 2
        return time, rounds
    if n == p:
        return steps * u + (n - 1) / n * s * beta, steps
    return None
