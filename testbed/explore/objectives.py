"""The search's objectives: a plan's value stepping in a given time (testbed.explore.search ranks by it).

``step_time`` (seconds, lower is better), ``tokens_per_s``, ``mfu`` (each precision against its own peak) and
``cost`` (tokens per dollar, from a price per device-hour); higher is better for the last three.
"""

from __future__ import annotations

from testbed.errors import InputError
from testbed.model.costs import model_flops_per_step
from testbed.plan.spec import Plan
from testbed.topology import Topology

__all__ = ["OBJECTIVES", "objective_value"]

#: Objective -> True when higher is better.
OBJECTIVES: dict[str, bool] = {"step_time": False, "tokens_per_s": True, "mfu": True, "cost": True}


def objective_value(objective: str, plan: Plan, topology: Topology, step_time_s: float,
                    price_per_device_hour: float | None = None) -> float:
    """The objective's value of ``plan`` stepping in ``step_time_s`` (``cost``: tokens per dollar).

    ``cost`` prices a device-hour at ``price_per_device_hour``, or else at the
    topology's own ``price_per_device_hour``.
    """
    if step_time_s <= 0:
        return 0.0 if OBJECTIVES[objective] else float("inf")
    if objective == "step_time":
        return step_time_s
    if objective == "tokens_per_s":
        return plan.tokens_per_step / step_time_s
    if objective == "mfu":
        peak = topology.device.flops(plan.precision.compute_dtype)
        return model_flops_per_step(plan) / (topology.num_devices * peak * step_time_s)
    if objective == "cost":
        if price_per_device_hour is None:
            price_per_device_hour = topology.price_per_device_hour
        if price_per_device_hour is None:
            raise InputError(f"the cost objective needs a positive price per device-hour: give --price or add "
                             f"`price_per_device_hour` to the topology `{topology.name}`", field="--price")
        from testbed.topology.spec import check_price

        check_price(price_per_device_hour, "--price")
        dollars = price_per_device_hour * topology.num_devices * step_time_s / 3600.0
        return plan.tokens_per_step / dollars
    raise InputError(f"unknown objective `{objective}`; valid: {', '.join(OBJECTIVES)}", field="--objective")
