"""Collective timing speed: closed forms on a 1024-rank group, one routed 256-rank ring program.

- closed_form_evals_per_s: ``closed_form_time`` for a 1024-rank all-reduce on
  one switch, a new message size every call (nothing memoized by size).
- collective_time_new_bytes_per_s: the public ``collective_time`` (closed form,
  bound, result object) with a new size every call, algorithm ``ring``.
- collective_time_cached_per_s: the same call repeated (memo hit), as the
  simulator issues it for many identical groups.
- ring256_program_s: build the 256-rank ring all-reduce step program, route
  and profile it on a fresh 256-device ring topology, and time it once.
- ring256_auto_s: ``auto`` over all applicable algorithms on that ring (fresh).
Prints one JSON object.
"""

from __future__ import annotations

import json
import time

from testbed.collectives import algorithms

from testbed.topology import generators
from testbed.collectives.closed_form import closed_form_time
from testbed.collectives.timing import collective_time, program_time
from testbed.topology import Calibration, CollectiveCalibration, DeviceSpec

DEVICE = DeviceSpec(name="H100-like", peak_flops={"bf16": 989e12}, memory_bytes=80e9, memory_bandwidth=3.35e12)


def _rate(fn, seconds: float = 0.5) -> float:
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(200):
            fn(calls)
            calls += 1
    return calls / (time.perf_counter() - start)


def main() -> None:
    switch = generators.switch(1024, device=DEVICE, bandwidth=450e9, latency=1e-6,
                               calibration=Calibration(collectives=CollectiveCalibration(overhead_s=5e-6)))
    group = tuple(range(1024))
    closed_form_time(switch, "all_reduce", "ring", group, 1.0)  # recognise the symmetry once
    closed = _rate(lambda i: closed_form_time(switch, "all_reduce", "ring", group, 1e6 + i))
    fresh = _rate(lambda i: collective_time(switch, "all_reduce", group, 1e6 + i, "ring"))
    cached = _rate(lambda i: collective_time(switch, "all_reduce", group, 1e6, "ring"))

    algorithms._cached.cache_clear()
    ring = generators.ring(256, device=DEVICE, bandwidth=100e9, latency=1e-6)
    start = time.perf_counter()
    seconds, rounds = program_time(ring, "all_reduce", "ring", [tuple(range(256))], 2.0**30)
    ring_s = time.perf_counter() - start

    ring = generators.ring(256, device=DEVICE, bandwidth=100e9, latency=1e-6)
    start = time.perf_counter()
    auto = collective_time(ring, "all_reduce", tuple(range(256)), 2.0**30)
    auto_s = time.perf_counter() - start
    print(json.dumps({
        "closed_form_evals_per_s": round(closed),
        "collective_time_new_bytes_per_s": round(fresh),
        "collective_time_cached_per_s": round(cached),
        "ring256_program_s": round(ring_s, 4),
        "ring256_rounds": rounds,
        "ring256_transfers": 2 * 255 * 256,
        "ring256_predicted_s": seconds,
        "ring256_auto_s": round(auto_s, 4),
        "ring256_auto_algorithm": auto.algorithm,
    }))


if __name__ == "__main__":
    main()
