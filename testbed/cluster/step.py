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
``host_step_s`` plus what the links add, priced on the cluster's calibrated
topology (``testbed calibrate --cluster``). ``host_step_s`` is one stated
quantity per plan and host, measured beside the shaped step, never fitted
to it.

What the links add is priced from the program (the prediction, when the
compiled step's calls are given): the collective calls the compiled step
makes (:class:`StepCall`, one per buffer of each collective instruction, as
XLA:CPU calls gloo), each priced with gloo's algorithm on the calibrated
topology (``T``) and on it unshaped (``U``, the call's host part: its per-call
and per-round costs; the loopback wire is next to nothing): the links add
``T - U`` a call (:func:`calls_links`). The simulator prices each round of
gloo's ring as the longer of its host cost and its wire
(:mod:`testbed.collectives.gloo`: two segments in flight), so a call adds
what its rounds' wire outlasts their host cost, nothing for a call whose
wire is shorter. Its errors, and those of the readings reported beside it
(each round's host cost added; each whole call's host part hidden,
``overlap``): docs/cluster.md, "Data- and tensor-parallel steps".

Without the calls (or for comparison) the links are the simulator's plan
step on the calibrated topology less its step unshaped, host costs added
(``plan_links_s``: per-call and per-round costs cancel between the two);
``benchmarks/cluster_steps.py`` reports it and the calls added beside the
prediction.
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
    """A step's predicted time on the cluster and its parts (seconds). ``calls_links_s``: what the links add priced
    from the compiled step's calls (:func:`calls_links`); None: from the plan."""

    host_step_s: float
    simulated_s: float
    simulated_unshaped_s: float
    calls_links_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("host_step_s", "simulated_s", "simulated_unshaped_s"):
            if not 0 <= getattr(self, name) < 1e6:
                raise InputError(f"must be a time in [0, 1e6) s, got {getattr(self, name)}", field=name)
        if self.calls_links_s is not None and not 0 <= self.calls_links_s < 1e6:
            raise InputError(f"must be a time in [0, 1e6) s, got {self.calls_links_s}", field="calls_links_s")

    @property
    def plan_links_s(self) -> float:
        """What the shaped links add over unshaped ones, as the simulator prices the plan's step."""
        return self.simulated_s - self.simulated_unshaped_s

    @property
    def links_s(self) -> float:
        """What the shaped links add: from the program's calls when given, else from the plan."""
        return self.plan_links_s if self.calls_links_s is None else self.calls_links_s

    @property
    def predicted_s(self) -> float:
        return self.host_step_s + self.links_s

    def to_dict(self) -> dict[str, float | str]:
        return {"predicted_s": self.predicted_s, "host_step_s": self.host_step_s, "links_s": self.links_s,
                "links_from": "plan" if self.calls_links_s is None else "calls added",
                "plan_links_s": self.plan_links_s, "simulated_s": self.simulated_s,
                "simulated_unshaped_s": self.simulated_unshaped_s}


def predict_step(plan: Plan, topology: Topology, host_step_s: float,
                 calls: Sequence["StepCall"] | None = None) -> StepPrediction:
    """The step of ``plan`` on the cluster ``topology`` describes, given its measured unshaped step and (the
    prediction) the compiled step's collective ``calls``, whose links are priced call by call; without ``calls``
    the links are the plan's, host costs added."""
    from testbed.sim import simulate

    if not any(level.kind in NETWORK_KINDS for level in topology.levels):
        raise InputError(f"{topology.name} has no network level; give the topology `testbed calibrate --cluster` "
                         "wrote for the cluster", field="topology")
    shaped = simulate(plan, topology).report.step_time_s
    loose = simulate(plan, unshaped(topology)).report.step_time_s
    links = None if calls is None else calls_links(calls, topology)
    return StepPrediction(host_step_s=host_step_s, simulated_s=shaped, simulated_unshaped_s=loose,
                          calls_links_s=links)


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
