"""Flattened, padded model state: FSDP and ZeRO shard every parameter and its moments, whatever the rank count.

testbed.model.layout's one shard rule splits a parameter along a free dim the
shard count divides, and shards it *padded* where none does: flattened,
padded to a multiple of the shard count, each rank ``ceil(elements / ways)``
of it (DeepSpeed ZeRO's flat buffers, Megatron's distributed optimizer,
PyTorch FSDP's flat parameters). JAX shardings split a dim only evenly, so
here the optimizer keeps the state of each padded parameter in its *flat
form*: the dims the tensor and expert axes split moved to the front as their
degrees (so each tensor rank keeps its own block), the rest flattened and
zero-padded to a multiple of ``ways``, that last dim sharded over the
optimizer's shard axes. The update is elementwise (Adam, AdamW, SGD), so it
runs on the flat form unchanged; the padding holds zeros (zero gradient,
zero moments, zero update) and is cut off when the parameters are rebuilt.

The parameters and gradients of a parameter the rule pads under fsdp /
ZeRO-3 are held in their flat form too (``FlatState(plan, "params")``, the
trainers' *held* form: testbed.runner.precision.Optimizer.held):
testbed.runner.param_shards.ParamShards all-gathers the flat shards and
rebuilds the leaf where a piece of the model uses it, and reduce-scatters its
gradient back into the flat shards, as PyTorch FSDP does with its flat
parameters; over ``data`` (hybrid sharding) only that shard is then summed.
What the runner still holds whole: the gradients of padded leaves under
ZeRO-2 over data (testbed.model.leaves.runner_whole_params).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from testbed.model import layout
from testbed.model.layout import ParamSpec
from testbed.plan.sharding import state_sharding
from testbed.plan.spec import Plan
from testbed.runner.parallel import _path_names, flat_spec

__all__ = ["FlatState", "flatten", "unflatten", "flat_shape", "refold"]


def _split_dims(param: ParamSpec, tensor: int, expert: int, expert_tensor: int | None = None
                ) -> tuple[tuple[int, int, Any], ...]:
    """(dim, degree, axis entry) of each dim the tensor and expert axes split, in dim order
    (testbed.model.param_spec.ParamSpec.splits)."""
    return tuple((d, k, axes[0] if len(axes) == 1 else axes) for d, k, axes in param.splits(tensor, expert, expert_tensor))


def flat_shape(param: ParamSpec, tensor: int, ways: int, expert: int = 1, expert_tensor: int | None = None
               ) -> tuple[int, ...]:
    """The flat form's shape: the split dims' degrees, then ``ways`` times the device's padded shard."""
    split = _split_dims(param, tensor, expert, expert_tensor)
    return (*(k for _, k, _ in split), ways * param.device_elements(tensor, ways, expert, expert_tensor))


def _on_host(x: Any) -> tuple[Any, Any]:
    """(``x``, the array module to move it with): numpy for a host array or a whole one this process holds, moved
    to the host (a trainer's initial state, the state verify compares: no program compiled per leaf shape for a
    reshape), else jax.numpy (traced in a step, or spread over processes)."""
    if isinstance(x, np.ndarray):
        return x, np
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_fully_addressable:
        return np.asarray(x), np
    return x, jnp


def flatten(x: jax.Array, param: ParamSpec, tensor: int, ways: int, expert: int = 1,
            expert_tensor: int | None = None) -> jax.Array:
    """``x`` (the parameter's shape) in its flat form (:func:`flat_shape`), zero-padded; a numpy array when ``x``
    is one or a whole array of this process (:func:`_on_host`)."""
    x, xp = _on_host(x)
    split = _split_dims(param, tensor, expert, expert_tensor)
    shape: list[int] = []
    fronts: list[int] = []
    for i, n in enumerate(param.shape):
        k = next((k for d, k, _ in split if d == i), None)
        if k is not None:
            fronts.append(len(shape))
            shape += [k, n // k]
        else:
            shape.append(n)
    y = xp.moveaxis(x.reshape(shape), fronts, list(range(len(fronts))))
    y = y.reshape(*(k for _, k, _ in split), -1)
    pad = flat_shape(param, tensor, ways, expert, expert_tensor)[-1] - y.shape[-1]
    return xp.pad(y, [(0, 0)] * (y.ndim - 1) + [(0, pad)])


def unflatten(y: jax.Array, param: ParamSpec, tensor: int, expert: int = 1, expert_tensor: int | None = None
              ) -> jax.Array:
    """The parameter's shape back from its flat form (the padding cut off): :func:`flatten`'s inverse (numpy as
    :func:`flatten` says)."""
    y, xp = _on_host(y)
    split = _split_dims(param, tensor, expert, expert_tensor)
    local = [n // next((k for d, k, _ in split if d == i), 1) for i, n in enumerate(param.shape)]
    y = y[..., :math.prod(local)].reshape(*(k for _, k, _ in split), *local)
    dims = [d for d, _, _ in split]
    # Each degree goes back in front of its dim: after moving, degree j sits at dim d_j + j.
    y = xp.moveaxis(y, list(range(len(dims))), [d + j for j, d in enumerate(dims)])
    return y.reshape(param.shape)


class FlatState:
    """A view of a params tree with the leaves padded under ``which``'s sharding (optimizer: the moments and
    master; params: the held parameters and their gradients) in flat form.

    Trees are matched to testbed.model.layout's table by leaf path, so one instance serves every stage's
    chunk trees. ``ways`` is ``which``'s shard count; with ``ways`` 1 (or ``active`` False: the single-device
    reference) nothing is padded.
    """

    def __init__(self, plan: Plan, active: bool = True, which: str = "optimizer"):
        sharding = state_sharding(plan)
        self.model, self.tensor, self.expert = plan.model, plan.mesh.tensor, plan.mesh.expert
        self.expert_tensor = plan.mesh.expert_tensor
        self.ways = sharding.ways(plan, which) if active else 1
        self.axes = sharding.split_axes(plan, which)

    def param(self, path: tuple[Any, ...]) -> ParamSpec | None:
        """The table entry of the leaf at ``path`` when this view holds it flat, else None."""
        return self._param(path) if self.active else None

    def _param(self, path: tuple[Any, ...]) -> ParamSpec | None:
        param = layout.param_at(self.model, _path_names(path))
        return param if param.padded(self.tensor, self.ways, self.expert, self.expert_tensor) else None

    @property
    def active(self) -> bool:
        return self.ways > 1

    def to(self, tree: Any) -> Any:
        """``tree`` with its padded leaves flattened (:func:`flatten`)."""
        if not self.active:
            return tree

        def one(path: tuple[Any, ...], x: Any) -> Any:
            param = self._param(path)
            return x if param is None else flatten(x, param, self.tensor, self.ways, self.expert, self.expert_tensor)
        return jax.tree_util.tree_map_with_path(one, tree)

    def back(self, tree: Any) -> Any:
        """``tree`` in flat form with its padded leaves rebuilt (:func:`unflatten`)."""
        if not self.active:
            return tree

        def one(path: tuple[Any, ...], x: Any) -> Any:
            param = self._param(path)
            return x if param is None else unflatten(x, param, self.tensor, self.expert, self.expert_tensor)
        return jax.tree_util.tree_map_with_path(one, tree)

    def spec(self, path: tuple[Any, ...], spec: P) -> P:
        """The moments' PartitionSpec of the leaf at ``path`` (testbed.runner.parallel.Layout.moments), or for a
        padded leaf its flat form's: the split dims' axes, then the flat dim over the optimizer's axes."""
        param = self._param(path) if self.active else None
        if param is None:
            return spec
        return flat_spec(param, self.axes, self.tensor, self.expert, self.expert_tensor)


def refold(tree: Any, src: FlatState, dst: FlatState) -> Any:
    """``tree`` held as ``src`` holds it, as ``dst`` holds it: a leaf both hold flat at the same shard count is
    left as it is (the same flat form: nothing moves), any other flat leaf rebuilt and flattened again."""
    def one(path: tuple[Any, ...], x: Any) -> Any:
        a, b = src.param(path), dst.param(path)
        if a is not None and b is not None and src.ways == dst.ways:
            return x
        x = x if a is None else unflatten(x, a, src.tensor, src.expert, src.expert_tensor)
        return x if b is None else flatten(x, b, dst.tensor, dst.ways, dst.expert, dst.expert_tensor)
    return jax.tree_util.tree_map_with_path(one, tree)
