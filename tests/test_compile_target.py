"""check-sharding --compile's target strings, its topology check, and its exit 2 without libtpu."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.errors import InputError
from testbed.topology.compile_target import CompileTarget, parse_target, target_topology

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("text, family, dims, devices", [
    ("tpu:v5e:4x4", "v5e", (4, 4), 16), ("tpu:v5e:16x16", "v5e", (16, 16), 256), ("TPU:V5P:2x2x2", "v5p", (2, 2, 2), 8),
    ("tpu:v5p:8x8x16", "v5p", (8, 8, 16), 1024), ("tpu:v4:4x4x4", "v4", (4, 4, 4), 128), ("tpu:v6e:2x4", "v6e", (2, 4), 8),
    ("tpu:v5e:1x1", "v5e", (1, 1), 1)])
def test_targets_read_as_libtpu_names_them(text, family, dims, devices):
    target = parse_target(text)
    assert (target.family, target.dims, target.devices) == (family, dims, devices)
    assert target.libtpu_name == f"{family}:{'x'.join(map(str, dims))}"


@pytest.mark.parametrize("text", ["v5e:4x4", "tpu:v5e:4x4x4", "tpu:v5p:4x4", "tpu:v9:2x2", "tpu:v5e:0x4",
                                  "tpu:v5e-16", "tpu:v5p:32x32x32", ""])
def test_bad_targets_name_the_valid_forms(text):
    with pytest.raises(InputError) as err:
        parse_target(text)
    assert err.value.field == "--compile" and "tpu:v5e:4x4" in err.value.message


def test_small_slices_set_the_host_bounds():
    assert parse_target("tpu:v5e:1x1").host_bounds == (1, 1, 1)
    assert parse_target("tpu:v5e:1x4").host_bounds == (1, 2, 1)
    assert parse_target("tpu:v5e:2x2").host_bounds is None


def test_target_topology_takes_the_family_device():
    topology = target_topology(parse_target("tpu:v5e:2x4"))
    assert topology.num_devices == 8 and topology.device.name == "TPU-v5e"
    assert target_topology(parse_target("tpu:v5e:16x16")).levels[0].wraparound
    with pytest.raises(InputError):
        target_topology(CompileTarget(family="v6e", dims=(2, 2)))


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "testbed.cli", "check-sharding", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="libtpu is installed here")
def test_without_libtpu_one_line_and_exit_2():
    proc = _cli("--plan", "plans/fsdp-tpu.yaml", "--compile", "tpu:v5e:4x4", "--json")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "libtpu" in lines[0] and "jax-testbed[tpu]" in lines[0]
    assert "Traceback" not in proc.stderr


def test_a_target_of_another_family_than_the_plan_topology_is_bad_input():
    proc = _cli("--plan", "plans/fsdp-tpu.yaml", "--compile", "tpu:v5p:2x2x4")
    assert proc.returncode == 2 and "TPU-v5e" in proc.stderr and "Traceback" not in proc.stderr
    proc = _cli("--plan", "plans/fsdp-tpu.yaml", "--compile", "v5e-16")
    assert proc.returncode == 2 and "tpu:FAMILY:DIMS" in proc.stderr
