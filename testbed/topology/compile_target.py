"""A compiler target for deviceless compiles: ``tpu:FAMILY:DIMS``, e.g. ``tpu:v5e:4x4``, ``tpu:v5p:8x8x16``.

``testbed check-sharding --compile TARGET`` compiles a plan's step for a
TPU slice that need not exist: libtpu's deviceless topology
(``jax.experimental.topologies.get_topology_desc(topology_name, platform="tpu")``)
gives the slice's devices, and XLA:TPU compiles for them. This module reads
and checks the target string without JAX; the names are libtpu's
(``FAMILY:DIMS``, the chips per torus dimension; libtpu 0.0.42 reads them
with the pattern ``^([a-zA-Z0-9_ ]+)[=_:]([0-9x]+)(_twisted|_untwisted)?$``).

- v5e and v6e slices are 2-D (``v5e:4x4``, ``v6e:16x16``), v4 and v5p 3-D
  (``v5p:2x2x2``, ``v4:4x4x4``), v2 and v3 2-D.
- v2, v3 and v4 chips hold two TensorCores, and libtpu's deviceless
  topology lists each core as a device (``v4:2x2x1`` has 8 devices); v5e,
  v5p and v6e have one device per chip.
- Slices of fewer than 2x2 chips (``v5e:1x1``) are compiled with libtpu's
  ``chips_per_host_bounds`` set to the slice (the default host is 2x2x1 chips).
"""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass

from testbed.errors import InputError, quote

__all__ = ["CompileTarget", "parse_target", "target_topology", "check_target_devices", "MISSING_LIBTPU", "libtpu_missing", "FAMILIES", "FAMILY_TOPOLOGY", "TARGET_FORMS"]

#: TPU generation -> (torus dimensions, devices per chip in libtpu's deviceless topology).
FAMILIES: dict[str, tuple[int, int]] = {"v2": (2, 2), "v3": (2, 2), "v4": (3, 2), "v5e": (2, 1), "v5p": (3, 1),
                                        "v6e": (2, 1)}

#: One paragraph for messages: the valid forms of a target.
TARGET_FORMS = ("a target is tpu:FAMILY:DIMS, the slice's chips per torus dimension as libtpu names them: "
                "tpu:v5e:RxC or tpu:v6e:RxC (2-D, e.g. tpu:v5e:1x1, tpu:v5e:4x4, tpu:v5e:16x16), tpu:v5p:XxYxZ or "
                "tpu:v4:XxYxZ (3-D, e.g. tpu:v5p:2x2x2, tpu:v5p:8x8x16, tpu:v4:4x4x4), tpu:v2:RxC or tpu:v3:RxC; "
                "v2, v3 and v4 have two devices (TensorCores) per chip")

#: The one line ``check-sharding --compile`` prints without libtpu.
MISSING_LIBTPU = ("--compile needs libtpu (XLA:TPU's compiler), which this Python environment lacks: "
                  "pip install 'jax-testbed[tpu]' (or the libtpu wheel matching jaxlib)")


def libtpu_missing() -> str | None:
    """None when libtpu is importable (found without importing it, or JAX), else :data:`MISSING_LIBTPU`."""
    return None if importlib.util.find_spec("libtpu") is not None else MISSING_LIBTPU


_FORM = re.compile(r"^tpu:(v\d+[a-z]?):(\d+(?:x\d+)*)$")

#: Largest chip count accepted (libtpu's deviceless v4 topology goes to 16x16x16 = 4,096 chips).
MAX_CHIPS = 16384


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileTarget:
    """A TPU slice to compile for: its generation and chips per torus dimension."""

    family: str
    dims: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise InputError(f"unknown TPU family {quote(self.family)}; {TARGET_FORMS}", field="--compile")
        rank = FAMILIES[self.family][0]
        if len(self.dims) != rank or min(self.dims) < 1:
            raise InputError(f"tpu:{self.family} needs {rank} positive dimensions, got {quote(self.dims)}; "
                             f"{TARGET_FORMS}", field="--compile")
        if math.prod(self.dims) > MAX_CHIPS:
            raise InputError(f"{self.name}: {math.prod(self.dims):,} chips, at most {MAX_CHIPS:,}; {TARGET_FORMS}",
                             field="--compile")

    @property
    def name(self) -> str:
        """The command-line spelling, ``tpu:v5e:4x4``."""
        return f"tpu:{self.libtpu_name}"

    @property
    def libtpu_name(self) -> str:
        """libtpu's topology name, ``v5e:4x4``."""
        return f"{self.family}:{'x'.join(map(str, self.dims))}"

    @property
    def chips(self) -> int:
        return math.prod(self.dims)

    @property
    def devices(self) -> int:
        """Devices libtpu's deviceless topology lists: chips times TensorCores listed per chip."""
        return self.chips * FAMILIES[self.family][1]

    @property
    def device_name(self) -> str:
        """The device name bundled topology files give this family (``TPU-v5e``)."""
        return f"TPU-{self.family}"

    @property
    def host_bounds(self) -> tuple[int, int, int] | None:
        """libtpu's ``chips_per_host_bounds`` for slices smaller than its default 2x2x1 host, else None."""
        if self.dims[0] >= 2 and self.dims[1] >= 2:
            return None
        return (min(self.dims[0], 2), min(self.dims[1], 2), 1)


def parse_target(text: str) -> CompileTarget:
    """``tpu:FAMILY:DIMS`` -> :class:`CompileTarget`; InputError (field ``--compile``) naming the valid forms."""
    match = _FORM.match(text.strip().lower())
    if not match:
        raise InputError(f"cannot read the target {quote(text)}; {TARGET_FORMS}", field="--compile")
    return CompileTarget(family=match.group(1), dims=tuple(int(d) for d in match.group(2).split("x")))


#: Bundled topology whose device (peak FLOP/s, HBM) and ICI links a target's topology takes, per family.
FAMILY_TOPOLOGY: dict[str, str] = {"v4": "tpu-v4-4x4x4", "v5e": "tpu-v5e-4x4", "v5p": "tpu-v5p-2x4x4"}


def _wraparound(target: CompileTarget) -> tuple[bool, ...]:
    """Per dim: v5e/v6e rings close at 16 chips (topologies/tpu-v5e-16x16.yaml); v4/v5p get wraparound links
    on full cubes, every dim a multiple of 4 (topologies/tpu-v5p-2x4x4.yaml, tpu-v4-4x4x4.yaml)."""
    if FAMILIES[target.family][0] == 2:
        return tuple(d == 16 for d in target.dims)
    cube = all(d % 4 == 0 for d in target.dims)
    return (cube,) * len(target.dims)


def check_target_devices(target: CompileTarget, topology, hint: str) -> None:
    """InputError (field ``--compile``) unless ``topology`` has the target's devices: its TPU family's device and as
    many of them. ``hint`` ends the message: what the user can pass instead."""
    if topology.device.name != target.device_name or topology.num_devices != target.devices:
        raise InputError(f"{target.name} compiles for {target.devices:,} {target.device_name} devices but the "
                         f"topology {topology.name} has {topology.num_devices:,} {topology.device.name} devices; "
                         f"{hint}", field="--compile")


def target_topology(target: CompileTarget):
    """The topology of a target's slice: its family's bundled device and ICI links on a torus of its dims.

    InputError for a family without a bundled topology (v2, v3, v6e) and for v4, whose libtpu devices are
    TensorCores, two per chip, while bundled topologies count chips: pass ``--topology`` for those.
    """
    from testbed.topology.generators import torus
    from testbed.topology.io import load_topology

    if target.family not in FAMILY_TOPOLOGY or FAMILIES[target.family][1] != 1:
        raise InputError(f"no bundled topology for {target.name}'s devices (bundled: v5e and v5p slices); pass "
                         f"--topology with a topology of {target.devices:,} {target.device_name} devices",
                         field="--compile")
    base = load_topology(FAMILY_TOPOLOGY[target.family])
    link = base.levels[0]
    return torus(target.dims, device=base.device, bandwidth=link.bandwidth, latency=link.latency, kind=link.kind,
                 wraparound=_wraparound(target), name=f"tpu-{target.family}-{'x'.join(map(str, target.dims))}",
                 calibration=base.calibration)
