"""A training step's time on an emulated cluster: the host's measured part plus what the shaped links add.

On a 2-core machine the four JAX processes of a 4-node cluster share the
cores: their compute, XLA's dispatch and gloo's per-call costs take most of
a step at the faster link rates (measured: a 0.5 M-parameter data-parallel
step of 1.16 s at 100 Mb/s, of which the gradients' all-reduce is ~0.3 s),
and none of it is a property of the network. So the host's part is measured,
not modelled: ``host_step_s`` is the plan's step timed on the same cluster,
the same processes and program, with the links unshaped
(:func:`testbed.cluster.netns.reshape` to 10 Gb/s, where the host's TCP, not
tbf, sets the pace). A step on the shaped links is then predicted as

    host_step_s + simulated(calibrated topology) - simulated(unshaped topology)

where both simulations use the cluster's calibrated topology
(``testbed calibrate --cluster``): gloo's per-call and per-round costs and the
compute are priced the same way in both, so they cancel, and what remains is
the simulator's price of the shaped links over the unshaped ones (the
unshaped topology's network levels run at the node level's bandwidth, the
loopback TCP measured by the probe). ``host_step_s`` is one stated
quantity per plan and host, measured beside the shaped step, never fitted
to it.

What the links add can also be priced from the program rather than the plan:
the collective calls the compiled step makes (:class:`StepCall`, one per
buffer of each collective instruction, as XLA:CPU calls gloo), each priced on
the calibrated topology and on it unshaped (:func:`calls_links`), either
added or with the call's host part hidden under its wire (``max(host,
wire)`` per call): a step's many small calls (one per gradient leaf) cost the
host the same whatever the links, and on slow links that cost overlaps the
transfer instead of adding to it. ``benchmarks/cluster_steps.py`` reports the
three readings beside each measured step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from testbed.cluster.spec import GLOO_ALGORITHMS, NETWORK_KINDS
from testbed.errors import InputError
from testbed.plan.spec import Plan
from testbed.topology import Topology

__all__ = ["UNSHAPED_RATE_BPS", "unshaped", "StepPrediction", "predict_step", "StepCall", "step_calls",
           "calls_links"]

#: The link rate a cluster is reshaped to for the host's part of a step: far above what the host's TCP carries.
UNSHAPED_RATE_BPS = 10e9


def unshaped(topology: Topology) -> Topology:
    """``topology`` with its network levels at the innermost level's bandwidth (the host's loopback TCP)."""
    inner = topology.levels[0].bandwidth
    levels = tuple(replace(level, bandwidth=inner) if level.kind in NETWORK_KINDS else level
                   for level in topology.levels)
    return replace(topology, name=f"{topology.name}-unshaped", levels=levels)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPrediction:
    """A step's predicted time on the cluster and its parts (seconds)."""

    host_step_s: float
    simulated_s: float
    simulated_unshaped_s: float

    def __post_init__(self) -> None:
        for name in ("host_step_s", "simulated_s", "simulated_unshaped_s"):
            if not 0 <= getattr(self, name) < 1e6:
                raise InputError(f"must be a time in [0, 1e6) s, got {getattr(self, name)}", field=name)

    @property
    def links_s(self) -> float:
        """What the shaped links add over unshaped ones, as the simulator prices it."""
        return self.simulated_s - self.simulated_unshaped_s

    @property
    def predicted_s(self) -> float:
        return self.host_step_s + self.links_s

    def to_dict(self) -> dict[str, float]:
        return {"predicted_s": self.predicted_s, "host_step_s": self.host_step_s, "links_s": self.links_s,
                "simulated_s": self.simulated_s, "simulated_unshaped_s": self.simulated_unshaped_s}


def predict_step(plan: Plan, topology: Topology, host_step_s: float) -> StepPrediction:
    """The step of ``plan`` on the cluster ``topology`` describes, given its measured unshaped step."""
    from testbed.sim import simulate

    if not any(level.kind in NETWORK_KINDS for level in topology.levels):
        raise InputError(f"{topology.name} has no network level; give the topology `testbed calibrate --cluster` "
                         "wrote for the cluster", field="topology")
    shaped = simulate(plan, topology).report.step_time_s
    loose = simulate(plan, unshaped(topology)).report.step_time_s
    return StepPrediction(host_step_s=host_step_s, simulated_s=shaped, simulated_unshaped_s=loose)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepCall:
    """One collective call a compiled step makes (:func:`testbed.runner.hlo.compiled_calls`: one per buffer of a
    combined instruction, as XLA:CPU calls gloo): the op, the bytes per device, the device groups."""

    op: str
    nbytes: float
    groups: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if self.op not in GLOO_ALGORITHMS:
            raise InputError(f"must be one of {sorted(GLOO_ALGORITHMS)}, got {self.op!r}", field="op")
        if not self.nbytes > 0:
            raise InputError(f"must be positive, got {self.nbytes}", field="nbytes")
        if not self.groups or min(len(g) for g in self.groups) < 2:
            raise InputError("needs groups of two devices or more", field="groups")


def step_calls(instructions: Sequence[dict]) -> list[StepCall]:
    """The calls of a compiled program's collective instructions (``kind``, ``groups``, ``buffers`` as
    :func:`testbed.runner.hlo.compiled_calls` reads them): one per buffer, as XLA:CPU calls gloo."""
    return [StepCall(op=i["kind"].replace("-", "_"), nbytes=b, groups=tuple(map(tuple, i["groups"])))
            for i in instructions for b in i["buffers"]]


def calls_links(calls: Sequence[StepCall], topology: Topology, *, overlap: bool = False) -> float:
    """What the shaped links add to a step, priced call by call from the program (seconds).

    Each call is priced with gloo's algorithm on the calibrated ``topology`` (``T``) and on it unshaped (``U``:
    the host's part of the call, its per-call and per-round costs; the loopback wire is next to nothing).
    Additive (the default): the call's host part and its wire add, so the links add ``T - U``. With
    ``overlap`` the host part hides under the wire, a call takes ``max(U, T - U)``, and the links add
    ``max(0, T - 2U)``: the two readings of the same calibration, between which a step decides.
    """
    from testbed.collectives.timing import groups_time

    loose = unshaped(topology)
    total = 0.0
    for call in calls:
        algorithm = GLOO_ALGORITHMS[call.op]
        shaped = groups_time(topology, call.op, call.groups, call.nbytes, algorithm).time_s
        host = groups_time(loose, call.op, call.groups, call.nbytes, algorithm).time_s
        total += max(0.0, shaped - 2 * host) if overlap else shaped - host
    return total
