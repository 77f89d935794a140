"""Test setup: 8 emulated CPU devices before JAX starts, hypothesis profiles.

HYPOTHESIS_PROFILE=ci (default, small and fast) or thorough (large). The profile governs every
property test: a test that needs fewer (or more) examples than the profile's ``max_examples`` asks
for a share of it (``@settings(max_examples=max(1, settings().max_examples // 5))``, read when the
test module is imported, after this file has loaded the profile), never for a fixed number, which
would override the thorough profile too.
"""

from __future__ import annotations

import os
import re

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
else:
    os.environ["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+",
                                     "--xla_force_host_platform_device_count=8", _flags)
# The tests check what programs compute and which collectives they run, on tiny models, never how fast the
# compiled code is: XLA:CPU's LLVM backend optimisation is most of each compile and buys nothing here (an
# 8-device pipeline verify: 41 s of CPU at the default level, 24 s at 0). HLO passes (SPMD partitioning,
# collectives, buffer assignment) are untouched. A level set by the caller is kept.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
