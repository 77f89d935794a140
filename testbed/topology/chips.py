"""Which chip a device is: from a topology's device name and from the device kind JAX reports, one rule for the
runner (the datasheet peak behind a measured MFU, testbed.runner.results) and calibrate (the base topology of the
devices it measures, testbed.calibration.calibrated)."""

from __future__ import annotations

__all__ = ["chip", "kind_chip", "is_chip"]

#: JAX's device kinds of the TPUs whose marketing name differs: a v5e chip reports itself as ``TPU v5 lite`` (seen on
#: the chip), a v5p as ``TPU v5``, a v6e as ``TPU v6 lite``.
_TPU_KINDS = {"tpu v5 lite": "tpu v5e", "tpu v6 lite": "tpu v6e", "tpu v5": "tpu v5p"}


def _words(text: str) -> str:
    return " ".join(text.lower().replace("-", " ").replace("_", " ").split())


def chip(device_name: str) -> str:
    """The chip of a topology's device name: ``H100-SXM5-80GB`` -> ``h100``, ``TPU-v5e`` -> ``tpu v5e``."""
    tokens = _words(device_name).split()
    return " ".join(tokens[:2]) if tokens and tokens[0] == "tpu" else (tokens[0] if tokens else "")


def kind_chip(device_kind: str) -> str:
    """JAX's ``device_kind`` in words, a TPU's in its chip's name: ``TPU v5 lite`` -> ``tpu v5e``."""
    kind = _words(device_kind)
    return _TPU_KINDS.get(kind, kind)


def is_chip(device_name: str, device_kind: str) -> bool:
    """Whether JAX's ``device_kind`` is the chip a topology's ``device_name`` names."""
    name = chip(device_name)
    return bool(name) and name in kind_chip(device_kind)
