"""What ``testbed calibrate`` fits on a topology: the :class:`Calibration` it carries."""

from __future__ import annotations

from dataclasses import dataclass

from testbed.errors import InputError

__all__ = ["Calibration"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """Fields fitted by ``testbed calibrate`` (defaults: an ideal machine).

    compute_efficiency: fraction of peak FLOP/s a large matmul reaches.
    efficiency_half_flops: FLOPs of one kernel at which it reaches half of
        ``compute_efficiency`` (small kernels are latency bound).
    memory_efficiency: fraction of peak memory bandwidth reached.
    replicated_passes, split_passes: memory passes, at the calibrated
        bandwidth, over each byte of activations a compute task writes
        (testbed.model.costs.layer_traffic_bytes), replicated on every tensor rank
        or split over them: the memory-bound kernels between the matmuls
        (LayerNorm, GELU, softmax, residual adds, layout copies), added to
        the matmul roofline. A compiler that fuses them has few passes;
        XLA:CPU many. Both 0 (the default) leave them out.
    cache_bytes, cached_passes: a compute task whose ``[tokens, d_model]``
        activation is at most ``cache_bytes`` (a pass reads one such tensor
        and writes another: half the core's L2) makes its passes from cache,
        ``cached_passes`` over its replicated and split bytes instead (XLA:CPU
        on a 512 KiB-L2 host: a pass over 256 KiB tensors costs a third of
        one over 512 KiB ones). ``cache_bytes`` 0 (the default): none does.
    launch_overhead_s: fixed cost per compute task (kernel/program dispatch).
    collective_overhead_s: software cost per round of a collective.
    host_cores: if > 0, devices share this many host cores (emulated CPU
        devices): ``n`` devices computing at once run at ``min(1, cores / n)``
        of their speed alone.
    host_throughput: measured instead (``calibrate``): pairs ``(n, T)``, the
        work of ``T`` devices alone that ``n`` devices computing at once get
        done (``T(1) = 1``; linear between points, flat after the last), so
        each runs at ``T(n) / n``. Measured on a 2-core host: two XLA:CPU
        devices at once get 1.0-1.4 devices' worth done, not the 2 a core
        count says. Overrides ``host_cores`` when given.
    controller_overhead_s: host time the single controller spends per program
        it dispatches (one per pipeline action and its sends, testbed.sim.program);
    controller_step_s: host time it spends once per step besides (making and
        placing the batch, summing the loss).
    controller_pipeline_step_s: what a pipeline step (MPMD: one program per
        action) costs it per step beyond that (splitting the batch into
        microbatches and placing them per stage).
    controller_buffer_s: host time per device buffer a dispatched program
        takes or returns (arrays x devices, testbed.model.buffers). All three 0
        leave the controller out of the simulation.
    """

    compute_efficiency: float = 1.0
    efficiency_half_flops: float = 0.0
    memory_efficiency: float = 1.0
    replicated_passes: float = 0.0
    split_passes: float = 0.0
    cache_bytes: float = 0.0
    cached_passes: float = 0.0
    launch_overhead_s: float = 0.0
    collective_overhead_s: float = 0.0
    host_cores: int = 0
    host_throughput: tuple[tuple[int, float], ...] = ()
    controller_overhead_s: float = 0.0
    controller_step_s: float = 0.0
    controller_pipeline_step_s: float = 0.0
    controller_buffer_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "memory_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1.5:
                raise InputError(f"must be in (0, 1.5], got {value}", field=f"calibration.{name}")
        for name in ("efficiency_half_flops", "replicated_passes", "split_passes", "cache_bytes", "cached_passes", "launch_overhead_s",
                     "collective_overhead_s", "controller_overhead_s", "controller_step_s",
                     "controller_pipeline_step_s", "controller_buffer_s"):
            if getattr(self, name) < 0:
                raise InputError(f"must be non-negative, got {getattr(self, name)}", field=f"calibration.{name}")
        if self.host_cores < 0:
            raise InputError(f"must be non-negative, got {self.host_cores}", field="calibration.host_cores")
        curve = tuple((int(n), float(t)) for n, t in self.host_throughput)
        object.__setattr__(self, "host_throughput", curve)
        if curve and (curve[0] != (1, 1.0) or any(b[0] <= a[0] for a, b in zip(curve, curve[1:]))
                      or any(not 0 < t <= n for n, t in curve)):
            raise InputError(f"must map device counts 1 < n2 < ... to 0 < T(n) <= n, starting at 1: 1.0; got "
                             f"{dict(curve)}", field="calibration.host_throughput")

    def caches(self, tensor_bytes: float) -> bool:
        """Whether a task whose ``[tokens, d_model]`` activation is ``tensor_bytes`` makes its passes from cache."""
        return 0 < tensor_bytes <= self.cache_bytes

    @property
    def shares_host(self) -> bool:
        """Whether devices computing at once slow each other (emulated devices of one host)."""
        return bool(self.host_throughput) or self.host_cores > 0

    def host_share(self, computing: float) -> float:
        """Fraction of its speed alone each of ``computing`` devices (at once) runs at."""
        if computing <= 1:
            return 1.0
        if self.host_throughput:
            curve = self.host_throughput
            done = curve[-1][1]
            for (n0, t0), (n1, t1) in zip(curve, curve[1:]):
                if computing <= n1:
                    done = t0 + (t1 - t0) * (computing - n0) / (n1 - n0)
                    break
            return min(1.0, done / computing)
        return min(1.0, self.host_cores / computing) if self.host_cores > 0 else 1.0
