"""Devices for the runner: emulated host devices, local accelerators, many processes.

``--devices emulated:N`` asks XLA for N host (CPU) devices. That count is read
once, when JAX starts its backends, so :func:`prepare` must run before the
first computation; a process whose JAX already started with another count
gets an :class:`InputError` instead of a silently different mesh.
``--devices local`` takes whatever ``jax.devices()`` gives (GPUs, TPUs or the
CPU). With several processes (``--processes K`` locally, or SLURM / TPU pods)
:func:`initialize_distributed` joins them first and every process sees the
global device list.

The mesh always comes from :func:`testbed.plan.placement.place`: its
``device_ids`` array (dims in ``MESH_AXES`` order) indexes the device list,
so the runner and the simulator agree on which device holds which coordinate.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from testbed.errors import InputError
from testbed.plan.placement import Placement, place
from testbed.plan.spec import MESH_AXES, Plan

__all__ = [
    "DeviceRequest", "parse_devices", "prepare", "initialize_distributed", "select_devices", "build_mesh",
    "stage_mesh", "STAGE_MESH_AXES", "describe", "plan_placement", "owns", "transfer",
]

#: Axis names of one pipeline stage's sub-mesh (the stage axis removed).
STAGE_MESH_AXES: tuple[str, ...] = tuple(a.value for a in MESH_AXES[1:])

_FLAG = "--xla_force_host_platform_device_count"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceRequest:
    """What ``--devices`` asked for: ``emulated`` host devices (``count`` of them) or ``local``."""

    kind: str
    count: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("emulated", "local"):
            raise InputError(f"unknown device kind `{self.kind}`; valid: emulated:N, local", field="--devices")
        if self.kind == "emulated" and (self.count is None or self.count < 1):
            raise InputError("emulated needs a positive device count, e.g. emulated:8", field="--devices")

    def __str__(self) -> str:
        return f"emulated:{self.count}" if self.kind == "emulated" else "local"


def parse_devices(text: str | None, default_count: int) -> DeviceRequest:
    """Parse ``--devices`` (``emulated:N`` or ``local``); absent, ``emulated:<default_count>`` (a CPU host)."""
    if text is None or text == "":
        return DeviceRequest(kind="emulated", count=default_count)
    match = re.fullmatch(r"emulated:(\d+)", text.strip())
    if match:
        return DeviceRequest(kind="emulated", count=int(match.group(1)))
    if text.strip() == "local":
        return DeviceRequest(kind="local")
    raise InputError(f"`{text}` is not a device choice; valid: emulated:N (N host devices) or local",
                     field="--devices")


def _jax_started() -> bool:
    """Whether JAX backends exist already (the device count can no longer change)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def prepare(request: DeviceRequest, local_count: int | None = None) -> None:
    """Set the host device count before JAX starts (no-op for ``local``).

    ``local_count`` is this process's share with several processes (N/K).
    Raises InputError when JAX already runs with a different device count.
    """
    if request.kind != "emulated":
        return
    count = local_count if local_count is not None else request.count
    if _jax_started():
        import jax

        have = jax.local_device_count()
        if have != count or jax.default_backend() != "cpu":
            raise InputError(
                f"JAX already started in this process with {have} {jax.default_backend()} device(s), so "
                f"emulated:{request.count} cannot be set; run `testbed` in a fresh process or pass "
                f"--devices emulated:{have}", field="--devices")
        return
    flags = os.environ.get("XLA_FLAGS", "")
    flags = re.sub(rf"{_FLAG}=\d+", "", flags).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={count}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", count)


def initialize_distributed(coordinator: str | None, num_processes: int | None, process_id: int | None, *,
                           bind_host: str | None = None) -> None:
    """Join the processes of one job (gloo collectives on CPU).

    With all arguments ``None`` JAX reads the cluster environment itself
    (SLURM, Open MPI, Cloud TPU). ``bind_host`` (``127.0.0.1`` for the local
    workers of ``--processes K``) is the only address the job listens on:
    process 0's coordinator service (JAX binds ``[::]`` unless told) and
    every process's gloo pairs (gloo otherwise binds the address the machine's
    hostname resolves to).
    """
    import jax

    if jax.config.jax_platforms in ("cpu",) or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if bind_host is not None:
        _gloo_binds(bind_host)
    if coordinator is None:
        jax.distributed.initialize()
    else:
        port = coordinator.rpartition(":")[2]
        bind = None if bind_host is None else f"{bind_host}:{port}"
        jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=60,
                                   coordinator_bind_address=bind)


def _gloo_binds(host: str) -> None:
    """Make the CPU backend's gloo collectives listen on ``host``.

    JAX builds them with ``make_gloo_tcp_collectives(distributed_client=...)``
    and no address, and offers no setting for one; this process's CPU backend
    is not created yet (:func:`prepare` runs first), so the factory it will
    call is wrapped to pass ``hostname=host``.
    """
    from jax._src import xla_bridge

    make = xla_bridge._jax.make_gloo_tcp_collectives
    if getattr(make, "_testbed_host", None) == host:
        return

    def make_on_host(*args: Any, hostname: str | None = None, **kwargs: Any) -> Any:
        return make(*args, hostname=hostname or host, **kwargs)

    make_on_host._testbed_host = host  # type: ignore[attr-defined]
    xla_bridge._jax.make_gloo_tcp_collectives = make_on_host


def select_devices(count: int | None = None) -> list[Any]:
    """The global device list in a stable order (process, then id); the first ``count`` if given.

    Raises InputError when fewer devices exist than asked for.
    """
    import jax

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if count is None:
        return devices
    if count > len(devices):
        raise InputError(
            f"the plan's mesh needs {count} devices but JAX has {len(devices)} "
            f"({devices[0].platform}); use --devices emulated:{count} on a CPU host, or change the mesh degrees",
            field="mesh")
    return devices[:count]


def build_mesh(placement: Placement, devices: list[Any]) -> Any:
    """The full ``jax.sharding.Mesh`` (axes stage, data, fsdp, tensor) of a placement."""
    import jax

    if len(devices) != placement.num_devices:
        raise InputError(f"the mesh uses {placement.num_devices} devices but {len(devices)} were given", field="mesh")
    array = np.asarray(devices, dtype=object)[placement.device_ids]
    names = tuple(a.value for a in MESH_AXES)
    return jax.sharding.Mesh(array, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def stage_mesh(placement: Placement, devices: list[Any], stage: int) -> Any:
    """The sub-mesh of one pipeline stage (axes data, fsdp, tensor)."""
    import jax

    array = np.asarray(devices, dtype=object)[placement.sub_mesh(stage)]
    return jax.sharding.Mesh(array, STAGE_MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(STAGE_MESH_AXES))


def plan_placement(plan: Plan, devices: list[Any]) -> Placement:
    """Placement of ``plan`` on exactly ``len(devices)`` devices (InputError if they differ)."""
    return place(plan, num_devices=len(devices))


def describe(devices: list[Any]) -> dict[str, Any]:
    """Platform, device count and process count (for reports)."""
    import jax

    return {"platform": devices[0].platform, "devices": len(devices), "processes": jax.process_count(),
            "device_kind": devices[0].device_kind}


def host_cache_bytes(platform: str, root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Largest activation whose elementwise passes run from cache on emulated CPU devices: half a core's L2.

    A pass reads one tensor and writes another, so both fit in the L2 when
    each is at most half of it (calibration ``cache_bytes``). 0 on GPUs and
    TPUs (their passes are priced without a cache split) and when the OS
    does not say (``root``: the kernel's cache description of CPU 0).
    """
    if platform != "cpu":
        return 0
    try:
        for index in sorted(os.listdir(root)):
            with open(os.path.join(root, index, "level")) as f:
                if f.read().strip() != "2":
                    continue
            with open(os.path.join(root, index, "size")) as f:
                size = f.read().strip()
            units = {"K": 1024, "M": 1024 ** 2}
            return int(size[:-1]) * units[size[-1]] // 2 if size[-1] in units else int(size) // 2
    except (OSError, ValueError):
        return 0
    return 0


_TRANSFERS: dict[tuple, Any] = {}


def owns(sharding: Any) -> bool:
    """Whether this process holds any device of ``sharding``."""
    import jax

    if isinstance(sharding.mesh, jax.sharding.AbstractMesh):
        return True  # abstract devices (testbed.runner.check_sharding): every stage is this process's to lower
    return any(d.process_index == jax.process_index() for d in sharding.device_set)


def transfer(x: Any, shape: tuple[int, ...], dtype: Any, src: Any, dst: Any) -> Any:
    """Move an array from sharding ``src`` to the same-shaped ``dst`` on other devices, across processes.

    Every process holding a device of ``src`` or ``dst`` must call this, in
    the same order (``x`` is ignored where this process holds none of
    ``src``). The two sub-meshes become the two rows of a ``pair`` mesh and a
    jitted ``shard_map`` ``ppermute`` moves each shard from row 0 to row 1:
    one collective-permute, which works between processes where
    ``jax.device_put`` cannot. Returns the array on ``dst`` (None where this
    process holds none of ``dst``).
    """
    import jax
    import jax.numpy as jnp

    spec = tuple(src.spec) + (None,) * (len(shape) - len(src.spec))
    key = (tuple(d.id for d in src.mesh.devices.ravel()), tuple(d.id for d in dst.mesh.devices.ravel()),
           src.mesh.axis_names, spec)
    if key not in _TRANSFERS:
        pair = jax.sharding.Mesh(np.stack([src.mesh.devices, dst.mesh.devices]), ("pair",) + src.mesh.axis_names,
                                 axis_types=(jax.sharding.AxisType.Auto,) * (1 + len(src.mesh.axis_names)))
        pspec = jax.P("pair", *spec)
        move = jax.jit(jax.shard_map(lambda a: jax.lax.ppermute(a, "pair", [(0, 1)]), mesh=pair,
                                     in_specs=pspec, out_specs=pspec))
        _TRANSFERS[key] = (jax.NamedSharding(pair, pspec), move)
    pair_sharding, move = _TRANSFERS[key]
    shard = dst.shard_shape(shape)
    local = {s.device: s.data for s in x.addressable_shards} if x is not None and owns(src) else {}
    src_devices = set(src.device_set)
    pieces = []
    for device in pair_sharding.addressable_devices_indices_map((2, *shape)):
        data = local[device] if device in src_devices else jax.device_put(jnp.zeros(shard, dtype), device)
        pieces.append(data.reshape((1, *shard)))
    # One transfer in flight at a time: gloo needs every process to issue its collectives in the same
    # order, and asynchronously dispatched programs may otherwise start out of order.
    moved = jax.block_until_ready(move(jax.make_array_from_single_device_arrays((2, *shape), pair_sharding,
                                                                                 jax.block_until_ready(pieces))))
    if not owns(dst):
        return None
    dst_devices = set(dst.device_set)
    out = [s.data.reshape(shard) for s in moved.addressable_shards if s.device in dst_devices]
    return jax.make_array_from_single_device_arrays(shape, dst, out)
