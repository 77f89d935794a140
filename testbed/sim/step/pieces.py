"""The tasks one pipeline action splits into when it overlaps its own communication.

Context parallelism's ring (testbed.sim.graph.ring) and an MoE layer's dispatch and combine
(testbed.sim.step.moe) both cut an F or B action into compute pieces on the device's
``compute`` stream and transfers on a stream of their own, with dependencies inside
the action. :class:`ActionTask` is that one piece; testbed.sim.graph.program turns each
into a task of the step's graph and testbed.explore.analytic prices the same list.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.model.gemm import Gemm

__all__ = ["ActionTask"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionTask:
    """One piece of an action: compute (``flops``, ``gemms``, ...) or a transfer (``nbytes``, ``count`` back to back).

    ``after``: indices of earlier pieces of the same list it waits for; None is the action's own dependencies,
    ``()`` none at all. ``layer_end``: the last compute piece of a layer (where a gradient bucket may close).
    """

    name: str
    stream: str = "compute"
    after: tuple[int, ...] | None = None
    flops: float = 0.0
    hbm_bytes: float = 0.0
    replicated_bytes: float = 0.0
    split_bytes: float = 0.0
    kernels: int = 1
    gemms: tuple[Gemm, ...] = ()
    nbytes: float = 0.0
    count: int = 1
    layer_end: bool = False
    #: A transfer's collective and the mesh axis of its groups (the MoE dispatch: ``all_to_all`` over ``expert``).
    op: str = "all_to_all"
    axis: str = "expert"

    @property
    def transfer(self) -> bool:
        """Whether it moves bytes (on its own stream) rather than computing."""
        return self.stream != "compute"
