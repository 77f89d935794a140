"""The CLI: JSON contract of the foundation commands and a table of bad inputs (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from testbed.cli import main

PLAN = textwrap.dedent("""\
    model: {layers: 4, d_model: 64, heads: 4, d_ff: 256, seq_len: 32, vocab: 256}
    batch: {global_batch: 16, microbatches: 2}
    mesh: {data: 2, tensor: 2, stage: 2}
    """)
TOPO = textwrap.dedent("""\
    device: {name: x, flops: {fp32: 1TFLOP/s}, memory: 16GB, memory_bandwidth: 1TB/s}
    levels:
      - {name: node, size: 8, bandwidth: 100GB/s, latency: 1us, kind: nvswitch}
    """)


def run_cli(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_topologies_json_lists_every_bundled_topology(capsys):
    code, out, _ = run_cli(["topologies", "--json"], capsys)
    assert code == 0
    rows = json.loads(out)["topologies"]
    names = {r["name"]: r["devices"] for r in rows}
    assert names["dgx-h100-x4"] == 32 and names["tpu-v4-4x4x4"] == 64 and names["tpu-v5e-16x16"] == 256
    assert all(set(r) >= {"name", "devices", "levels"} for r in rows)


def test_presets_lists_each_full_configuration_with_its_source(capsys):
    """`testbed presets`: every preset, its whole model mapping (a plan reads it back), batch and source."""
    from testbed.plan.presets import PRESETS
    from testbed.plan.io import plan_from_dict

    code, out, _ = run_cli(["presets", "--json"], capsys)
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)["presets"]}
    assert set(rows) == set(PRESETS)
    for r in rows.values():
        assert r["source"] and r["global_batch"] >= 1
        assert plan_from_dict({"model": r["model"], "batch": {"global_batch": 8}}).model == \
            plan_from_dict({"model": {"preset": r["name"]}, "batch": {"global_batch": 8}}).model
    # Llama 3 405B is its pre-training phase (Table 4: 8K x 2048 = 16M tokens); the 128K phase is named apart.
    assert (rows["llama3-405b"]["model"]["seq_len"], rows["llama3-405b"]["tokens_per_batch"]) == (8192, 2048 * 8192)
    assert (rows["llama3-405b-128k"]["model"]["seq_len"], rows["llama3-405b-128k"]["global_batch"]) == (131072, 128)
    assert "Table 4" in rows["llama3-405b"]["source"]
    code, _, err = run_cli(["presets", "llama3-450b"], capsys)
    assert code == 2 and "llama3-405b" in err


def test_plan_check_json_and_topology_png(tmp_path, capsys):
    code, out, _ = run_cli(["plan", "check", "demo", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["ok"] and data["placement"]["axes"]["tensor"]["first_group"] == [0, 1]
    png = tmp_path / "t.png"
    code, out, _ = run_cli(["topology", "show", "tpu-v4-4x4x4", "--png", str(png), "--json"], capsys)
    assert code == 0 and png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads(out)["devices"] == 64


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def plan_with(**replace):
    text = PLAN
    for old, new in replace.items():
        text = text.replace(old.replace("_", " ", 0), new)
    return text


BAD = [
    # (id, plan text or None, topology text or None, extra argv, text expected in the message)
    ("yaml-syntax", "model: {layers: 4\nbatch: [", None, [], "YAML syntax error at line"),
    ("unknown-key", PLAN.replace("data: 2", "dta: 2"), None, [], "field `mesh.dta`"),
    ("suggest-closest", PLAN.replace("microbatches", "microbatchs"), None, [], "did you mean `microbatches`"),
    ("wrong-type", PLAN.replace("layers: 4", "layers: four"), None, [], "field `model.layers`"),
    ("batch-indivisible", PLAN.replace("global_batch: 16", "global_batch: 14"), None, [], "field `batch.global_batch`"),
    ("layers-vs-stages", PLAN.replace("layers: 4", "layers: 3"), None, [], "field `model.layers`"),
    ("heads-vs-tensor", PLAN.replace("tensor: 2", "tensor: 2, fsdp: 1").replace("heads: 4", "heads: 2, kind: gpt")
     .replace("d_model: 64", "d_model: 64").replace("heads: 2", "heads: 3"), None, [], "field `model.heads`"),
    ("mesh-vs-devices", PLAN.replace("stage: 2", "stage: 1"), TOPO, [], "field `mesh`"),
    ("zero-range", PLAN + "zero: 5\n", None, [], "field `zero`"),
    ("unknown-schedule", PLAN + "schedule: 1f1c\n", None, [], "did you mean `1f1b`"),
    ("bad-axis-order", PLAN.replace("stage: 2}", "stage: 2, order: [stage, data, fsdp, tensr]}"), None, [], "field `mesh.order`"),
    ("non-positive-microbatches", PLAN.replace("microbatches: 2", "microbatches: 0"), None, [], "field `batch.microbatches`"),
    ("unknown-topology", PLAN, None, ["--topology", "dgx-h10"], "did you mean `dgx-h100`"),
    ("negative-bandwidth", PLAN, TOPO.replace("100GB/s", "-100GB/s"), [], "bandwidth"),
    ("zero-bandwidth", PLAN, TOPO.replace("100GB/s", "0GB/s"), [], "bandwidth"),
    ("topology-unknown-key", PLAN, TOPO.replace("latency: 1us", "latncy: 1us"), [], "did you mean `latency`"),
    ("unknown-link-kind", PLAN, TOPO.replace("nvswitch", "nvswich"), [], "did you mean `nvswitch`"),
    ("disconnected", PLAN, textwrap.dedent("""\
        device: {flops: {fp32: 1TFLOP/s}, memory: 16GB, memory_bandwidth: 1TB/s}
        graph:
          devices: 8
          links: [{a: 0, b: 1, bandwidth: 1GB/s}]
        """), [], "disconnected"),
    ("missing-device-field", PLAN, TOPO.replace(", memory: 16GB", ""), [], "field `device.memory`"),
    ("bad-torus-dims", PLAN, textwrap.dedent("""\
        device: {flops: {fp32: 1TFLOP/s}, memory: 16GB, memory_bandwidth: 1TB/s}
        torus: {dims: [2, -4], bandwidth: 1GB/s}
        """), [], "field `torus.dims`"),
    ("plan-not-found", None, None, [], "plan file not found"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_exits_2_naming_file_and_field(case, tmp_path, capsys):
    ident, plan_text, topo_text, extra, expected = case
    plan = write(tmp_path, "plan.yaml", plan_text) if plan_text is not None else str(tmp_path / "missing.yaml")
    argv = ["plan", "check", plan, "--topology", write(tmp_path, "topo.yaml", topo_text) if topo_text else "host-cpu-8"]
    if extra:
        argv = ["plan", "check", plan, *extra]
    code, out, err = run_cli(argv, capsys)
    assert code == 2, err
    assert expected in err
    assert "Traceback" not in err and out == ""
    assert err.count("\n") == 1, "one paragraph"
    if "topology" not in ident and ident not in ("unknown-topology",) and topo_text is None:
        assert "plan.yaml" in err or "missing.yaml" in err
    if topo_text is not None and ident not in ("mesh-vs-devices",):
        assert "topo.yaml" in err


def test_subprocess_bad_input_has_no_traceback(tmp_path):
    plan = write(tmp_path, "plan.yaml", PLAN.replace("data: 2", "daat: 2"))
    proc = subprocess.run([sys.executable, "-m", "testbed.cli", "plan", "check", plan, "--topology", "host-cpu-8"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "did you mean `data`" in proc.stderr


def test_unknown_command_suggests(capsys):
    assert main(["topolgies"]) == 2  # a status returned in-process, as for every other bad input
    assert "did you mean `topologies`" in capsys.readouterr().err


def test_version_and_bare_command_list(capsys):
    from testbed import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"testbed {__version__}"
    assert main([]) == 0  # bare `testbed`: the command list on stdout, exit 0 (README)
    out = capsys.readouterr().out
    from testbed.cli.main import COMMANDS

    assert all(name in out for name in COMMANDS) and "usage: testbed" in out


def test_help_text_has_no_rst_backticks(capsys):
    from testbed.cli.main import COMMANDS

    for argv in [["--help"], *([name, "--help"] for name in COMMANDS), ["topology", "show", "--help"],
                 ["plan", "check", "--help"]]:
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "``" not in out, argv


def _oom_plan(tmp_path):
    plan = tmp_path / "big.yaml"
    plan.write_text(PLAN.replace("d_model: 64", "d_model: 8192").replace("d_ff: 256", "d_ff: 32768")
                    .replace("vocab: 256", "vocab: 50304"))
    topo = tmp_path / "t.yaml"
    topo.write_text(TOPO)
    return str(plan), str(topo)


def test_simulate_fail_if_oom_and_plan_check_warning(tmp_path, capsys):
    plan, topo = _oom_plan(tmp_path)
    assert main(["simulate", "--plan", plan, "--topology", topo]) == 0
    assert main(["simulate", "--plan", plan, "--topology", topo, "--fail-if-oom"]) == 1
    assert main(["memory", "--plan", plan, "--topology", topo, "--fail-if-oom"]) == 1  # the same verdict
    capsys.readouterr()
    assert main(["plan", "check", plan, "--topology", topo]) == 0  # a warning, still exit 0
    out = capsys.readouterr().out
    assert "warning" in out and "does not fit in memory" in out
    assert main(["plan", "check", plan, "--topology", topo, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["memory"]["fits"] is False and len(data["warnings"]) == 1
    assert main(["plan", "check", plan, "--topology", topo, "--fail-if-oom"]) == 1
    small = tmp_path / "small.yaml"
    small.write_text(PLAN)
    assert main(["simulate", "--plan", str(small), "--topology", topo, "--fail-if-oom"]) == 0
    capsys.readouterr()
    assert main(["plan", "check", str(small), "--topology", topo, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["warnings"] == []


def test_progress_lines_when_stderr_is_not_a_terminal():
    import io

    from testbed.cli.progress import LineProgress

    now = [0.0]
    stream = io.StringIO()
    bar = LineProgress("sweeping", stream, interval_s=5.0, clock=lambda: now[0])
    task = bar.add_task("[bold]spec\\[/x][/bold]", total=100)
    for done in range(1, 101):
        now[0] = done * 0.25  # 25 s in all: a line every 5 s at most, and the last
        bar.update(task, completed=done)
    lines = stream.getvalue().splitlines()
    assert 4 <= len(lines) <= 6 and lines[-1].startswith("sweeping spec[/x]: 100/100 (100%)")


def test_search_json_stays_strict_with_progress_lines_on_stderr(capsys):
    argv = ["search", "--model", "demo", "--topology", "host-cpu-8", "--devices", "4", "--top", "2", "--replay", "2",
            "--schedules", "1f1b", "--zero", "0", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr()
    data = json.loads(out.out)  # stdout is one JSON object, nothing else
    n = data["enumerated"]
    assert f"searching plans (analytic tier): {n}/{n} (100%)" in out.err
    assert all(line.startswith("searching ") for line in out.err.splitlines())


def test_progress_lines_estimate_the_time_left_and_beat_during_a_long_call():
    import io
    import time

    from testbed.cli.progress import LineProgress, phase_progress

    now = [0.0]
    stream = io.StringIO()
    bar = LineProgress("searching", stream, interval_s=5.0, clock=lambda: now[0], eta=True)
    progress = phase_progress(bar, {"analytic": "plans (analytic tier)"})
    progress("analytic", 0, 100)
    now[0] = 10.0
    progress("analytic", 25, 100)  # a quarter in 10 s: 30 s left
    assert stream.getvalue().splitlines()[-1] == "searching plans (analytic tier): 25/100 (25%), 10 s, about 30 s left"
    stream = io.StringIO()
    with LineProgress("running", stream, interval_s=0.05, heartbeat=True) as beating:
        task = beating.add_task("compile and first step", total=1)
        time.sleep(0.5)  # one long call, no update: the heartbeat still writes lines
        beating.update(task, completed=1)
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 3 and lines[0].startswith("running compile and first step: 0/1 (0%)")
    assert lines[-1].startswith("running compile and first step: 1/1 (100%)")
