"""`testbed run --program` and `testbed validate --program`: a user's own step timed on emulated devices beside its
prediction (XLA's memory, the compiled collectives per axis), --json strict, bad input one paragraph."""

from __future__ import annotations

import json
import math
import subprocess
import textwrap
from pathlib import Path

import pytest

from testbed.cli.main import main
from testbed.interpreter import python_argv, python_env

from helpers import refused

PROGRAMS = textwrap.dedent("""\
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    def _loss(params, x):
        return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"]) ** 2)

    def mlp(mesh):
        rep, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P(mesh.axis_names))
        def step(params, x):
            print("the user's step is traced")
            grads = jax.grad(_loss)(params, x)
            return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), x
        params = {"w1": jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=rep),
                  "w2": jax.ShapeDtypeStruct((128, 64), jnp.float32, sharding=rep)}
        x = jax.ShapeDtypeStruct((16 * mesh.size, 64), jnp.float32, sharding=batch)
        return jax.jit(step, donate_argnums=(0,)), (params, x)

    def tp(mesh):
        def body(w1, w2, x):
            y = jax.lax.psum(jnp.tanh(x @ w1) @ w2, "model")
            return jax.lax.pmean(jnp.mean(y ** 2), "data")
        f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "model"), P("model", None), P("data")), out_specs=P())
        on = lambda spec: NamedSharding(mesh, spec)
        return jax.jit(jax.grad(f, argnums=(0, 1))), (
            jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=on(P(None, "model"))),
            jax.ShapeDtypeStruct((128, 64), jnp.float32, sharding=on(P("model", None))),
            jax.ShapeDtypeStruct((8 * mesh.shape["data"], 64), jnp.float32, sharding=on(P("data"))))

    def broken_at_run(mesh):
        def step(x):
            return jax.pure_callback(lambda a: 1 / 0, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return jax.jit(step), (jax.ShapeDtypeStruct((8,), jnp.float32),)
    """)


@pytest.fixture
def programs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "user_programs.py").write_text(PROGRAMS)
    monkeypatch.chdir(tmp_path)
    return Path("user_programs.py")


def _json(argv: list[str], capsys: pytest.CaptureFixture) -> dict:
    code = main([*argv, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


@pytest.mark.parametrize("function, mesh, axes", [("mlp", "data=2", {"data"}), ("mlp", "data=4", {"data"}),
                                                  ("tp", "data=2,model=2", {"data", "model"})])
def test_run_measures_the_program_beside_its_prediction(programs: Path, function: str, mesh: str, axes: set,
                                                        capsys: pytest.CaptureFixture) -> None:
    devices = math.prod(int(part.split("=")[1]) for part in mesh.split(","))
    data = _json(["run", "--program", f"{programs}:{function}", "--mesh", mesh, "--devices", "local",
                  "--topology", f"host-cpu-8@{devices}", "--steps", "2"], capsys)
    assert data["devices"]["devices"] == devices and data["rounds"] == 1 and len(data["step_times_s"]) == 2
    assert data["measured_s"] == min(data["round_medians_s"]) > 0 and data["compile_time_s"] > 0
    assert data["predicted_s"] > 0 and data["error"] == pytest.approx(data["predicted_s"] / data["measured_s"] - 1)
    xla = data["xla_memory"]
    assert data["measured_memory"] == xla["argument"] + xla["output"] + xla["temp"] - xla["alias"] > 0
    assert data["memory_error"] == pytest.approx(data["predicted_memory"] / data["measured_memory"] - 1)
    assert "live-range estimate" in data["predicted_memory_method"]
    # fp32 steps: the traced bytes per axis are the compiled program's
    assert set(data["compiled_collectives"]) == axes and data["bytes_per_axis_equal"] is True


def test_run_without_a_topology_only_measures_and_prints_text(programs: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["run", "--program", f"{programs}:mlp", "--mesh", "data=2", "--devices", "local", "--steps",
                 "1"]) == 0
    out = capsys.readouterr()
    assert "measured" in out.out and "(XLA)" in out.out and "over data: all_reduce" in out.out
    assert "the user's step is traced" in out.err and "the user's step is traced" not in out.out


@pytest.mark.slow  # calibrate's reference step compiled on 2 devices
def test_validate_times_rounds_and_the_host_drift(programs: Path, capsys: pytest.CaptureFixture) -> None:
    data = _json(["validate", "--program", f"{programs}:mlp", "--mesh", "data=2", "--devices", "local",
                  "--topology", "host-cpu-8@2", "--steps", "1", "--rounds", "2"], capsys)
    assert data["rounds"] == 2 and len(data["round_medians_s"]) == 2 and data["bytes_per_axis_equal"] is True
    drift = data["diagnostics"]
    assert len(drift["host_speeds"]) == 2 and drift["reference_step"]["plan"].startswith("cpu-m")
    assert drift["error_at_calibrated_speed"] == pytest.approx(
        data["predicted_s"] / drift["measured_at_calibrated_speed_s"] - 1)


def test_bad_measurements_are_one_paragraph(programs: Path, capsys: pytest.CaptureFixture) -> None:
    spec = f"{programs}:mlp"
    assert "not both" in refused(["run", "--program", spec, "--plan", "demo"], capsys)
    assert "--processes" in refused(["run", "--program", spec, "--processes", "2"], capsys)
    assert "emulated:4 does not match" in refused(["run", "--program", spec, "--mesh", "data=2", "--devices",
                                                   "emulated:4"], capsys)
    assert "multiply to 4" in refused(["validate", "--program", spec, "--mesh", "data=2", "--topology",
                                       "host-cpu-8@4"], capsys)
    assert "--program" in refused(["validate", "--topology", "host-cpu-8"], capsys)
    err = refused(["run", "--program", f"{programs}:broken_at_run", "--mesh", "data=1", "--devices", "local"], capsys)
    assert "'user_programs.py:broken_at_run' raised" in err and "(while being run on the devices)" in err


@pytest.mark.slow  # a fresh process with its own emulated devices
def test_run_on_emulated_devices_in_a_fresh_process(programs: Path) -> None:
    out = subprocess.run(python_argv("-m", "testbed.cli", "run", "--program", f"{programs}:tp", "--mesh",
                                     "data=2,model=2", "--devices", "emulated:4", "--steps", "2", "--json"),
                         capture_output=True, text=True, timeout=300, env=python_env())
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["devices"]["devices"] == 4 and set(data["compiled_collectives"]) == {"data", "model"}
