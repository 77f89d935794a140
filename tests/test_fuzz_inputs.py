"""Generated bad input through every command (issue 24): never a traceback, always exit 0/1/2 with a short message.

The strategies live in benchmarks/fuzz_inputs.py (the benchmark runs the same
ones for 1,000+ cases); the hypothesis profile of conftest.py sets how many
examples each test draws. Below them, one regression test per class of input
the issue lists.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given

from testbed.cli import main

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fuzz_inputs", ROOT / "benchmarks" / "fuzz_inputs.py")
fuzz = importlib.util.module_from_spec(_spec)
sys.modules["fuzz_inputs"] = fuzz
_spec.loader.exec_module(fuzz)


def _check(case: "fuzz.Case", tmp_path_factory) -> "fuzz.Outcome":
    # In a forked child: 60 s and 4 GiB more memory at most (an overrun is a problem of the outcome).
    outcome = fuzz.run_case_isolated(case, tmp_path_factory.mktemp("case"), time_limit=60.0, memory_gib=4.0)
    assert not outcome.problems(), (outcome.problems(), outcome.argv, outcome.stderr[-600:])
    return outcome


@pytest.mark.parametrize("command", ["plan", "memory", "simulate", "compare"])
def test_mutated_plans_end_cleanly(command, tmp_path_factory):
    @given(case=fuzz.plan_case(command))
    def check(case):
        _check(case, tmp_path_factory)

    check()


@given(case=fuzz.topology_case())
def test_mutated_topologies_end_cleanly(case, tmp_path_factory):
    _check(case, tmp_path_factory)


@given(case=fuzz.collective_case())
def test_collective_arguments_end_cleanly(case, tmp_path_factory):
    _check(case, tmp_path_factory)


@given(case=fuzz.schedule_case())
def test_schedule_arguments_end_cleanly(case, tmp_path_factory):
    _check(case, tmp_path_factory)


@given(case=fuzz.run_case())
def test_run_refuses_bad_plans_and_arguments_before_jax(case, tmp_path_factory):
    outcome = _check(case, tmp_path_factory)
    assert outcome.exit_code == 2 or outcome.started_valid_run


@given(case=fuzz.arguments_case())
def test_random_argument_lists_end_cleanly(case, tmp_path_factory):
    _check(case, tmp_path_factory)


@given(case=fuzz.check_sharding_case())
def test_check_sharding_refuses_bad_plans_before_jax(case, tmp_path_factory):
    outcome = _check(case, tmp_path_factory)
    assert outcome.exit_code == 2 or outcome.started_valid_run, (outcome.exit_code, outcome.argv)


@given(case=fuzz.execute_case())
def test_collective_execute_refuses_bad_devices_and_repeats_before_jax(case, tmp_path_factory):
    outcome = _check(case, tmp_path_factory)
    assert outcome.exit_code == 2 or outcome.started_valid_run, (outcome.exit_code, outcome.argv)


@given(case=fuzz.search_case())
def test_search_arguments_and_models_end_cleanly(case, tmp_path_factory):
    _check(case, tmp_path_factory)


@given(case=fuzz.sweep_case())
def test_sweep_specs_and_arguments_end_cleanly(case, tmp_path_factory):
    _check(case, tmp_path_factory)


@given(case=fuzz.spec_name_case())
def test_spec_names_grid_keys_and_values_end_cleanly(case, tmp_path_factory):
    """Names that are paths, URLs, control or markup strings; keys and values carrying SQL; extreme prices."""
    outcome = _check(case, tmp_path_factory)
    folder = Path(outcome.argv[1]).parent
    assert not (folder / "pwn.csv").exists() and not (folder.parent / "x.duckdb").exists()


@given(case=fuzz.sweep_db_case())
def test_sweep_databases_that_are_not_ours_end_cleanly(case, tmp_path_factory):
    """Folders, links, FIFOs, read-only, foreign, SQLite, another grid's and locked databases: exit 2 or a sweep."""
    outcome = _check(case, tmp_path_factory)
    refused = {"folder", "link-to-folder", "fifo", "foreign-duckdb", "sqlite", "text", "locked"}
    if "--plot" not in case.argv:  # a sweep writes: its own SPEC and another grid's database are refused too
        refused |= {"link-to-spec", "other-grid"}
    if case.setup in refused:
        assert outcome.exit_code == 2, (case.setup, outcome.stderr[-400:])


@given(case=fuzz.named_plan_case())
def test_plans_with_control_or_markup_names_end_cleanly(case, tmp_path_factory):
    _check(case, tmp_path_factory)


def test_a_case_over_the_memory_limit_is_stopped_and_reported():
    """The isolation holds: a case allocating past its 1 GiB is a MemoryError in the child, not in this process."""
    def allocate() -> str:
        try:
            bytearray(2 << 30)
        except MemoryError:
            return "MemoryError"
        return "allocated"

    assert fuzz.isolated(allocate, time_limit=30.0, memory_gib=1.0) == "MemoryError"
    assert fuzz.isolated(lambda: "ok", time_limit=30.0, memory_gib=1.0) == "ok"


@pytest.mark.parametrize("name", sorted(fuzz.OPTION_PLANS))
def test_option_seed_plans_are_valid_and_use_every_newer_key(name, tmp_path):
    """The seeds the newer keys are mutated from must start valid (else every mutation only repeats one error)."""
    from testbed.plan.io import plan_from_dict
    from testbed.sim.graph.engine import simulate
    from testbed.topology.io import load_topology

    doc = fuzz.OPTION_PLANS[name]
    plan = plan_from_dict(doc)
    assert simulate(plan, load_topology(plan.topology)).report.step_time_s > 0
    assert {"sequence_parallel", "layers_per_stage"} <= set(doc) and doc["model"]["attention"] == "flash"
    assert "attention_block" in doc["model"]


def test_option_seeds_cover_the_newer_keys():
    """Every newer plan key is set by some seed and mutated; the options topology and sweep seeds load."""
    from testbed.explore.sweep_spec import spec_from_dict
    from testbed.topology.io import topology_from_dict

    precisions = {doc["precision"] for doc in fuzz.OPTION_PLANS.values()}
    assert "fp8-mixed" in precisions
    assert {"balanced-ends"} <= {str(d["layers_per_stage"]) for d in fuzz.OPTION_PLANS.values()}
    topology = topology_from_dict(fuzz.TOPOLOGIES["options-8"])
    assert topology.price_per_device_hour == 2.5 and topology.calibration.compute.gemm_half_mn == 117
    assert {p[-1] for p in fuzz.TOPOLOGY_OPTIONS} >= {"price_per_device_hour", "fp8", "gemm_half_mn", "gemm_half_k",
                                                      "gemm_latency_s", "flash_efficiency"}
    for doc in fuzz.SWEEPS.values():
        assert spec_from_dict(doc).size >= 1


@given(case=fuzz.cases())
def test_any_case_ends_cleanly(case, tmp_path_factory):
    _check(case, tmp_path_factory)


# -- one regression per class of the issue ----------------------------------------------------------


def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err and len(err.encode()) < 2048
    return code, out, err


def _topology(tmp_path, body: dict) -> str:
    doc = {"device": {"flops": {"fp32": "1TFLOP/s"}, "memory": "1GB", "memory_bandwidth": "1GB/s"}, **body}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def _plan(tmp_path, **changes) -> str:
    doc = yaml.safe_load((ROOT / "plans" / "demo.yaml").read_text())
    for key, value in changes.items():
        section, _, name = key.partition("__")
        if name:
            doc[section][name] = value
        else:
            doc[section] = value
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.mark.parametrize("body, field", [
    ({"graph": {"devices": 2, "links": [{"a": 0, "b": True, "bandwidth": "1GB/s"}]}}, "graph.links[0].b"),
    ({"graph": {"devices": 2, "links": [{"a": [0], "b": 1, "bandwidth": "1GB/s"}]}}, "graph.links[0].a"),
    ({"torus": {"dims": [2, 2], "names": "xy", "bandwidth": "1GB/s"}}, "torus.names"),
    ({"torus": {"dims": [2, 2], "names": [["x"], "y"], "bandwidth": "1GB/s"}}, "torus.names"),
    ({"levels": [{"name": "a", "size": 2, "bandwidth": "1GB/s", "kind": ["pcie"]}]}, "levels[0].kind"),
    ({"levels": [{"name": "a", "size": 2, "bandwidth": "1GB/s", "kind": "warp"}]}, "levels[0].kind"),
    ({"levels": [{"name": "a", "size": 2, "bandwidth": "1GB/s"}],
      "calibration": {"host": {"throughput": {float("inf"): 1.0}}}}, "calibration.host.throughput"),
    ({"levels": [{"name": "a", "size": 2, "bandwidth": "1GB/s"}],
      "calibration": {"compute": {"efficiency": float("nan")}}}, "calibration.compute.efficiency"),
    ({"torus": {"dims": [2**20, 2**20], "bandwidth": "1GB/s"}}, "torus.dims"),
    ({"levels": [{"name": "a", "size": 2**21, "bandwidth": "1GB/s"}]}, "levels[0].size"),
    ({"graph": {"devices": 10**30, "links": []}}, "graph.devices"),
    ({"name": "n" * 100_000, "levels": [{"name": "a", "size": 2, "bandwidth": "1GB/s"}]}, "name"),
])
def test_wrong_types_and_sizes_in_topologies_name_the_field(tmp_path, capsys, body, field):
    code, _, err = _run(["topology", "show", _topology(tmp_path, body)], capsys)
    assert code == 2 and f"field `{field}`" in err and "t.yaml" in err, err


@pytest.mark.parametrize("changes, field", [
    ({"model__layers": 10**30}, "model.layers"),
    ({"model__layers": 2**50}, "model.layers"),
    ({"model__d_model": 2**40, "model__heads": 4}, "model.d_model"),
    ({"model__vocab": 2**40}, "model.vocab"),
    ({"model__seq_len": 2**40}, "model.seq_len"),
    ({"mesh": {"data": 2**21}, "batch": {"global_batch": 2**23, "microbatches": 4}}, "mesh.data"),
    ({"batch": {"global_batch": 2**17, "microbatches": 2**16}, "mesh": {"data": 2, "tensor": 2, "stage": 8},
      "model__layers": 8}, "batch.microbatches"),
    ({"name": "p" * 10_000}, "name"),
])
def test_huge_plans_are_refused_with_the_limit(tmp_path, capsys, changes, field):
    plan = _plan(tmp_path, **changes)
    for argv in (["plan", "check", plan], ["memory", "--plan", plan], ["simulate", "--plan", plan]):
        code, _, err = _run(argv, capsys)
        assert code == 2 and f"field `{field}`" in err and "p.yaml" in err and "at most" in err, err


def test_run_refuses_a_huge_plan_before_jax_starts(tmp_path, capsys):
    plan = _plan(tmp_path, model__layers=2**50)
    with fuzz.jax_trapped():  # reaching devices.prepare / train.run_plan would raise JaxWouldStart
        code, _, err = _run(["run", "--plan", plan], capsys)
    assert code == 2 and "model.layers" in err


@pytest.mark.parametrize("topology, message", [("/tmp/no/such/topology.yaml", "not found"),
                                               ("/tmp/" + "t" * 5000 + ".yaml", "too long")])
def test_a_plans_unusable_topology_names_the_plan_file_and_field(tmp_path, capsys, topology, message):
    plan = _plan(tmp_path, topology=topology)
    for argv in (["plan", "check", plan], ["memory", "--plan", plan], ["simulate", "--plan", plan]):
        code, _, err = _run(argv, capsys)
        assert code == 2 and err.startswith(f"error: {plan}: field `topology`:") and message in err.lower(), err


@pytest.mark.parametrize("argv, field", [
    (["schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--costs", "nan,1,1"], "--costs"),
    (["schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--costs", "1,inf,1"], "--costs"),
    (["schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--send", "nan"], "--send"),
    (["schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--send", "inf"], "--send"),
    (["schedule", "1f1b", "--stages", "1000", "--microbatches", "100000"], "--microbatches"),
    (["schedule", "zb-h1", "--stages", "100000", "--microbatches", "1"], "--stages"),
    (["collective", "send", "--topology", "host-cpu-8", "--peer", "99"], "peer"),
    (["simulate", "--plan", "demo", "--max-trace-bytes", "nan"], "--max-trace-bytes"),
])
def test_bad_argument_values_name_the_option(capsys, argv, field):
    code, _, err = _run(argv, capsys)
    assert code == 2 and f"field `{field}`" in err, err


@pytest.mark.parametrize("extra, field", [(["--port", "70000"], "--port"), (["--timeout", "nan"], "--timeout")])
def test_run_refuses_bad_worker_arguments_before_starting(capsys, extra, field):
    with fuzz.jax_trapped():
        code, _, err = _run(["run", "--plan", "demo", "--processes", "2", "--devices", "emulated:8", *extra], capsys)
    assert code == 2 and f"field `{field}`" in err, err


def test_long_argument_values_are_clipped_in_usage_errors(capsys):
    code = main(["schedule", "1f1b", "--stages", "x" * 100_000, "--microbatches", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "--stages" in err and len(err.encode()) < 1024


@pytest.mark.parametrize("content, field", [
    ({"samples": [{"kind": "matmul", "seconds": 1e-3, "flops": float("nan")}]}, "samples[0].flops"),
    ({"samples": [7]}, "samples[0]"),
    ({"samples": [{"kind": "matmul", "seconds": "fast"}]}, "samples[0].seconds"),
    ({"samples": [{"kind": "matmul", "seconds": 1e-3, "devices": True}]}, "samples[0].devices"),
    ({"samples": [{"kind": "warp", "seconds": 1e-3}]}, "samples[0].kind"),
    ({"samples": [{"kind": "matmul", "seconds": 1e-3, "colour": 1}]}, "samples[0].colour"),
    ({"samples": [], "devices": "eight"}, "devices"),
])
def test_malformed_measurement_files_name_file_and_field(tmp_path, content, field):
    from testbed.calibration.measurements import read_measurements
    from testbed.errors import InputError

    path = tmp_path / "m.measurements.json"
    path.write_text(json.dumps(content))
    with pytest.raises(InputError) as info:
        read_measurements(str(path))
    assert info.value.field == field and info.value.file == str(path)


def test_deeply_nested_measurement_json_is_refused(tmp_path):
    from testbed.calibration.measurements import read_measurements
    from testbed.errors import InputError

    path = tmp_path / "m.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(InputError):
        read_measurements(str(path))


def test_trace_above_the_limit_is_refused_before_writing(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    code, _, err = _run(["simulate", "--plan", "demo", "--trace", str(trace), "--max-trace-bytes", "10kB"], capsys)
    assert code == 2 and "--max-trace-bytes" in err and "raise it" in err
    assert not trace.exists() and list(tmp_path.iterdir()) == []
    code, _, _ = _run(["simulate", "--plan", "demo", "--trace", str(trace)], capsys)
    assert code == 0 and trace.exists()


def test_trace_size_estimate_is_close():
    from testbed.plan.io import load_plan
    from testbed.sim.graph.engine import simulate
    from testbed.sim.report.trace_files import trace_bytes, write_trace
    from testbed.topology.io import load_topology

    plan = load_plan("demo")
    sim = simulate(plan, load_topology(plan.topology))
    estimate = trace_bytes(sim.timeline)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        size = write_trace(sim.timeline, Path(tmp) / "t.json").stat().st_size
    assert abs(estimate - size) <= 0.02 * size


def test_ctrl_c_during_a_trace_exits_130_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    import testbed.sim.report.trace_files as timeline

    class Interrupting:
        """json whose dumps is interrupted once the trace file is being written."""

        @staticmethod
        def dumps(obj, **kwargs):
            if isinstance(obj, dict) and "source" in obj:
                raise KeyboardInterrupt
            return json.dumps(obj, **kwargs)

    monkeypatch.setattr(timeline, "json", Interrupting)
    code = main(["simulate", "--plan", "demo", "--trace", str(tmp_path / "trace.json")])
    _, err = capsys.readouterr()
    assert code == 130 and err.strip() == "interrupted"
    assert list(tmp_path.iterdir()) == []  # no trace, no temporary file


def test_yaml_control_characters_and_giant_numbers_are_input_errors(tmp_path, capsys):
    path = tmp_path / "t.yaml"
    path.write_bytes(b"name: a\x01b\n")
    code, _, err = _run(["topology", "show", str(path)], capsys)
    assert code == 2 and "t.yaml" in err
    path.write_text("device: " + "9" * 400 + "\n")
    code, _, err = _run(["topology", "show", str(path)], capsys)
    assert code == 2 and "line 1" in err and "digits" in err


@pytest.mark.parametrize("argv, field", [
    (["plan", "check", ""], "plan"),
    (["simulate", "--plan", " "], "plan"),
    (["check-sharding", "--plan", ""], "plan"),
    (["topology", "show", ""], "topology"),
    (["search", "--model", "", "--topology", "host-cpu-8"], "--model"),
])
def test_empty_paths_name_the_field_not_the_current_folder(capsys, argv, field):
    """Path("") is the current folder: an empty plan or topology argument names its field, not `.: is not a file`
    (issue 24)."""
    code, _, err = _run(argv, capsys)
    assert code == 2 and f"field `{field}`" in err and "error: .:" not in err, err


@pytest.mark.parametrize("execute", ["emulated:0", "emulated:-1", "emulated:abc", "gpu:x", "", " ", "emulated:99999999",
                                     "tpu:1e309", "emulated:4", "emulated:16"])
def test_collective_execute_refuses_bad_devices_before_jax(capsys, execute):
    """`--execute ""` was read as absent (emulated:N) and started JAX; every bad value is exit 2 first."""
    with fuzz.jax_trapped():  # devices.prepare / collectives.execute_and_check would raise JaxWouldStart
        code, _, err = _run(["collective", "all-reduce", "--topology", "host-cpu-8", "--execute", execute], capsys)
    assert code == 2 and ("field `execute`" in err or "field `--devices`" in err), err


@pytest.mark.parametrize("repeats", ["0", "-1", "abc", "nan", "1e309"])
def test_collective_execute_refuses_bad_repeats_before_jax(capsys, repeats):
    with fuzz.jax_trapped():
        code, _, err = _run(["collective", "all-reduce", "--topology", "host-cpu-8", "--execute", "emulated:8",
                             "--repeats", repeats], capsys)
    assert code == 2 and "repeats" in err, err


def test_valid_execute_and_check_sharding_reach_the_trap():
    """The oracle is not vacuous: valid input does reach JAX, and the fuzzer's own check agrees it is valid."""
    for argv in (["collective", "all-reduce", "--topology", "host-cpu-8", "--execute", "emulated:8"],
                 ["check-sharding", "--plan", "demo"]):
        case = fuzz.Case(argv[0], argv, plan_may_be_valid=True)
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            outcome = fuzz.run_case_in_process(case, Path(tmp))
        assert outcome.started_valid_run and outcome.exit_code == 0 and not outcome.problems(), outcome
    assert not fuzz.may_start_jax("collective", ["collective", "all-reduce", "--topology", "host-cpu-8",
                                                 "--execute", "emulated:4"])


@pytest.mark.parametrize("op", ["reduce-scatter", "all-reduce", "broadcast"])
def test_collective_peer_out_of_the_group_is_refused_for_every_op(tmp_path, capsys, op):
    """`--peer 1000` with an op other than send reached the lower bound's np.delete: IndexError (fuzzer, graph-4)."""
    topology = tmp_path / "graph-4.yaml"
    topology.write_text(yaml.safe_dump(fuzz.TOPOLOGIES["graph-4"]))
    code, _, err = _run(["collective", op, "--topology", str(topology), "--peer", "1000"], capsys)
    assert code == 2 and "field `peer`" in err, err
    code, _, err = _run(["collective", op, "--topology", str(topology), "--peer", "1"], capsys)
    assert code == 0, err


@pytest.mark.parametrize("argv, field", [(["sweep", ""], "spec"), (["sweep", " ", "--db", "x.duckdb"], "spec"),
                                         (["sweep", "--db", "", "--plot", "plots"], "--db")])
def test_an_empty_sweep_spec_or_db_names_the_field(capsys, argv, field):
    """`testbed sweep ""` (or `--db ""`) took the empty value as none and then read `spec.name` of None."""
    code, _, err = _run(argv, capsys)
    assert code == 2 and f"field `{field}`" in err, err
