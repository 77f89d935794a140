"""The step time a plan that does not state ``runtime:`` takes under each named stack profile, and their spread.

A plan without ``runtime:`` prices the program testbed's own runner executes; the same layout under Megatron,
NeMo, DeepSpeed, FSDP, torchtitan, llm-foundry, XLA or Meta's stack (testbed.plan.runtime.PROFILES, each value
sourced there) runs differently. :func:`profile_spread` simulates the plan under every profile and returns the
least and most step time: the band a user who does not know the stack's internals should read beside the
prediction. A profile the plan cannot run under (an :class:`InputError` from its fields) is listed as refused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from testbed.errors import InputError
from testbed.plan.runtime import PROFILES, runtime_from_dict
from testbed.plan.spec import Plan
from testbed.sim.graph.engine import simulate
from testbed.topology import Topology

__all__ = ["ProfileSpread", "profile_spread"]


@dataclass(frozen=True, slots=True)
class ProfileSpread:
    """Step seconds per named profile (``steps``: (profile, seconds) in :data:`PROFILES` order) and the refused."""

    steps: tuple[tuple[str, float], ...]
    refused: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError("a spread needs at least one profile's step time")
        if any(not s > 0 for _, s in self.steps):
            raise ValueError(f"step times must be > 0, got {self.steps}")

    @property
    def low_s(self) -> float:
        return min(s for _, s in self.steps)

    @property
    def high_s(self) -> float:
        return max(s for _, s in self.steps)

    def to_dict(self) -> dict:
        return {"low_s": self.low_s, "high_s": self.high_s, "profiles": dict(self.steps),
                **({"refused": list(self.refused)} if self.refused else {})}


def profile_spread(plan: Plan, topology: Topology, default_step_s: float | None = None) -> ProfileSpread:
    """The plan's step time under every named profile (``default_step_s``: the ``testbed`` profile's, when the
    caller has simulated the plan as stated already; profiles with the same fields are simulated once)."""
    steps, refused, seen = [], [], {}
    for name in PROFILES:
        spec = runtime_from_dict(name)
        key = replace(spec, profile="testbed")
        if key in seen:
            steps.append((name, seen[key]))
            continue
        if name == "testbed" and default_step_s is not None:
            seen[key] = default_step_s
        else:
            try:
                seen[key] = simulate(replace(plan, runtime=spec), topology).report.step_time_s
            except InputError:
                refused.append(name)
                continue
        steps.append((name, seen[key]))
    return ProfileSpread(tuple(steps), tuple(refused))
