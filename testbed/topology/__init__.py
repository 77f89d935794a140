"""Topologies: devices, switches and links; generators by shape; routes; YAML files; calibration."""

from testbed.topology.calibration import Calibration
from testbed.topology.parts import DeviceSpec, Form, Level, LinkKind, LinkSpec
from testbed.topology.spec import Topology, level_sizes

__all__ = ["Calibration", "DeviceSpec", "Form", "Level", "LinkKind", "LinkSpec", "Topology", "level_sizes"]
