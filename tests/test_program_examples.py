"""examples/predict: each user step is correct on emulated devices (the testing kit) before it is predicted."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from testbed.testing import assert_parallel_equal, replicate, shard_batch, unreplicate

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(autouse=True)
def _example_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES / "predict"))


def test_the_pmap_mlp_equals_its_single_device_step(testbed_devices) -> None:
    import pmap_mlp

    n = 8
    pmapped = jax.pmap(pmap_mlp.train_step, axis_name="batch", devices=testbed_devices[:n])

    def parallel(params, x, y):
        return unreplicate(pmapped(replicate(params, n), shard_batch(x, n), shard_batch(y, n)))

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 8)).astype(np.float32), rng.normal(size=(32, 4)).astype(np.float32)
    assert_parallel_equal(parallel, pmap_mlp.reference_step, pmap_mlp.init_params(), x, y, rtol=1e-5, atol=1e-5)


def test_the_shard_map_mlp_equals_its_single_device_step(testbed_devices) -> None:
    import shard_map_mlp

    mesh = jax.sharding.Mesh(np.array(testbed_devices[:8]).reshape(2, 4), ("data", "model"))
    step = shard_map_mlp.make_step(mesh)

    def parallel(params, x, y):
        args = (params["w1"], params["w2"], x, y)
        return step(*(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, shard_map_mlp.SPECS)))

    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16, 8)).astype(np.float32)
    assert_parallel_equal(parallel, shard_map_mlp.reference_step, shard_map_mlp.init_params(), x, y,
                          rtol=1e-5, atol=1e-5)


def test_the_cnn_trained_data_parallel_equals_its_single_device_step(testbed_devices) -> None:
    import vision_cnn

    mesh = jax.sharding.Mesh(np.array(testbed_devices[:8]), ("data",))
    step = vision_cnn.make_step(mesh)
    rng = np.random.default_rng(2)
    images = rng.normal(size=(16, 8, 8, 3)).astype(np.float32)
    labels = rng.integers(0, 3, size=(16,)).astype(np.int32)
    assert_parallel_equal(step, jax.jit(vision_cnn.train_step), vision_cnn.init_params(), images, labels,
                          rtol=1e-4, atol=1e-5)


def test_program_host_prices_a_saved_run_without_measuring(tmp_path, capsys) -> None:
    """``benchmarks/program_host.py --from-json``: a saved run's rounds priced anew (nothing timed): the
    prediction is the traced step's on the topology, the error against the saved step, and each round's host
    speed is scaled by the reference step's prediction now over the one the run recorded."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("program_host", EXAMPLES.parent / "benchmarks" / "program_host.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from testbed.calibration.steps import step_plan
    from testbed.sim.graph.engine import simulate
    from testbed.topology.io import load_topology

    mesh, sizes = bench.HOST_SIZES["vision_cnn"]
    row = {"mesh": mesh, "sizes": sizes, "measured_s": 0.02, "round_medians_s": [0.02, 0.03], "round_cpu_s": [0.03, 0.03],
           "host_speeds": [1.0, 0.5], "measured_at_calibrated_speed_s": 0.016}
    reference = simulate(step_plan("cpu-m", 8), load_topology("host-cpu-8")).report.step_time_s
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"rows": {"vision_cnn": row}, "reference_step": {"plan": "cpu-m", "predicted_s": 2 * reference},
                                 "steps": 10, "rounds": 2}))
    assert bench.main(["--from-json", str(saved)]) == 0
    out = json.loads(capsys.readouterr().out)
    got = out["rows"]["vision_cnn"]
    module = bench._example("vision_cnn", sizes)  # priced with its compiled step's transposing kernels
    predicted = bench.predicted(module, mesh, load_topology("host-cpu-8"), bench.compiled_hlo(module, mesh))
    assert predicted > bench.predicted(module, mesh, load_topology("host-cpu-8"))
    assert got["predicted_s"] == pytest.approx(predicted) and got["error"] == pytest.approx(predicted / 0.02 - 1)
    assert got["measured_at_calibrated_speed_s"] == pytest.approx(0.016 / 2)  # the reference now predicts half
    assert out["median_abs_error"] == out["max_abs_error"] == pytest.approx(abs(predicted / 0.02 - 1))
