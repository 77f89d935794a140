"""testbed.testing: a user project outside the repository gets the plugin and 8 emulated devices by installing
testbed; the kit's comparison explains psum-for-pmean, one bad shard and bubble leaks; its strategies draw
valid meshes, specs and plans; importing it starts no JAX backend."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import given, strategies as st

from testbed.plan.spec import Plan
from testbed.testing import (assert_outputs_equal, assert_parallel_equal, assert_replicas_differ, per_shard_reference,
                             replicate, shard_batch, unreplicate)
from testbed.testing.devices import request_host_devices
from testbed.testing.strategies import batches, factorisations, meshes, partition_specs, plans, shardings

USER_TEST = '''
import jax
import numpy as np
import pytest
from jax import lax

from testbed.testing import assert_parallel_equal, replicate, shard_batch, unreplicate

REDUCE = {reduce}


def loss(w, x, y):
    return ((x @ w - y) ** 2).mean()


def step(w, x, y):
    return w - 0.1 * REDUCE(jax.grad(loss)(w, x, y), "batch")


def reference(w, x, y):
    return w - 0.1 * jax.grad(loss)(w, x, y)


def test_devices(testbed_devices):
    assert len(testbed_devices) == len(jax.devices()) == 8


def test_step(testbed_devices, reference_device):
    n = len(testbed_devices)
    run = jax.pmap(step, axis_name="batch", devices=testbed_devices)
    rng = np.random.default_rng(0)
    w, x, y = (rng.normal(size=s).astype(np.float32) for s in ((3, 2), (16, 3), (16, 2)))
    parallel = lambda w, x, y: unreplicate(run(replicate(w, n), shard_batch(x, n), shard_batch(y, n)))
    assert_parallel_equal(parallel, reference, w, x, y, atol=1e-5, reference_device=reference_device)


def test_mesh(mesh_factory):
    mesh = mesh_factory((2, 4), ("data", "model"))
    assert dict(mesh.shape) == {{"data": 2, "model": 4}}
'''


def _run_user_project(project: Path, reduce: str) -> subprocess.CompletedProcess:
    project.mkdir()
    (project / "test_user_step.py").write_text(USER_TEST.format(reduce=reduce))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "PYTHONPATH")}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "error"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_user_project_gets_8_devices_and_the_psum_bug_is_named(tmp_path: Path) -> None:
    good = _run_user_project(tmp_path / "good", "lax.pmean")
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-2000:]
    assert "testbed: 8 emulated host devices requested for JAX (set)" in good.stdout
    assert "3 passed" in good.stdout

    bad = _run_user_project(tmp_path / "bad", "lax.psum")
    assert bad.returncode == 1, bad.stdout[-3000:]
    assert "1 failed, 2 passed" in bad.stdout
    assert "gradients scaled by 8 (8 = the device count): psum where pmean was meant?" in bad.stdout
    # The user's frame and the message, not the kit's source (__tracebackhide__).
    assert "test_user_step.py" in bad.stdout and "def assert_outputs_equal" not in bad.stdout
    assert "testbed/testing/compare.py" not in bad.stdout


@pytest.mark.slow  # a user's pytest in a subprocess
def test_the_option_chooses_the_count_and_a_started_backend_is_reported(tmp_path: Path) -> None:
    (tmp_path / "test_n.py").write_text("import jax\n\ndef test_n(testbed_devices):\n"
                                        "    assert len(testbed_devices) == len(jax.devices()) == 4\n")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "PYTHONPATH")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--testbed-devices", "4"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "4 emulated host devices" in run.stdout, run.stdout[-3000:]
    # In this process JAX has started: a request for another count is too late and says so.
    assert len(jax.devices()) == 8
    late = request_host_devices(16)
    assert late.action == "late" and "already started" in late.message
    assert request_host_devices(8).message == ""


def _pytest_in(project: Path, *args: str, ini: str | None = None) -> subprocess.CompletedProcess:
    if ini is not None:
        (project / "pytest.ini").write_text(f"[pytest]\ntestbed_devices = {ini}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "PYTHONPATH")}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=project, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("value", ["abc", "-1", "100000", str(2**31), "1.5"])
@pytest.mark.parametrize("where", ["option", "ini"])
def test_bad_device_counts_are_one_line_usage_errors(tmp_path: Path, where: str, value: str) -> None:
    """Exit 4 (pytest's usage error), one line naming the source and the range; unchecked, `abc` in the ini is a
    traceback, 100000 a segfault, 2^31 a silent exit 1, and -1 silently skips tests."""
    (tmp_path / "test_x.py").write_text("def test_x(testbed_devices):\n    assert testbed_devices\n")
    run = (_pytest_in(tmp_path, f"--testbed-devices={value}") if where == "option"
           else _pytest_in(tmp_path, ini=value))
    assert run.returncode == 4, run.stdout[-2000:] + run.stderr[-2000:]
    errors = [line for line in (run.stdout + run.stderr).splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 1 and "Traceback" not in run.stdout + run.stderr
    assert "from 0 to 4096" in errors[0] and repr(value) in errors[0]
    assert ("--testbed-devices" if where == "option" else "ini value testbed_devices") in errors[0]


def test_asking_for_more_devices_than_the_session_has_names_both_numbers(tmp_path: Path) -> None:
    (tmp_path / "test_more.py").write_text(
        "def test_slice(testbed_devices):\n    testbed_devices[:8]\n\n"
        "def test_mesh(mesh_factory):\n    mesh_factory((2, 4), ('a', 'b'))\n\n"
        "def test_fits(testbed_devices, mesh_factory):\n"
        "    assert len(testbed_devices[:4]) == 4 and mesh_factory((2, 2), ('a', 'b')).size == 4\n")
    run = _pytest_in(tmp_path, "--testbed-devices", "4")
    assert run.returncode == 1 and "2 failed, 1 passed" in run.stdout, run.stdout[-3000:]
    assert "testbed_devices[:8] asks for 8 devices, but this pytest run has 4" in run.stdout
    assert "mesh (2, 4) needs 8 devices, but this pytest run has 4" in run.stdout
    assert "run with --testbed-devices 8 or more" in run.stdout


def test_importing_the_kit_starts_no_jax() -> None:
    code = ("import sys, testbed.testing, testbed.testing.plugin, testbed.testing.strategies\n"
            "assert 'jax' not in sys.modules, 'jax imported'\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# -- the comparison and its hints ------------------------------------------------------------------

def test_scaled_values_name_the_factor_and_the_axis() -> None:
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    ref = np.arange(1.0, 9.0).reshape(2, 4)
    with pytest.raises(AssertionError, match=r"values scaled by 4 \(4 = mesh axis 'model'\): psum where pmean"):
        assert_outputs_equal({"g": ref * 4}, {"g": ref}, mesh=mesh)
    with pytest.raises(AssertionError, match=r"scaled by 1/2 \(2 = mesh axis 'data'\): pmean where psum"):
        assert_outputs_equal({"g": ref / 2}, {"g": ref}, mesh=mesh)
    assert_outputs_equal({"g": ref * (1 + 1e-7)}, {"g": ref})


def test_one_wrong_shard_is_located() -> None:
    ref = np.ones((16, 3))
    par = ref.copy()
    par[6:8] += 1.0
    with pytest.raises(AssertionError) as caught:
        assert_outputs_equal([par], [ref])
    message = str(caught.value)
    assert "leaf [0]" in message and "worst at index (6, 0)" in message
    assert "errors confined to one shard: block 3 of 8 (8 = the device count) along dim 0 (indices 6:8)" in message


def test_structure_shape_and_per_device_axis_are_explained() -> None:
    with pytest.raises(AssertionError, match="output structures differ"):
        assert_outputs_equal({"a": 1.0}, {"b": 1.0})
    with pytest.raises(AssertionError, match="per-device leading axis of 8"):
        assert_outputs_equal(np.zeros((8, 3)), np.zeros(3))
    with pytest.raises(AssertionError, match=r"dim 0 is 1/8 of the reference's \(8 = the device count\)"):
        assert_outputs_equal(np.zeros((2, 3)), np.zeros((16, 3)))
    with pytest.raises(AssertionError, match="first at index"):
        assert_outputs_equal(np.array([1, 2], np.int32), np.array([1, 3], np.int32))


def test_pmap_helpers() -> None:
    tree = {"w": np.arange(6.0).reshape(2, 3)}
    stacked = replicate(tree, 4)
    assert stacked["w"].shape == (4, 2, 3) and np.array_equal(unreplicate(stacked)["w"], tree["w"])
    assert shard_batch(np.arange(8), 4).shape == (4, 2)
    with pytest.raises(ValueError, match="not divisible by 3"):
        shard_batch(np.arange(8), 3)
    stacked["w"][2, 0, 0] = -1
    with pytest.raises(AssertionError, match=r"replicas disagree at leaf \['w'\]: device 2"):
        unreplicate(stacked)


def test_jit_with_shardings_and_the_reference_device() -> None:
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jax.device_put(np.arange(32.0).reshape(8, 4), jax.NamedSharding(mesh, jax.P("data", "model")))
    seen = []

    def reference(v):
        seen.append(type(v))
        return (v * 2).sum(axis=1)

    assert_parallel_equal(jax.jit(lambda v: (v * 2).sum(axis=1)), reference, x, mesh=mesh)
    # Every reference run got host data, not the sharded array: the comparison's and the structure check's
    # reruns on each batch shard (testbed.testing.structure).
    assert seen and set(seen) == {np.ndarray}


def test_typed_and_raw_keys_reach_the_reference_and_the_comparison() -> None:
    for key in (jax.random.key(7), jax.random.PRNGKey(7)):
        draw = lambda k: jax.random.normal(k, (4,))  # noqa: E731
        assert_parallel_equal(jax.jit(draw), draw, key)
        assert_outputs_equal({"k": key}, {"k": key})  # a key output compares by its data
    with pytest.raises(AssertionError, match="elements differ"):
        assert_outputs_equal(jax.random.key(1), jax.random.key(2))


def test_per_shard_reference_and_replicas_that_must_differ() -> None:
    x = np.ones((4, 3), np.float32)
    noise = lambda k, v: v + jax.random.normal(k, v.shape)  # noqa: E731
    reference = per_shard_reference(noise, 2)
    expect = np.concatenate([noise(jax.random.fold_in(jax.random.key(0), i), x[2 * i:2 * i + 2]) for i in (0, 1)])
    np.testing.assert_array_equal(reference(jax.random.key(0), x), expect)
    assert_replicas_differ(lambda k, v: reference(k, v), jax.random.key(0), x, shards=2)
    same = lambda k, v: np.concatenate([noise(k, v[:2])] * 2)  # noqa: E731  (one key on both shards)
    with pytest.raises(AssertionError, match=r"blocks 0 and 1 of 2 .* identical"):
        assert_replicas_differ(same, jax.random.key(0), x, shards=2, axis="dp")
    with pytest.raises(ValueError, match="needs shards=N"):
        assert_replicas_differ(same, jax.random.key(0), x)


# -- strategies ------------------------------------------------------------------------------------

def test_factorisations() -> None:
    assert factorisations(8, 2) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert all(math.prod(f) == 12 for f in factorisations(12, 3)) and len(factorisations(12, 3)) == 18


@given(data=st.data(), shape=st.tuples(st.sampled_from([1, 2, 4, 6, 8]), st.sampled_from([3, 4, 8])))
def test_drawn_meshes_and_specs_are_valid(data, shape) -> None:
    mesh = data.draw(meshes([1, 2, 4, 8], ("data", "model", "stage")))
    assert mesh.axis_names == ("data", "model", "stage") and mesh.size in (1, 2, 4, 8)
    spec = data.draw(partition_specs(shape, mesh))
    used = [a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)]
    assert len(used) == len(set(used))
    sharding = data.draw(shardings(shape, mesh))
    array = jax.device_put(np.zeros(shape, np.float32), sharding)   # every drawn sharding is placeable
    assert array.sharding == sharding
    batch = data.draw(batches(4, (3,)))
    assert batch.shape[0] % 4 == 0 and batch.shape[1:] == (3,) and batch.dtype == np.float32


@given(plans(num_devices=[1, 2, 4, 8]))
def test_drawn_plans_are_valid(plan: Plan) -> None:
    assert isinstance(plan, Plan) and plan.mesh.size in (1, 2, 4, 8)
    assert plan.model.layers % plan.mesh.stage == 0 and plan.batch.global_batch % plan.replicas == 0
