"""A topology at any size: ``NAME@DEVICES`` and ``--devices N`` resize its outermost level.

What is resized, by form (docs/topology-format.md, "A topology at any size"):

- ``levels``: the outermost tier's size (``dgx-h100-superpod@256``: 32 nodes of
  8 GPUs on the same InfiniBand switch, 8 x 400 Gb/s per node as declared);
- ``torus``: the outermost dim (``tpu-v5e-16x16@64`` is a 16 x 4 torus whose
  dims keep the wraparound the file declares); a multi-slice torus changes its
  slice count (``tpu-v5p-multislice@256``: two slices), never a slice's shape;
- ``graph``: not resizable (its links are explicit).

Valid sizes are whole multiples of the inner levels' device count, up to
:data:`testbed.fields.MAX_DEVICES`. A resized topology is named
``NAME@DEVICES`` so that a plan written with it (``search --out``) names it.
"""

from __future__ import annotations

import re
from dataclasses import replace

from testbed.errors import InputError
from testbed.fields import MAX_DEVICES
from testbed.topology.parts import Form
from testbed.topology.spec import Topology

__all__ = ["resize_topology", "split_sized_name", "sized_name", "inner_devices"]

_SIZED = re.compile(r"^(?P<base>.+)@(?P<devices>[0-9]{1,9})$")


def split_sized_name(text: str) -> tuple[str, int | None]:
    """(base, devices) of ``NAME@DEVICES``; (text, None) when ``text`` carries no ``@`` and a whole number."""
    match = _SIZED.match(text)
    if match is None:
        return text, None
    return match.group("base"), int(match.group("devices"))


def sized_name(base: str, devices: int | None) -> str:
    """``base@devices`` (a ``@N`` already on ``base`` is replaced); ``base`` when ``devices`` is None."""
    if devices is None:
        return base
    return f"{split_sized_name(base)[0]}@{devices}"


def inner_devices(topology: Topology) -> int:
    """Devices inside one member of the outermost level (the step between valid sizes)."""
    return topology.num_devices // topology.levels[-1].size


def _valid_sizes(topology: Topology) -> str:
    step = inner_devices(topology)
    first = ", ".join(f"{k * step:,}" for k in (1, 2, 3, 4))
    return (f"its outermost level `{topology.levels[-1].name}` grows in steps of {step:,} devices, so valid "
            f"sizes are the multiples of {step:,}: {first}, ... up to {MAX_DEVICES // step * step:,}")


def resize_topology(topology: Topology, devices: int, field: str = "--devices") -> Topology:
    """``topology`` with its outermost level resized to hold ``devices`` devices, named ``NAME@DEVICES``.

    The same topology when ``devices`` is its size. Raises InputError naming
    ``field`` and the valid sizes when ``devices`` is not a whole multiple of
    the inner levels' devices, or for an explicit graph.
    """
    if devices == topology.num_devices:
        return topology
    if topology.form is Form.GRAPH or not topology.levels:
        raise InputError(f"cannot resize `{topology.name}` to {devices:,} devices: an explicit `graph:` topology "
                         f"names every link; write a topology file of that size (docs/topology-format.md)",
                         field=field)
    if isinstance(devices, bool) or not isinstance(devices, int) or not 1 <= devices <= MAX_DEVICES \
            or devices % inner_devices(topology):
        raise InputError(f"cannot resize `{topology.name}` to {devices:,} devices; {_valid_sizes(topology)}",
                         field=field)
    outer = topology.levels[-1]
    levels = (*topology.levels[:-1], replace(outer, size=devices // inner_devices(topology)))
    description = (f"{topology.description}; resized to {devices:,} devices ({outer.name} "
                   f"{levels[-1].size:,} x {inner_devices(topology):,})") if topology.description else ""
    return replace(topology, levels=levels, num_devices=devices, name=sized_name(topology.name, devices),
                   description=description)
