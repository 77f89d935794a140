"""A testing kit for users' own parallel JAX code (``pmap``, ``shard_map``, ``jit`` with shardings).

Importing this package starts nothing: JAX is imported inside the functions
that need it, so a test process can still choose its device count. The parts:

* :mod:`testbed.testing.plugin` -- a pytest plugin (entry point ``pytest11``,
  active wherever testbed is installed) that requests N emulated host devices
  (``--testbed-devices N``, ini ``testbed_devices``, default 8) and provides
  the fixtures ``testbed_devices``, ``mesh_factory`` and ``reference_device``;
* :func:`assert_parallel_equal` -- run the parallel function and the
  single-device reference, compare the outputs leaf by leaf (tolerances from the backend's matmul precision,
  :mod:`testbed.testing.precision`) and explain a difference (psum where pmean was meant, one wrong shard, a
  bubble leak), then diagnose it by re-running the parallel function with one controlled change at a time
  (:mod:`testbed.testing.diagnose`);
* :func:`assert_sharded` -- state that must be split over a mesh axis (ZeRO's optimizer state);
* :func:`per_shard_reference` and :func:`assert_replicas_differ` -- random numbers each shard draws for
  itself (dropout): the reference per shard with the shard's own key, and the check that replicas differ;
* :mod:`testbed.testing.strategies` -- hypothesis strategies (``meshes``,
  ``partition_specs``, ``shardings``, ``batches``, ``plans``); needs hypothesis;
* helpers for ``pmap`` code: :func:`replicate`, :func:`shard_batch`,
  :func:`unreplicate`.
"""

from __future__ import annotations

from testbed.testing.compare import assert_outputs_equal, assert_parallel_equal
from testbed.testing.shards import assert_replicas_differ, per_shard_reference, shard_key
from testbed.testing.sharded import assert_sharded
from testbed.testing.precision import MatmulPrecision, matmul_precision
from testbed.testing.devices import (ReferenceDevice, backend_started, replicate, request_host_devices, shard_batch,
                                     unreplicate)

__all__ = ["assert_parallel_equal", "assert_outputs_equal", "assert_replicas_differ", "per_shard_reference",
           "shard_key", "assert_sharded", "MatmulPrecision", "matmul_precision", "ReferenceDevice", "backend_started",
           "request_host_devices", "replicate", "shard_batch", "unreplicate"]
