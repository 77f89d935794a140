"""Collectives: ops as step programs, the algorithms that generate them, and their time on a topology.

:mod:`~testbed.collectives.ops` defines ops, step programs and the numpy
interpreter; :mod:`~testbed.collectives.algorithms` generates programs (ring,
tree, halving-doubling, ...); :mod:`~testbed.collectives.timing` routes and
times them (with :mod:`~testbed.collectives.closed_form` for symmetric groups
and :mod:`~testbed.collectives.bounds` as the floor no algorithm beats).
"""

from testbed.collectives.timing import CollectiveTiming, collective_time

__all__ = ["CollectiveTiming", "collective_time"]
