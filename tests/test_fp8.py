"""fp8-mixed precision: matmuls at the device's fp8 peak where it has one, bf16 state; the runner refuses it."""

from __future__ import annotations

import pytest

from testbed.model.memory import memory_breakdown, state_bytes_per_param
from testbed.plan.io import plan_from_dict
from testbed.plan.spec import Precision
from testbed.sim.graph.engine import simulate
from testbed.topology.io import load_topology


def _plan(precision: str, d_model: int = 4096, **mesh):
    return plan_from_dict({
        "name": f"fp8-{precision}",
        "model": {"layers": 2, "d_model": d_model, "heads": 32, "d_ff": 4 * d_model, "seq_len": 2048,
                  "vocab": 32000},
        "batch": {"global_batch": 16, "microbatches": 2}, "mesh": mesh or {"data": 8},
        "precision": precision, "remat": "none"}, default_name="fp8")


def test_precision_fp8_values():
    p = Precision("fp8-mixed")
    assert p is Precision.FP8_MIXED and p.compute_dtype == "fp8" and p.compute_bytes == 2 and p.mixed
    assert not Precision.FP32.mixed and Precision.BF16_MIXED.mixed


def test_device_fp8_peak_and_fallback():
    h100, a100 = load_topology("dgx-h100").device, load_topology("dgx-a100-superpod").device
    assert h100.has_fp8() and h100.flops("fp8") == pytest.approx(1979e12)
    assert not a100.has_fp8() and a100.flops("fp8") == a100.flops("bf16")


def test_fp8_is_faster_than_bf16_on_h100_for_a_compute_bound_plan():
    topo = load_topology("dgx-h100")
    bf16 = simulate(_plan("bf16-mixed"), topo).report
    fp8 = simulate(_plan("fp8-mixed"), topo).report
    assert fp8.compute_s < 0.95 * bf16.compute_s
    assert fp8.step_time_s < bf16.step_time_s
    # Far from twice as fast: fp8 GEMMs reach less of their peak than bf16's unless k is long (measured),
    # the recipe's casts, attention, the memory-bound work and the communication do not speed up.
    assert fp8.step_time_s > 0.6 * bf16.step_time_s


def test_fp8_gemm_runs_at_its_measured_cap_and_pays_its_casts():
    from testbed.model.gemm import Gemm
    from testbed.sim.price.compute import fp8_cast_bytes, gemm_seconds, pass_seconds

    topo = load_topology("dgx-h100")
    compute = topo.calibration.compute
    g = Gemm(8192, 8192, 8192)
    cap = compute.fp8_efficiency * 8192 / (8192 + compute.fp8_gemm_half_k)
    kernel = gemm_seconds(topo, "fp8", g, casts=False)
    assert kernel == pytest.approx(compute.gemm_latency_s + g.flops / (1979e12 * cap))
    assert gemm_seconds(topo, "fp8", g) - kernel == pytest.approx(pass_seconds(topo, fp8_cast_bytes(g)))
    assert fp8_cast_bytes(g) == 3 * 8192 * 8192
    # 1.5-2x bf16 on a large GEMM (the measured caps), never the peaks' full 2x
    assert 1.5 < gemm_seconds(topo, "bf16", g) / kernel < 2.0
    # a shorter reduction reaches less of the fp8 peak
    short = Gemm(8192, 8192, 1024)
    assert g.flops / kernel > 1.2 * short.flops / gemm_seconds(topo, "fp8", short, casts=False)
    # flash attention stays bf16 under the recipe
    flash = Gemm(2048, 2048, 128, batch=32, flash=True)
    assert gemm_seconds(topo, "fp8", flash) == gemm_seconds(topo, "bf16", flash)


def test_fp8_is_bf16_on_a100():
    topo = load_topology("a100-pcie-8")
    bf16 = simulate(_plan("bf16-mixed"), topo).report
    fp8 = simulate(_plan("fp8-mixed"), topo).report
    assert fp8.step_time_s == pytest.approx(bf16.step_time_s, rel=1e-9)


def test_fp8_memory_is_bf16_mixed_state_plus_the_weights_fp8_copies():
    topo = load_topology("dgx-h100")
    assert state_bytes_per_param(_plan("fp8-mixed")) == state_bytes_per_param(_plan("bf16-mixed")) == (2, 2, 12)
    a = memory_breakdown(_plan("fp8-mixed"), topo).as_dict()
    b = memory_breakdown(_plan("bf16-mixed"), topo).as_dict()
    # Transformer Engine keeps each weight in fp8 and its fp8 transpose: 2 bytes per parameter held
    assert a["params"] == b["params"] + 2 * b["device_params_count"]
    assert {k: v for k, v in a.items() if k not in ("params", "total", "per_stage", "fits")} == \
        {k: v for k, v in b.items() if k not in ("params", "total", "per_stage", "fits")}
    # fully sharded weights: only the gathered layer's copies
    from testbed.model.memory import _layer_params_per_device

    c = memory_breakdown(_plan("fp8-mixed", fsdp=8), topo).as_dict()
    d = memory_breakdown(_plan("bf16-mixed", fsdp=8), topo).as_dict()
    assert c["params"] - d["params"] == 2 * _layer_params_per_device(_plan("fp8-mixed", fsdp=8))


def test_runner_refuses_fp8_on_cpu_with_exit_2(tmp_path, capsys):
    from testbed.cli.main import main

    plan = tmp_path / "fp8.yaml"
    plan.write_text("name: fp8-tiny\nmodel: {layers: 1, d_model: 16, heads: 2, d_ff: 32, seq_len: 8, vocab: 32}\n"
                    "batch: {global_batch: 8, microbatches: 1}\nmesh: {data: 8}\nprecision: fp8-mixed\n")
    assert main(["run", "--plan", str(plan), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "precision" in err and "fp8" in err and "bf16-mixed" in err and "Traceback" not in err
    # check-sharding lowers for the plan's devices, not this host's: the host's lack of fp8 is no reason to refuse
    assert main(["check-sharding", "--plan", str(plan), "--topology", "host-cpu-8", "--json"]) == 0


def test_check_precision_names_devices_without_fp8():
    from testbed.runner.precision import check_precision, has_fp8

    class Dev:
        def __init__(self, platform, cc=None, kind=""):
            self.platform, self.device_kind = platform, kind
            if cc is not None:
                self.compute_capability = cc

    assert has_fp8(Dev("gpu", "9.0")) and has_fp8(Dev("gpu", "8.9")) and not has_fp8(Dev("gpu", "8.0"))
    assert not has_fp8(Dev("cpu")) and not has_fp8(Dev("tpu"))
    from testbed.errors import InputError

    with pytest.raises(InputError, match="NVIDIA A100"):
        check_precision(_plan("fp8-mixed"), [Dev("gpu", "8.0", "NVIDIA A100-SXM4-80GB")])
    check_precision(_plan("bf16-mixed"), [Dev("cpu")])  # nothing to refuse
