"""The plan's optimizer over the parameters the trainers hold: plain optax, or fp32 master weights.

The plan's ``precision: bf16-mixed`` is "bf16 params+grads, fp32 master +
Adam moments", and ``testbed.model.memory`` counts exactly that per parameter
(2 + 2 + 4 + 4 x moments bytes, the master counted as optimizer state). So
under bf16-mixed the trainers hold bf16 parameters, differentiate w.r.t.
them (bf16 gradients, bf16 accumulators) and the optimizer state carries
the fp32 master beside the optax moments (:class:`MasterState`). The
update:

1. casts the bf16 gradients to fp32;
2. runs the plan's optax transformation on the master;
3. applies it to the master in fp32 and returns ``master.astype(bf16)`` as
   the new parameters.

``optax.apply_updates`` on the bf16 parameters would round every update
into bf16 (a 1e-3 step on a weight near 1.0 is below bf16's 2^-8 spacing
and vanishes), which is why the master exists. Under fp32 the wrapper is
plain optax.

Shardings: the master's leaves sit under :class:`MasterState`'s ``master``
field with the parameters' own paths, so ``testbed.runner.step.state_shardings``
(which matches optimizer-state leaves to the moments' shardings by the
parameter path they end with) shards the master exactly like the moments:
over ``fsdp``, and over ``data`` for ZeRO stage >= 1.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jax.sharding import NamedSharding

from testbed.runner.model import compute_dtype
from testbed.runner.padding import FlatState, refold
from testbed.errors import InputError
from testbed.plan.spec import Plan, Precision

__all__ = ["make_optimizer", "MasterState", "Optimizer", "check_precision", "has_fp8", "matmul_precision"]

#: CUDA compute capability from which NVIDIA GPUs have fp8 tensor cores (Ada 8.9, Hopper 9.0).
FP8_COMPUTE_CAPABILITY = 8.9


def has_fp8(device: Any) -> bool:
    """Whether a JAX device has fp8 matmul units (an NVIDIA GPU of compute capability >= 8.9)."""
    if getattr(device, "platform", "") != "gpu":
        return False
    try:
        return float(getattr(device, "compute_capability", "0")) >= FP8_COMPUTE_CAPABILITY
    except ValueError:
        return False


def check_precision(plan: Plan, devices: Any = None) -> None:
    """Refuse a precision the runner cannot execute on ``devices`` (default: ``jax.devices()``).

    fp8-mixed needs fp8 matmul units: on CPUs, TPUs and GPUs before Ada/Hopper it is refused
    naming the device; the runner does not yet run fp8 matmuls on any device either (the
    simulator prices them: ``testbed simulate``), so it is refused there too, saying so.
    """
    if plan.precision is not Precision.FP8_MIXED:
        return
    devices = list(devices if devices is not None else jax.devices())
    lacking = [d for d in devices if not has_fp8(d)]
    if lacking:
        d = lacking[0]
        kind = getattr(d, "device_kind", "") or getattr(d, "platform", "device")
        raise InputError(f"`fp8-mixed` needs devices with fp8 matmul units (NVIDIA GPUs of compute capability >= "
                         f"{FP8_COMPUTE_CAPABILITY}, e.g. H100), but {len(lacking)} of the {len(devices)} devices "
                         f"here are {kind} ({getattr(d, 'platform', '?')}); run this plan with `precision: "
                         f"bf16-mixed`, or simulate fp8 with `testbed simulate` on a topology with an fp8 peak",
                         field="precision")
    raise InputError("the runner does not execute `fp8-mixed` matmuls yet (these devices have fp8 units); run "
                     "with `precision: bf16-mixed`, or simulate fp8 with `testbed simulate`", field="precision")


def matmul_precision(plan: Plan) -> contextlib.AbstractContextManager:
    """The context the plan's steps trace and compile in: ``jax.default_matmul_precision("highest")`` under
    ``runtime.matmul_precision: highest`` (fp32 matmuls in full fp32: several bf16 passes on a TPU), else JAX's
    default (the backend's: one bf16 pass for an fp32 matmul on a TPU; JAX's ``jax.default_matmul_precision``
    docs), what testbed.topology.parts.matmul_dtype prices."""
    if plan.runtime.matmul_precision == "highest":
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def make_optimizer(plan: Plan) -> optax.GradientTransformation:
    """The plan's optax optimizer (elementwise, so it splits exactly across stages and shards)."""
    o = plan.optimizer
    if o.name == "sgd":
        return optax.sgd(o.learning_rate)
    if o.name == "adam":
        return optax.adam(o.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps)
    return optax.adamw(o.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)


class MasterState(NamedTuple):
    """Optimizer state under bf16-mixed: the fp32 master parameters and the optax state over them."""

    master: Any
    inner: Any


class Optimizer:
    """``init(params) -> state`` and ``update(params, state, grads) -> (params, state)`` for a plan.

    Pure functions (jit them with the trainer's shardings); the precision
    decides what the held parameters are:

    - fp32: held parameters are the fp32 parameters; the state is optax's.
    - bf16-mixed: held parameters are bf16; the state is a
      :class:`MasterState` (fp32 master + optax state over it).
    """

    def __init__(self, plan: Plan, sharded: bool = True):
        self.tx = make_optimizer(plan)
        self.mixed = plan.precision.mixed
        #: The state of parameters the one shard rule pads is kept flat and padded (testbed.runner.padding);
        #: ``sharded`` False: the plan's optimizer on one device (the single-device reference), nothing padded.
        self.flat = FlatState(plan, active=sharded)
        #: The held parameters (and their gradients) that the rule pads under fsdp / ZeRO-3, flat and padded too.
        self.hold = FlatState(plan, active=sharded, which="params")
        #: dtype of the parameters the trainers hold (and of their gradients).
        self.param_dtype = compute_dtype(plan.precision)

    def _cast(self, params: Any) -> Any:
        """``params`` in the held dtype (bf16 copies under bf16-mixed)."""
        if not self.mixed:
            return params
        return jax.tree.map(lambda a: a.astype(self.param_dtype), params)

    def held(self, params: Any) -> Any:
        """The parameters a trainer holds, from fp32 ones in the model's shapes (host numpy or arrays): bf16
        copies under bf16-mixed, the leaves the rule pads under fsdp / ZeRO-3 in their flat form."""
        return self.hold.to(self._cast(params))

    def whole(self, tree: Any) -> Any:
        """A held tree (parameters or gradients) in the model's shapes: :meth:`held`'s flat leaves rebuilt."""
        return self.hold.back(tree)

    def init(self, params: Any) -> Any:
        """The optimizer state for fp32 ``params`` (the initial values: under bf16-mixed the master is exact)."""
        if not self.mixed:
            return self.tx.init(self.flat.to(params))
        master = self.flat.to(jax.tree.map(lambda a: a.astype(jnp.float32), params))
        return MasterState(master=master, inner=self.tx.init(master))

    def init_held(self, params: Any) -> Any:
        """:meth:`init` from fp32 parameters held as :meth:`held` holds them (flat where it pads): a trainer
        places them with its parameters' shardings."""
        return self.init(self.whole(params))

    def update(self, params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
        """One optimizer step on held ``params`` and ``grads``: new held parameters and state (see the module
        doc for bf16-mixed). A leaf held flat at the optimizer's shard count stays in that form throughout."""
        if not self.mixed:
            flat = refold(params, self.hold, self.flat)
            updates, state = self.tx.update(refold(grads, self.hold, self.flat), state, flat)
            return refold(optax.apply_updates(flat, updates), self.flat, self.hold), state
        grads = refold(jax.tree.map(lambda g: g.astype(jnp.float32), grads), self.hold, self.flat)
        updates, inner = self.tx.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        # Cast, then rebuild the padded leaves: a rebuild that regathers a flat shard moves the held dtype's bytes.
        return refold(self._cast(master), self.flat, self.hold), MasterState(master=master, inner=inner)

    def master(self, params: Any, state: Any) -> Any:
        """The full-precision parameters in the model's shapes: the master under bf16-mixed, else ``params``."""
        return self.flat.back(state.master) if self.mixed else self.whole(params)

    def moment_shardings(self, moments: Any) -> Any:
        """The moments' NamedShardings (testbed.runner.parallel.Layout's) with the padded leaves' flat forms'."""
        return jax.tree_util.tree_map_with_path(
            lambda path, sh: NamedSharding(sh.mesh, self.flat.spec(path, sh.spec)), moments)
