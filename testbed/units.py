"""SI quantities with suffixes: bytes, bandwidth, time and FLOP/s.

Topology and plan files write ``450GB/s``, ``100Gb/s``, ``1us``, ``80GiB`` or
``989TFLOP/s``; this module turns them into floats in base units (bytes,
bytes/s, seconds, FLOP/s) and back into short human strings.
"""

from __future__ import annotations

import math
import re

from testbed.errors import InputError

__all__ = [
    "parse_bytes",
    "parse_bandwidth",
    "parse_time",
    "parse_flops",
    "format_bytes",
    "format_bandwidth",
    "format_time",
    "format_flops",
]

_SI = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_IEC = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def _number(value: object, field: str) -> float | None:
    if isinstance(value, bool):
        raise InputError(f"expected a number, got {value!r}", field=field)
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, str):
        raise InputError(f"expected a number or a string with units, got {value!r}", field=field)
    return None


def _prefix(prefix: str, text: str, field: str, example: str) -> float:
    if prefix in _IEC:
        return _IEC[prefix]
    if prefix in _SI:
        return _SI[prefix]
    raise InputError(f"cannot read {text!r}: unknown unit prefix {prefix!r}; write e.g. {example}", field=field)


def _positive(value: float, text: object, field: str, allow_zero: bool) -> float:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        need = "non-negative" if allow_zero else "positive"
        raise InputError(f"must be {need}, got {text!r}", field=field)
    return value


def parse_bytes(value: object, field: str = "bytes", allow_zero: bool = False) -> float:
    """``80GiB`` -> 85899345920.0; ``2MB`` -> 2e6; a bare number is bytes."""
    number = _number(value, field)
    if number is None:
        text = str(value).strip()
        m = re.fullmatch(_NUMBER + r"\s*([kKMGTPE]i?)?\s*(B|bytes?)?", text)
        if not m or (m.group(2) is None and m.group(3) is None and not re.fullmatch(_NUMBER, text)):
            raise InputError(f"cannot read {value!r} as bytes; write e.g. 80GiB, 2MB or 1024", field=field)
        number = float(m.group(1)) * _prefix(m.group(2) or "", text, field, "80GiB")
    return _positive(number, value, field, allow_zero)


def parse_bandwidth(value: object, field: str = "bandwidth") -> float:
    """``450GB/s`` -> 4.5e11 bytes/s; ``100Gb/s`` (bits) -> 1.25e10 bytes/s."""
    number = _number(value, field)
    if number is None:
        text = str(value).strip()
        m = re.fullmatch(_NUMBER + r"\s*([kKMGTPE]i?)?(B|b|bit|bits|byte|bytes)(/s|ps)", text)
        if not m:
            raise InputError(
                f"cannot read {value!r} as a bandwidth; write bytes per second per direction, e.g. 450GB/s or 100Gb/s",
                field=field,
            )
        scale = _prefix(m.group(2) or "", text, field, "450GB/s")
        bits = m.group(3) in ("b", "bit", "bits")
        number = float(m.group(1)) * scale / (8.0 if bits else 1.0)
    return _positive(number, value, field, allow_zero=False)


_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_time(value: object, field: str = "latency", allow_zero: bool = True) -> float:
    """``1us`` -> 1e-6 seconds; a bare number is seconds."""
    number = _number(value, field)
    if number is None:
        text = str(value).strip()
        m = re.fullmatch(_NUMBER + r"\s*(s|ms|us|µs|ns)", text)
        if not m:
            raise InputError(f"cannot read {value!r} as a time; write e.g. 1us, 2.5ms or 0.001", field=field)
        number = float(m.group(1)) * _TIME[m.group(2)]
    return _positive(number, value, field, allow_zero)


def parse_flops(value: object, field: str = "flops") -> float:
    """``989TFLOP/s`` or ``989T`` -> 9.89e14 FLOP/s."""
    number = _number(value, field)
    if number is None:
        text = str(value).strip()
        m = re.fullmatch(_NUMBER + r"\s*([kKMGTPE])?\s*(FLOP/s|FLOPS|flop/s|flops)?", text)
        if not m:
            raise InputError(f"cannot read {value!r} as FLOP/s; write e.g. 989TFLOP/s or 9.89e14", field=field)
        number = float(m.group(1)) * _SI[m.group(2) or ""]
    return _positive(number, value, field, allow_zero=False)


def _format(value: float, unit: str, base: float = 1000.0, prefixes: str = "kMGTPE") -> str:
    if value == 0 or not math.isfinite(value):
        return f"{value:g} {unit}"
    exponent = 0
    while abs(value) >= base and exponent < len(prefixes):
        value /= base
        exponent += 1
    prefix = prefixes[exponent - 1] if exponent else ""
    if base == 1024.0 and prefix:
        prefix += "i"
    return f"{value:.3g} {prefix}{unit}"


def format_bytes(value: float) -> str:
    """1.5 GiB style (binary prefixes, as memory is sold)."""
    return _format(float(value), "B", base=1024.0, prefixes="KMGTPE")


def format_bandwidth(value: float) -> str:
    """450 GB/s style (decimal prefixes, as links are sold)."""
    return _format(float(value), "B/s")


def format_flops(value: float) -> str:
    return _format(float(value), "FLOP/s")


def format_time(seconds: float) -> str:
    """Seconds in the unit that keeps 1-999: 12.3 ms, 4.5 us."""
    s = float(seconds)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if abs(s) >= scale or unit == "ns":
            return f"{s / scale:.3g} {unit}"
    return f"{s:g} s"
