"""Exploring trade-offs: enumerate plans, rank them with a fast analytic tier, replay the best with the DES.

``from testbed.explore import search, SearchSpace`` is the Python API of
``testbed search``; see docs/explore.md.
"""

from testbed.explore.analytic import Estimate, estimate

__all__ = ["Estimate", "estimate"]
