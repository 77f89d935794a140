"""The runner: the plan executed with JAX on emulated host devices, GPUs or TPUs, one or many processes.

A library the ``testbed`` commands call (never the other way round):
:mod:`~testbed.runner.train` runs and verifies a plan, :mod:`~testbed.runner.measure`
times microbenchmarks and steps for calibration, :mod:`~testbed.runner.validate`
times plans beside their predictions, :mod:`~testbed.runner.launch` starts local
worker processes; the trainers are :mod:`~testbed.runner.step` (one SPMD program)
and :mod:`testbed.runner.pipeline` (schedule tables over stage sub-meshes).
"""
