"""One parameter array of the layout (:class:`ParamSpec`) and the ONE fsdp/ZeRO shard rule (:func:`shard_dim`).

testbed.model.layout's table resolves to these entries (re-exported there); every count, shape and sharding of
the two interpreters reads them.

The routed experts' weights (:attr:`ParamSpec.expert_dim`) are split over the expert-parallel ranks on
their experts dim and over the experts' tensor degree on their width: ``mesh.expert`` and ``mesh.tensor``,
or with MoE parallel folding (``mesh.expert_tensor`` 1) over ``mesh.expert x mesh.tensor`` and not at all
(testbed.plan.sharding.expert_axes). The methods take the mesh's ``tensor`` and ``expert`` degrees and its
``expert_tensor`` (None: as ``tensor``) and resolve the degrees an expert's weight sees
(:meth:`ParamSpec.degrees`).

FSDP and ZeRO shard every parameter by ONE rule (:meth:`ParamSpec.shard_dim`,
:meth:`ParamSpec.device_elements`): along the largest dim not already split
by the tensor (or expert) axis whose size the shard count divides; a
parameter with no such dim is sharded *padded* (:meth:`ParamSpec.padded`):
flattened and padded to a multiple of the shard count, each device holding
``ceil(elements / ways)`` of it (DeepSpeed ZeRO's and PyTorch FSDP's flat
parameters, Megatron's distributed optimizer), so any rank count shards.
The memory model counts the padding, the simulator's gathers and
reduce-scatters move it (:meth:`ParamSpec.gathered_elements`). The JAX
runner shards the evenly divided parameters by the same dim and holds the
padded ones flat and padded (``testbed.runner.padding``): their optimizer
state, and under fsdp/ZeRO-3 their parameters and gradients; only ZeRO-2's
gradients of them it does not pad
(``testbed.model.leaves.runner_whole_params`` names them).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Part", "Init", "ParamSpec", "shard_dim"]


class Part(StrEnum):
    """Which part of the model a parameter belongs to; :attr:`root` is its key in the params pytree."""

    EMBEDDING = "embedding"
    LAYER = "layer"
    HEAD = "head"

    @property
    def root(self) -> str:
        return {"embedding": "embed", "layer": "layers", "head": "head"}[self.value]


class Init(StrEnum):
    """How the runner initialises a parameter (fp32)."""

    ZEROS = "zeros"
    ONES = "ones"
    NORMAL = "normal"
    #: Normal scaled by ``1/sqrt(2 layers)`` (GPT-2's output projections, so the residual stream stays O(1)).
    NORMAL_RESIDUAL = "normal-residual"


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSpec:
    """One parameter array of the model, for one :class:`ModelSpec`.

    ``path`` is under :attr:`Part.root` (a layer's under its list entry);
    ``tensor_dim`` the dim the tensor axis splits (None: replicated over it);
    ``rng`` the index of the random key it is drawn from (the global keys for
    embedding and head, the layer's own keys for a layer; None if constant).
    """

    part: Part
    path: tuple[str, ...]
    shape: tuple[int, ...]
    tensor_dim: int | None
    init: Init
    std: float = 0.0
    rng: int | None = None
    #: Whole units (K/V heads) along ``tensor_dim``: the tensor axis splits it only at degrees dividing
    #: this, and leaves the parameter replicated otherwise (fewer K/V heads than tensor ranks). 0: always split.
    tensor_units: int = 0
    #: The experts dim of a routed expert's stacked weight, which the expert mesh axis splits; None: a dense
    #: parameter (replicated over the expert axis, its gradient summed over it).
    expert_dim: int | None = None

    def __post_init__(self) -> None:
        if not self.path or not all(isinstance(p, str) and p for p in self.path):
            raise ValueError(f"path must be non-empty names, got {self.path!r}")
        if not self.shape or not all(isinstance(n, int) and n >= 1 for n in self.shape):
            raise ValueError(f"{self.name}: shape must be positive sizes, got {self.shape!r}")
        if self.tensor_dim is not None and not 0 <= self.tensor_dim < len(self.shape):
            raise ValueError(f"{self.name}: tensor_dim {self.tensor_dim} outside shape {self.shape}")
        if self.expert_dim is not None and (not 0 <= self.expert_dim < len(self.shape)
                                            or self.expert_dim == self.tensor_dim):
            raise ValueError(f"{self.name}: expert_dim {self.expert_dim} outside shape {self.shape} or the tensor dim")
        random = self.init in (Init.NORMAL, Init.NORMAL_RESIDUAL)
        if random != (self.rng is not None) or random != (self.std > 0):
            raise ValueError(f"{self.name}: a random init needs rng and std > 0, a constant one neither")

    @property
    def name(self) -> str:
        """``root/path`` (e.g. ``layers/attn/wqkv``), for messages."""
        return "/".join((self.part.root, *self.path))

    @property
    def additive(self) -> bool:
        """Whether it is added to the activations (a bias, a LayerNorm's shift): its gradient is a sum of the
        output's, and the input's gradient passes through it, so no backward pass reads its value
        (testbed.model.leaves.regathered_in_backward)."""
        return self.path[-1] == "bias" or re.fullmatch(r"(shared_)?b[0-9a-z]*", self.path[-1]) is not None

    @property
    def size(self) -> int:
        """Elements of the whole parameter."""
        return math.prod(self.shape)

    def tensor_dims(self, tensor: int) -> tuple[int, ...]:
        """Dims the tensor axis takes at degree ``tensor`` (none at degree 1, nor for an optional split it
        does not divide)."""
        if tensor <= 1 or self.tensor_dim is None:
            return ()
        if self.tensor_units and self.tensor_units % tensor:
            return ()
        return (self.tensor_dim,)

    @property
    def is_expert(self) -> bool:
        """A routed expert's weight: split over the expert axis, its gradient not summed over it."""
        return self.expert_dim is not None

    def expert_dims(self, expert: int) -> tuple[int, ...]:
        """Dims the expert axis takes at degree ``expert`` (none at degree 1, nor for a dense parameter)."""
        return (self.expert_dim,) if expert > 1 and self.expert_dim is not None else ()

    def degrees(self, tensor: int, expert: int = 1, expert_tensor: int | None = None) -> tuple[int, int]:
        """(tensor, expert) degrees this parameter is split at on a mesh of ``tensor`` and ``expert`` with the MoE
        layers' ``expert_tensor`` (None: ``tensor``): a routed expert's weight folds ``tensor / expert_tensor``
        of the tensor ranks into its expert split (MoE parallel folding); any other parameter sees the mesh's."""
        if self.expert_dim is None or expert_tensor is None or expert_tensor == tensor:
            return tensor, expert
        return expert_tensor, expert * tensor // expert_tensor

    def splits(self, tensor: int, expert: int = 1, expert_tensor: int | None = None
               ) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
        """(dim, degree, mesh axes) of each dim the tensor and expert axes split, in dim order: ``tensor`` over
        the tensor axis; a routed expert's experts dim over ``expert``, and ``tensor`` too when folded (the
        axes of testbed.plan.sharding.expert_axes, ``expert`` major), the runner's shardings read it."""
        t, e = self.degrees(tensor, expert, expert_tensor)
        folded = e != expert
        axes = tuple(a for a, n in (("expert", expert), ("tensor", tensor if folded else 1)) if n > 1)
        out = [(d, t, ("tensor",)) for d in self.tensor_dims(t)] + [(d, e, axes) for d in self.expert_dims(e)]
        return tuple(sorted(out))

    def shard_dim(self, tensor: int, ways: int, expert: int = 1, expert_tensor: int | None = None) -> int | None:
        """The dim fsdp/ZeRO split ``ways`` ways (:func:`shard_dim` on the dims tensor and expert leave free)."""
        t, e = self.degrees(tensor, expert, expert_tensor)
        return shard_dim(self.shape, self.tensor_dims(t) + self.expert_dims(e), ways)

    def padded(self, tensor: int, ways: int, expert: int = 1, expert_tensor: int | None = None) -> bool:
        """Whether fsdp/ZeRO shard it ``ways`` ways flattened and padded: no free dim divides (the one rule)."""
        return ways > 1 and self.shard_dim(tensor, ways, expert, expert_tensor) is None

    def gathered_elements(self, tensor: int = 1, ways: int = 1, expert: int = 1,
                          expert_tensor: int | None = None) -> int:
        """Elements an all-gather of its ``ways`` shards outputs (a reduce-scatter of its gradient takes),
        the padding of a padded parameter included: ``ways`` times :meth:`device_elements`."""
        return ways * self.device_elements(tensor, ways, expert, expert_tensor)

    def device_elements(self, tensor: int = 1, ways: int = 1, expert: int = 1,
                        expert_tensor: int | None = None) -> int:
        """Elements one device holds: split by ``tensor`` (if it has a tensor dim), by ``expert`` (a routed
        expert's weight; both as :meth:`degrees` resolves them) and by ``ways`` under the rule: ``1/ways`` of
        them along the shard dim, or ``ceil(elements / ways)`` flattened and padded when no free dim divides."""
        return _device_elements(self, tensor, ways, expert, expert_tensor)

    def _device_elements(self, tensor: int, ways: int, expert: int, expert_tensor: int | None) -> int:
        n = self.size
        tensor, expert = self.degrees(tensor, expert, expert_tensor)
        for dim, degree in [(d, tensor) for d in self.tensor_dims(tensor)] + \
                [(d, expert) for d in self.expert_dims(expert)]:
            if self.shape[dim] % degree:
                raise ValueError(f"{self.name}: degree {degree} does not divide dim {dim} of {self.shape}")
            n //= degree
        return -(-n // ways)  # an even split along the shard dim, or the padded flat shard (1 way: whole)


@functools.lru_cache(maxsize=65536)  # a search reads each leaf's shard thousands of times
def _device_elements(param: ParamSpec, tensor: int, ways: int, expert: int, expert_tensor: int | None) -> int:
    """:meth:`ParamSpec.device_elements`, memoized."""
    return param._device_elements(tensor, ways, expert, expert_tensor)


def shard_dim(shape: tuple[int, ...], taken: tuple[int, ...], ways: int) -> int | None:
    """The ONE fsdp/ZeRO shard rule's dim: the largest dim not in ``taken`` whose size ``ways`` divides.

    Ties go to the lower dim. None: ``ways`` is 1 (not split), or no free dim
    divides, and the parameter is sharded flattened and padded instead
    (:meth:`ParamSpec.padded`).
    """
    if ways <= 1:
        return None
    free = sorted((i for i in range(len(shape)) if i not in taken), key=lambda i: -shape[i])
    return next((i for i in free if shape[i] % ways == 0), None)
