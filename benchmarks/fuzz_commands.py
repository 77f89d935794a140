"""Bad-input cases for the newer commands: check-sharding, collective --execute, search and sweep.

Part of the bad-input fuzzer (benchmarks/fuzz_inputs.py runs the cases and
holds the older commands' strategies). Every case here is kept small: a
valid ``search`` is always given a restricted space on a small seed plan,
a ``sweep`` runs in this process (``--workers 1``) on a SPEC of one to four
points, so that a harmless mutation still ends within the per-case time
limit. ``check-sharding`` and ``collective --execute`` would start JAX once
their input is accepted; the fuzzer traps the functions that do, and counts
a case that reaches them as right only when its own check of the input
(``fuzz_inputs.may_start_jax``) finds the input valid.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from benchmarks.fuzz_docs import (BAD_BYTES, PLAN_OPTIONS, PLANS, SMALL_PLANS, SMALL_TOPOLOGIES, SWEEPS,
                                  TMP, TOPOLOGIES, TOPOLOGY_OPTIONS, Case, _dump, file_text)

__all__ = ["check_sharding_case", "execute_case", "search_case", "sweep_case", "EXECUTE_VALUES", "SWEEP_OPTIONS"]

#: ``--execute`` values: the issue's bad ones, near misses, and ones that are valid for some group size.
EXECUTE_VALUES = ("emulated:0", "emulated:-1", "emulated:abc", "gpu:x", "", " ", "emulated:99999999", "tpu:1e309",
                  "emulated:", "emulated:8:8", "emulated:1e3", "emulated: 8", "LOCAL", "emulated:" + "9" * 400,
                  "emulated:2", "emulated:4", "emulated:8", "emulated:16", "emulated:08", "local")
#: ``--repeats`` values: bad ones (argparse or the command refuses them) and small valid ones.
REPEATS_VALUES = ("0", "-1", "abc", "nan", "", "1e309", "1.5", "1", "3")
#: Sweep grid keys over the newer plan and topology keys (``grid.<path>: [values]``), near-valid and bad values.
SWEEP_OPTIONS: dict[tuple, list] = {
    ("grid", "plan.model.attention"): [["plain", "flash"], ["flash", "nope"], "flash", []],
    ("grid", "plan.model.attention_block"): [[8, 16], [3], [0], [8, "x"]],
    ("grid", "plan.sequence_parallel"): [[False, True], ["yes"], [1]],
    ("grid", "plan.layers_per_stage"): [["balanced-ends"], [[1, 3], [2, 2]], [[4, 0]], ["nope"]],
    ("grid", "plan.precision"): [["fp8-mixed", "bf16-mixed"], ["fp8"]],
    ("grid", "topology.price_per_device_hour"): [[2.5, 4.0], [-1], ["cheap"], [0]],
    ("grid", "topology.device.flops.fp8"): [["1979TFLOP/s"], ["fast"], [-1]],
    ("grid", "topology.calibration.compute.gemm_half_mn"): [[117, 0], [-1], ["x"]],
    ("grid", "topology.calibration.compute.flash_efficiency"): [[0.5], [1.5], [-0.1]],
    ("plan", "sequence_parallel"): [True, "yes"],
    ("plan", "layers_per_stage"): ["balanced-ends", [1, 3], [0, 4]],
    ("plan", "model", "attention"): ["flash", "Flash"],
    ("price_per_device_hour",): [2.5, -1, "cheap", {"H100": "x"}, {"H100": -1.0}],
}


def _small_plan_file(draw: Any) -> bytes:
    """A small seed plan, damaged (the big ones would make a valid case slow)."""
    return draw(file_text({k: PLANS[k] for k in SMALL_PLANS}, topology_key=True, options=PLAN_OPTIONS))


@st.composite
def check_sharding_case(draw: Any) -> Case:
    """`check-sharding` with a damaged plan, topology or argument; a valid plan may reach JAX (trapped)."""
    files: dict[str, bytes] = {}
    how = draw(st.sampled_from(["small", "small", "any", "valid", "bundled", "missing", "folder", "long"]))
    if how == "valid":  # an undamaged seed with the newer keys: accepted, it reaches JAX's trap
        files["plan.yaml"] = _dump(PLANS[draw(st.sampled_from(SMALL_PLANS))]).encode()
        plan = f"{TMP}/plan.yaml"
    elif how in ("small", "any"):
        files["plan.yaml"] = _small_plan_file(draw) if how == "small" else draw(
            file_text(PLANS, topology_key=True, options=PLAN_OPTIONS))
        plan = f"{TMP}/plan.yaml"
    else:
        plan = {"bundled": draw(st.sampled_from(["demo", "llama-tiny", "llama3-405b", "nope"])),
                "missing": f"{TMP}/nope.yaml", "folder": TMP, "long": f"{TMP}/" + "p" * 5000}[how]
    argv = ["check-sharding", "--plan", plan]
    topology = draw(st.sampled_from([None, None, "file", "host-cpu-8", "dgx-h100", "a100-pcie-8", "nope",
                                     f"{TMP}/x.yaml", ""]))
    if topology == "file":
        files["topology.yaml"] = draw(file_text(TOPOLOGIES, options=TOPOLOGY_OPTIONS))
        topology = f"{TMP}/topology.yaml"
    if topology is not None:
        argv += ["--topology", topology]
    return Case("check-sharding", argv, files, plan_may_be_valid=True)


@st.composite
def execute_case(draw: Any) -> Case:
    """`collective OP --execute DEVICES [--repeats N]`: one part drawn bad (or none), the rest valid.

    Bad device choices, repeats, ops and topologies must be refused before JAX; with none bad the case
    reaches JAX's trap (8-device topologies, so ``emulated:8`` is the group of ``--over all``).
    """
    files: dict[str, bytes] = {}
    bad = draw(st.sampled_from(["execute", "execute", "repeats", "topology", "op", "over", "bytes", "algorithm",
                                "none"]))
    topology = draw(st.sampled_from(["host-cpu-8", "a100-pcie-8", "eth-100g-8", "dgx-h100", "options-8"]))
    if topology == "options-8" or bad == "topology":
        seeds = {k: TOPOLOGIES[k] for k in (*SMALL_TOPOLOGIES, "options-8")}
        files["topology.yaml"] = draw(file_text(seeds, options=TOPOLOGY_OPTIONS)) if bad == "topology" else \
            _dump(TOPOLOGIES["options-8"]).encode()
        topology = f"{TMP}/topology.yaml"
    if bad == "topology" and draw(st.booleans()):
        topology = draw(st.sampled_from(["nope", "", f"{TMP}/x.yaml", TMP]))
    op = draw(st.sampled_from(["all-reduce", "all-gather", "reduce-scatter", "all-to-all"] if bad != "op" else
                              ["broadcast", "send", "nope", "", "allreduce"]))
    execute = draw(st.sampled_from(EXECUTE_VALUES) if bad == "execute" else st.sampled_from(["emulated:8", "local"]))
    argv = ["collective", op, "--topology", topology, "--execute", execute]
    if bad == "over":
        argv += ["--over", draw(st.sampled_from(["node", "pcie-switch", "x", "nope", "", ","]))]
    if bad == "repeats" or draw(st.booleans()):
        argv += ["--repeats", draw(st.sampled_from(REPEATS_VALUES if bad == "repeats" else ("1", "3")))]
    if bad == "bytes" or draw(st.booleans()):
        argv += ["--bytes", draw(BAD_BYTES if bad == "bytes" else st.sampled_from(["4KiB", "1MiB", "3B"]))]
    if bad == "algorithm":
        argv += ["--algorithm", draw(st.sampled_from(["ring", "direct", "tree", "nccl-ring", "nope", ""]))]
    return Case("collective", argv, files, plan_may_be_valid=True)


@st.composite
def search_case(draw: Any) -> Case:
    """`search` on a small (often damaged) model with a restricted space, one argument drawn from a bad pool."""
    files: dict[str, bytes] = {}
    how = draw(st.sampled_from(["file", "file", "small", "preset", "missing", "empty"]))
    if how == "file":
        files["plan.yaml"] = _small_plan_file(draw)
        model = f"{TMP}/plan.yaml"
    else:
        model = {"small": draw(st.sampled_from(["demo", "llama-tiny"])), "preset": "gpt-1.3b",
                 "missing": f"{TMP}/nope.yaml", "empty": ""}[how]
    argv = ["search", "--model", model, "--schedules", "1f1b", "--microbatches", "1,2", "--remat", "none",
            "--zero", "0", "--replay", "1", "--top", "2"]
    if how == "preset" or draw(st.integers(0, 2)) == 0:
        topology = draw(st.sampled_from(["host-cpu-8", "a100-pcie-8", "file", "nope", ""]))
        if topology == "file":
            files["topology.yaml"] = draw(file_text({k: TOPOLOGIES[k] for k in (*SMALL_TOPOLOGIES, "options-8")},
                                                    options=TOPOLOGY_OPTIONS))
            topology = f"{TMP}/topology.yaml"
        argv += ["--topology", topology]
    bad = draw(st.sampled_from(["--devices", "--global-batch", "--seq", "--objective", "--price", "--memory-cap",
                                "--top", "--replay", "--schedules", "--microbatches", "--remat", "--zero",
                                "--precision", "--contexts", "--experts", "--out", "none"]))
    values = {
        "--devices": ["0", "-1", "nan", "abc", "3", "4", "16", "1e309", "99"],
        "--global-batch": ["0", "-1", "abc", "8", "1" + "0" * 30, "nan"],
        "--seq": ["0", "-1", "8", "12", "1" + "0" * 30, "x"],
        "--objective": ["step_time", "cost", "nope", ""],
        "--price": ["nan", "inf", "-1", "0", "2.5", "abc", "1e309"],
        "--memory-cap": ["nan", "0", "-1", "1.5", "inf", "0.5", "1e-300"],
        "--top": ["0", "-1", "1"], "--replay": ["0", "-1", "nan", "2"],
        "--schedules": ["1f1b,gpipe", "nope", "", ",", "ZB-H1"], "--microbatches": ["0", "-1", "abc", "1,1e309", ","],
        "--remat": ["nope", "full", ""], "--zero": ["5", "-1", "x", "0,1"],
        "--precision": ["fp8-mixed", "fp32,bf16-mixed", "nope", "fp8"],
        "--contexts": ["0", "-2", "2", "1,2", "x", "3", "1e309"], "--experts": ["0", "2", "8", "y", "1,4", "-1"],
        "--out": [f"{TMP}/best.yaml", TMP, f"{TMP}/plan.yaml", f"{TMP}/no/dir/best.yaml", "/dev/null", ""],
    }
    if bad != "none":
        argv += [bad, draw(st.sampled_from(values[bad]))]
    return Case("search", argv, files)


@st.composite
def sweep_case(draw: Any) -> Case:
    """`sweep` (in this process): a damaged small SPEC, or one bad --db / --workers / --plot / --executor / --top."""
    files: dict[str, bytes] = {}
    bad = draw(st.sampled_from(["spec", "spec", "spec", "ref", "db", "workers", "executor", "top", "plot", "none"]))
    if bad == "spec":
        files["spec.yaml"] = draw(file_text(SWEEPS, options=SWEEP_OPTIONS))
    else:
        files["spec.yaml"] = _dump(SWEEPS[draw(st.sampled_from(sorted(SWEEPS)))]).encode()
    spec = [f"{TMP}/spec.yaml"]
    if bad == "ref":
        spec = draw(st.sampled_from([[f"{TMP}/nope.yaml"], [TMP], [""], [], ["x" * 5000]]))
    db = f"{TMP}/x.duckdb"
    if bad in ("db", "plot") or bad == "ref" and not spec:
        db = draw(st.sampled_from([TMP, f"{TMP}/spec.yaml", f"{TMP}/junk.duckdb", "/dev/null", f"{TMP}/no/dir/x.duckdb",
                                   "", f"{TMP}/missing.duckdb"]))
    if db.endswith("junk.duckdb"):
        files["junk.duckdb"] = draw(st.sampled_from([b"", b"SQLite format 3\x00" + bytes(100), b"DUCK" * 64]))
    argv = ["sweep", *([] if bad == "plot" else spec), "--db", db,
            "--workers", draw(st.sampled_from(["0", "-1", "nan", ""])) if bad == "workers" else "1"]
    if bad == "plot":  # plot-only mode reads the database: a missing, folder or foreign one
        argv += ["--plot", draw(st.sampled_from([f"{TMP}/plots", "", f"{TMP}/spec.yaml"]))]
    if bad == "executor":
        argv += ["--executor", draw(st.sampled_from(["nope", "", "Process"]))]
    if bad == "top":
        argv += ["--top", draw(st.sampled_from(["0", "-1", "abc", "1e309"]))]
    if draw(st.integers(0, 3)) == 0:
        argv += ["-v"]
    return Case("sweep", argv, files)
