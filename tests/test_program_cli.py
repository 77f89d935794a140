"""`testbed simulate --program module:function`: the examples predicted; bad input is exit 2 with one paragraph."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from testbed.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "predict"


def run_cli(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_vision_example_predicted_with_json_trace_and_gantt(tmp_path, capsys) -> None:
    trace, gantt = tmp_path / "t.json", tmp_path / "g.png"
    code, out, _ = run_cli(["simulate", "--program", f"{EXAMPLES / 'vision_cnn.py'}:predict", "--topology", "dgx-h100",
                            "--trace", str(trace), "--gantt", str(gantt), "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    keys = {"step_time_s", "compute_s", "exposed_comm_s", "mfu", "memory", "collective_bytes", "assumptions"}
    assert keys <= set(data)
    assert data["mesh"] == {"data": 8} and data["devices"] == 8 and data["dtype"] == "bf16"
    assert 0 < data["compute_s"] <= data["step_time_s"] and 0 < data["mfu"] < 1
    params = (3 * 3 * 3 * 64 + 3 * 3 * 64 * 128 + 128 * 1000) * 2  # bf16 gradients, all-reduced over data
    moved = data["collective_bytes"]["data"]["all_reduce"]
    assert params <= moved <= params + 8  # and the loss
    events = json.loads(trace.read_text())["traceEvents"]
    reduces = [e for e in events if e["ph"] == "X" and e.get("args", {}).get("op") == "all_reduce"]
    assert reduces and all(e["args"]["group_size"] == 8 and e["args"]["links"] for e in reduces)  # slices' args
    assert gantt.read_bytes()[:4] == b"\x89PNG"
    # 8 emulated devices here: the step compiles, and the memory is XLA's analysis (the estimate kept beside)
    assert "XLA's memory analysis" in data["memory"]["method"] and data["memory"]["live_range_estimate"] > 0
    assert data["memory"]["fits"] is True


def test_the_pmap_and_shard_map_examples_on_their_meshes(capsys) -> None:
    code, out, _ = run_cli(["simulate", "--program", f"{EXAMPLES / 'pmap_mlp.py'}:predict", "--topology", "dgx-h100",
                            "--mesh", "batch=8", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and set(data["collective_bytes"]) == {"batch"}
    # a reference value: for this MLP the live-range estimate is XLA:CPU's buffer assignment to 1%
    assert data["memory"]["live_range_estimate"] == pytest.approx(data["memory"]["total"], rel=0.01)
    code, out, _ = run_cli(["simulate", "--program", f"{EXAMPLES / 'shard_map_mlp.py'}:predict", "--topology",
                            "tpu-v5e-4x4", "--mesh", "data=4,model=4"], capsys)
    assert code == 0 and "step time" in out and "over model" in out and "over data" in out


def _bad(argv, capsys) -> str:
    code, out, err = run_cli(argv, capsys)
    assert code == 2, (out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    return err


def test_bad_programs_are_refused_in_one_paragraph(tmp_path, capsys) -> None:
    example = f"{EXAMPLES / 'vision_cnn.py'}:predict"
    assert "no such file" in _bad(["simulate", "--program", "nowhere/x.py:predict", "--topology", "dgx-h100"], capsys)
    assert "'no_such_module_xyz:predict' raised ModuleNotFoundError" in _bad(
        ["simulate", "--program", "no_such_module_xyz:predict", "--topology", "dgx-h100"], capsys)
    assert "has no function 'missing'" in _bad(
        ["simulate", "--program", f"{EXAMPLES / 'vision_cnn.py'}:missing", "--topology", "dgx-h100"], capsys)
    assert "not `module:function`" in _bad(["simulate", "--program", "vision_cnn", "--topology", "dgx-h100"], capsys)
    module = tmp_path / "user_step.py"
    module.write_text(textwrap.dedent("""\
        import jax
        import jax.numpy as jnp

        def wrong(mesh):
            return 42

        def broken(mesh):
            raise RuntimeError("my bug")

        def callback(mesh):
            def step(x):
                return jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct(x.shape, x.dtype), x).sum()
            return step, (jax.ShapeDtypeStruct((8, 4), jnp.float32),)
        """))
    assert "it must return (step, args)" in _bad(
        ["simulate", "--program", f"{module}:wrong", "--topology", "dgx-h100"], capsys)
    assert "raised RuntimeError: my bug (while being called" in _bad(
        ["simulate", "--program", f"{module}:broken", "--topology", "dgx-h100"], capsys)
    assert "host callback" in _bad(["simulate", "--program", f"{module}:callback", "--topology", "dgx-h100"], capsys)
    code, out, _ = run_cli(["simulate", "--program", f"{module}:callback", "--topology", "dgx-h100",
                            "--unknown-ops", "assume", "--json"], capsys)
    assert code == 0 and any("host callback" in a for a in json.loads(out)["assumptions"])
    assert "multiply to 8" in _bad(["simulate", "--program", example, "--topology", "dgx-h100", "--mesh", "data=4"],
                                   capsys)
    assert "not `axis=size`" in _bad(["simulate", "--program", example, "--topology", "dgx-h100", "--mesh", "data"],
                                     capsys)
    assert "needs --topology" in _bad(["simulate", "--program", example], capsys)
    assert "not both" in _bad(["simulate", "--program", example, "--plan", "demo", "--topology", "dgx-h100"], capsys)
    assert "give --plan" in _bad(["simulate"], capsys)


@pytest.mark.parametrize("spec", ["pmap_mlp.py", "shard_map_mlp.py"])
def test_a_pmap_step_needs_a_one_axis_mesh_and_shard_map_its_axes(spec, capsys) -> None:
    mesh = "batch=4,x=2" if spec == "pmap_mlp.py" else "data=8"
    err = _bad(["simulate", "--program", f"{EXAMPLES / spec}:predict", "--topology", "dgx-h100", "--mesh", mesh],
               capsys)
    assert "one axis" in err if spec == "pmap_mlp.py" else "'model'" in err or "model" in err


TINY = textwrap.dedent("""\
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    def predict(mesh):
        loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)
        return jax.jit(jax.grad(loss)), (jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P())),
                                         jax.ShapeDtypeStruct((128, 64), jnp.float32,
                                                              sharding=NamedSharding(mesh, P("data"))))
    """)


@pytest.mark.parametrize("topology, label", [
    ("dgx-h100", "(XLA's memory analysis of the compiled step; live-range estimate "),  # 8 devices here: compiled
    ("dgx-h100@16", "(live-range estimate, not compiled; arguments ")])                  # 16: traced only
def test_the_memory_line_says_whose_figure_it_is(topology, label, tmp_path, capsys) -> None:
    (tmp_path / "tiny_step.py").write_text(TINY)
    code, out, _ = run_cli(["simulate", "--program", f"{tmp_path / 'tiny_step.py'}:predict", "--topology", topology],
                           capsys)
    memory = " ".join(out[out.index("memory   "):].split())
    assert code == 0 and " ".join(label.split()) in memory
