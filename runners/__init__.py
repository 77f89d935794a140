"""The runner: the plan executed with JAX on emulated host devices, GPUs or TPUs, one or many processes.

A library the ``testbed`` commands call (never the other way round):
:mod:`~runners.train` runs and verifies a plan, :mod:`~runners.measure`
times microbenchmarks and steps for calibration, :mod:`~runners.validate`
times plans beside their predictions, :mod:`~runners.launch` starts local
worker processes; the trainers are :mod:`~runners.step` (one SPMD program)
and :mod:`runners.pipeline` (schedule tables over stage sub-meshes).
"""
