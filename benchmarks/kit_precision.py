"""The backend's float32 matmul against float64: measured error and the bound testbed.testing assumes for it.

For contractions k of 64 to 4096 (random normal A of 64 x k, B of k x 32), the largest
|fl(AB) - AB|_ij / (|A||B|)_ij at the backend's default precision and at "highest", next to
testbed.testing.precision's bound for the backend (2u + u^2 + gamma_k, Higham sec. 3.1). On a TPU the
default should sit near the bf16 bound (u = 2^-8) and "highest" near float32's; on CPU both near float32's.
Prints one JSON object. Runs on whatever JAX's default backend is (the chip: JAX_PLATFORMS=tpu).
"""

from __future__ import annotations

import json

import numpy as np


def measure(k: int) -> dict:
    import jax
    import jax.numpy as jnp

    from testbed.testing import matmul_precision

    rng = np.random.default_rng(k)
    a, b = rng.normal(size=(64, k)).astype(np.float32), rng.normal(size=(k, 32)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    row = {"k": k}
    for setting in ("default", "highest"):
        got = np.asarray(jax.jit(lambda x, y: jnp.matmul(x, y, precision=setting))(a, b), np.float64)
        row[f"{setting}_max_rel"] = float((np.abs(got - exact) / scale).max())
        row[f"{setting}_bound"] = matmul_precision(setting=None if setting == "default" else setting).bound(k)
    return row


def main() -> None:
    import jax

    from testbed.testing import matmul_precision

    precision = matmul_precision()
    print(json.dumps({"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
                      "jax": jax.__version__, "setting": precision.setting, "bits": precision.bits,
                      "rows": [measure(k) for k in (64, 256, 1024, 4096)]}))


if __name__ == "__main__":
    main()
