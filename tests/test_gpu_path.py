"""The prepared GPU check refuses to start without a GPU (exit 2, one line), and the accelerator extras exist."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_accelerator_extras_pin_the_project_jax_range() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["cuda"] == ["jax[cuda12]>=0.10.2,<0.12"] and extras["tpu"] == ["jax[tpu]>=0.10.2,<0.12"]


def test_gpu_validate_refuses_without_a_gpu() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_validate
    finally:
        sys.path.pop(0)
    if gpu_validate.gpu_name() is not None:
        pytest.skip("a GPU is present: this test checks the refusal without one")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_validate.py")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: no GPU") and done.stderr.count("\n") == 1
