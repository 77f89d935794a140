"""Topologies: devices, switches and links; generators by shape; routes; YAML files; calibration."""

from testbed.topology.calibration import (Calibration, CollectiveCalibration, ComputeCalibration,
                                           ControllerCalibration, ElementwiseCalibration, HostCalibration,
                                           MemoryCalibration)
from testbed.topology.parts import DeviceSpec, Form, Level, LinkKind, LinkSpec
from testbed.topology.spec import Topology, level_sizes

__all__ = ["Calibration", "CollectiveCalibration", "ComputeCalibration", "ControllerCalibration",
           "ElementwiseCalibration", "HostCalibration", "MemoryCalibration", "DeviceSpec", "Form", "Level", "LinkKind", "LinkSpec", "Topology", "level_sizes"]
