"""benchmarks/host_collective_form.py: two cost forms scored on calibrate's host collective samples (no JAX)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("host_collective_form", ROOT / "benchmarks" / "host_collective_form.py")
form = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(form)

OPS = ("psum", "all_gather", "psum_scatter", "ppermute", "all_to_all")


def _samples(seconds) -> list[dict]:
    return [{"kind": "collective", "op": op, "ranks": n, "bytes": float(b), "seconds": seconds(op, n, b)}
            for op in OPS for n in (2, 8) for b in (4096, 131072, 2 ** 21)]


def test_the_in_process_form_recovers_samples_it_generated_and_the_link_fit_cannot():
    """Samples costing what XLA:CPU's in-process collectives move (about 2 buffers a rank whatever the group)
    are fitted exactly by that form; the simulator's link fit, whose all-reduce over 8 is twice an all-gather,
    over-prices that all-reduce."""
    samples = _samples(lambda op, n, b: 10e-6 + form.in_process_bytes(op, n) * b / 4e9)
    fitted = form.bytes_form(samples)
    assert fitted["bandwidth_GBps"] == pytest.approx(4.0, rel=1e-6)
    assert fitted["median_abs_error_all"] == pytest.approx(0.0, abs=1e-6)
    assert form.link_form(samples, "host-cpu-8")["psum_8_ranks_2MiB_error"] > 0.3
    assert form.ratios(samples) == {"psum8_over_all_gather8": 1.0, "all_gather8_over_all_gather2": 1.0,
                                    "psum8_over_psum2": 1.0}


def test_the_bytes_follow_xla_cpus_in_process_collectives():
    """Reduce-scatter reads every input's chunk and writes its own; everything else reads and writes a buffer."""
    assert form.in_process_bytes("psum_scatter", 8) == 1.125
    assert {form.in_process_bytes(op, 8) for op in OPS if op != "psum_scatter"} == {2.0}


def test_the_script_prints_one_json_object_for_a_kept_run():
    path = ROOT / "benchmarks" / "host_runs" / "2026-12-02" / "run-10" / "measurements.json"
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_collective_form.py"), str(path)],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    data = json.loads(out)
    assert data["runs"] == 1
    (run,) = data["per_run"].values()
    assert run["samples"] == 30
    assert set(data["median_over_runs"]) == {"ratios", "link", "in_process_bytes"}
