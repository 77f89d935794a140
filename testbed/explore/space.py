"""The search space's Python API in one place (docs/explore.md, "Python API"): what a search may choose
(testbed.explore.choices), the plans it enumerates (testbed.explore.candidates), the plans it starts from
(testbed.explore.base_plan) and a topology resized to the searched devices (testbed.topology.resize)."""

from __future__ import annotations

from testbed.explore.base_plan import preset_plan, shrink_plan
from testbed.explore.candidates import (CandidateGroup, candidate_groups, candidates, context_degrees,
                                        count_candidates, expert_degrees, factorisations, virtual_stage_counts)
from testbed.explore.choices import LONG_SEQUENCE, MIN_CONTEXT_TOKENS, SAVE_DOTS, SearchSpace
from testbed.topology.resize import resize_topology

__all__ = ["SearchSpace", "SAVE_DOTS", "preset_plan", "candidates", "candidate_groups", "CandidateGroup",
           "virtual_stage_counts", "factorisations", "count_candidates", "context_degrees", "expert_degrees",
           "resize_topology", "shrink_plan", "LONG_SEQUENCE", "MIN_CONTEXT_TOKENS"]
