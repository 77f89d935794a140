"""Collectives: ops as step programs, the algorithms that generate them, and their time on a topology.

:mod:`~testbed.collectives.ops` defines ops, step programs and the numpy
interpreter; :mod:`~testbed.collectives.algorithms` generates programs (ring,
tree, halving-doubling, multidim, line, ...) from the line programs of
:mod:`~testbed.collectives.lines` and the grid programs of
:mod:`~testbed.collectives.grids`; :mod:`~testbed.collectives.timing`
times them: routed (:mod:`~testbed.collectives.routed`, sized before it is
built), by formula on symmetric groups (:mod:`~testbed.collectives.closed_form`,
:mod:`~testbed.collectives.torus` for sub-tori,
:mod:`~testbed.collectives.hierarchy` under one switch), with
:mod:`~testbed.collectives.bounds` as the floor no algorithm beats.
"""

from testbed.collectives.timing import CollectiveTiming, collective_time

__all__ = ["CollectiveTiming", "collective_time"]
