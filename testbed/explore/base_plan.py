"""The plans a search starts from: a model preset as a single-device plan, and a plan shrunk to verify on a CPU."""

from __future__ import annotations

from dataclasses import replace

from testbed.errors import InputError, closest
from testbed.plan import presets
from testbed.plan.io import plan_from_dict
from testbed.plan.spec import BatchSpec, ModelSpec, Plan, ScheduleName

__all__ = ["preset_plan", "shrink_plan"]


def preset_plan(name: str, global_batch: int | None = None, seq_len: int | None = None) -> Plan:
    """A single-device AdamW plan of the model preset ``name`` (testbed.plan.presets; the search re-lays it out).

    bf16-mixed, but fp32 for the CPU-sized ``gpt-tiny``; the batch is the
    preset's default (``DEFAULT_BATCH``) unless given.
    """
    if name not in presets.PRESETS:
        hint = closest(name, presets.preset_names())
        raise InputError(f"unknown model `{name}`" + (f" (did you mean `{hint}`?)" if hint else "")
                         + f"; give a plan file or a preset: {', '.join(presets.preset_names())}", field="--model")
    model: dict = {"preset": name, **({"seq_len": seq_len} if seq_len is not None else {})}
    return plan_from_dict({"name": name, "model": model,
                           "batch": {"global_batch": global_batch or presets.DEFAULT_BATCH[name]},
                           "precision": "fp32" if name == "gpt-tiny" else "bf16-mixed"}, default_name=name)


def shrink_plan(plan: Plan, devices: int = 8) -> Plan:
    """``plan``'s layout on ``devices`` devices with a tiny model of the same shape constraints, to verify on a CPU.

    Degrees are divided by prime factors (data first, then fsdp, stage,
    context, expert, tensor) until the mesh uses ``devices``; schedule,
    virtual stages, microbatches, ZeRO, remat, precision and sequence
    parallelism stay. The model becomes the smallest GPT that every kept
    degree divides (two layers per chunk, two heads per tensor rank, a
    sequence of two chunks per context rank that the tensor ranks split, two
    experts per expert rank with the plan's top_k, shared experts and
    capacity where it routes), with one sequence per microbatch and replica.
    """
    if devices < 1 or plan.mesh.size % devices:
        raise InputError(f"cannot shrink a {plan.mesh.size}-device mesh to {devices} devices (not a divisor)",
                         field="--devices")
    axes = ("data", "fsdp", "stage", "context", "expert", "tensor")
    degrees = {a: plan.mesh.degree(a) for a in axes}
    excess = plan.mesh.size // devices
    for axis in axes:
        for prime in range(2, excess + 1):
            while excess % prime == 0 and degrees[axis] % prime == 0:
                excess //= prime
                degrees[axis] //= prime
    mb = plan.batch.microbatches
    if plan.schedule.name is ScheduleName.INTERLEAVED and degrees["stage"] > 1 and mb % degrees["stage"]:
        mb = degrees["stage"] * max(1, mb // degrees["stage"])
    t, chunks = degrees["tensor"], degrees["stage"] * plan.schedule.virtual_stages
    heads = 2 * t
    unit = 2 * degrees["context"] * t  # two chunks per context rank, each split over the tensor ranks
    m = plan.model
    moe = {} if not m.experts else {
        "experts": 2 * degrees["expert"], "top_k": min(m.top_k, 2 * degrees["expert"]),
        "shared_experts": min(m.shared_experts, 1), "capacity_factor": m.capacity_factor,
        "router_aux_loss": m.router_aux_loss}
    spec = ModelSpec(layers=2 * chunks, d_model=8 * heads, heads=heads, d_ff=32 * heads,
                     seq_len=unit * -(-16 // unit), vocab=64 * t, **moe)
    replicas = degrees["data"] * degrees["fsdp"] * degrees["expert"]
    return replace(plan, model=spec, mesh=replace(plan.mesh, **degrees), layers_per_stage=None,
                   batch=BatchSpec(global_batch=replicas * mb, microbatches=mb), name=f"{plan.name}-shrunk")
