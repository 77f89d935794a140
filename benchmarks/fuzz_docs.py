"""Seed documents and how the bad-input fuzzer damages them (benchmarks/fuzz_inputs.py draws its cases from here).

The seeds are the bundled plans and topologies, plus fuzzer-only ones that
switch on every newer option on a SMALL model, so that mutating them is
quick to simulate: flash attention with an explicit block, sequence
parallelism, uneven ``layers_per_stage`` (a list and ``balanced-ends``),
``fp8-mixed``; a topology with ``price_per_device_hour``, fp8 peak FLOPs and
the GEMM shape and flash calibration; and two sweep SPECs (a tiny grid, and
examples/sweeps/gpt-70b-network.yaml cut to one point).

A document is damaged at random (:func:`mutated`: a value replaced by a wrong
type, NaN, infinity, a huge or negative number, a long string, a nested list
or a boolean; keys deleted, duplicated or renamed), at one of the newer keys
with values near the valid ones (:func:`options_mutated`), or at the text
level (:func:`file_text`: a duplicated line, a cut, a flipped byte, raw
bytes, a BOM, UTF-16).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Seed documents: the bundled plans and topologies (read once), and a small graph-form topology.
PLAN_FILES = sorted((ROOT / "plans").glob("*.yaml")) + sorted((ROOT / "plans" / "validation").glob("*.yaml"))[:3]
TOPOLOGY_FILES = sorted((ROOT / "topologies").glob("*.yaml"))
PLANS = {p.stem: yaml.safe_load(p.read_text()) for p in PLAN_FILES}
TOPOLOGIES = {p.stem: yaml.safe_load(p.read_text()) for p in TOPOLOGY_FILES}
TOPOLOGIES["graph-4"] = {
    "name": "graph-4",
    "device": {"name": "dev", "flops": {"fp32": "10TFLOP/s"}, "memory": "16GiB", "memory_bandwidth": "500GB/s"},
    "graph": {"devices": 4, "switches": ["sw"],
              "links": [{"a": i, "b": "sw", "bandwidth": "25GB/s", "latency": "2us", "kind": "pcie"} for i in range(4)],
              "levels": [{"name": "pair", "size": 2}]},
}
#: Small seeds for the commands that simulate (the big ones are covered by plan check and memory).
SMALL_TOPOLOGIES = ("host-cpu-8", "a100-pcie-8", "eth-100g-8", "tpu-v5e-4x4", "graph-4")

#: A fuzzer-only topology with every newer key: a price, fp8 peak, the GEMM shape model and flash calibration.
TOPOLOGIES["options-8"] = {
    "name": "options-8", "price_per_device_hour": 2.5,
    "device": {"name": "gpu", "flops": {"fp8": "1979TFLOP/s", "bf16": "989TFLOP/s", "fp32": "67TFLOP/s"},
               "memory": "80GB", "memory_bandwidth": "3.35TB/s"},
    "levels": [{"name": "node", "size": 8, "bandwidth": "450GB/s", "latency": "1us", "kind": "nvswitch"}],
    "calibration": {"compute": {"efficiency": 0.8, "efficiency_half_flops": 5.0e+9, "launch_overhead_s": "5us",
                                "gemm_half_mn": 117, "gemm_half_k": 167, "gemm_latency_s": "5.7us",
                                "flash_efficiency": 0.5}},
}
_TINY = {"layers": 4, "d_model": 32, "heads": 4, "kv_heads": 2, "d_ff": 64, "seq_len": 16, "vocab": 128,
         "mlp": "swiglu", "norm": "rmsnorm", "position": "rope", "bias": False,
         "attention": "flash", "attention_block": 8}
#: Fuzzer-only plans with every newer plan key on a tiny Llama (8 devices, so they simulate in well under a second).
OPTION_PLANS = {
    "options-fp8-list": {
        "name": "options-fp8-list", "topology": "dgx-h100", "model": _TINY,
        "batch": {"global_batch": 16, "microbatches": 4}, "mesh": {"data": 2, "fsdp": 1, "tensor": 2, "stage": 2},
        "layers_per_stage": [1, 3], "sequence_parallel": True, "schedule": "1f1b", "precision": "fp8-mixed",
        "remat": "selective", "zero": 1, "optimizer": {"name": "adamw", "learning_rate": 1.0e-3}},
    "options-balanced-ends": {
        "name": "options-balanced-ends", "topology": "a100-pcie-8", "model": {**_TINY, "layers": 6},
        "batch": {"global_batch": 8, "microbatches": 4}, "mesh": {"data": 1, "fsdp": 1, "tensor": 2, "stage": 4},
        "layers_per_stage": "balanced-ends", "sequence_parallel": True, "schedule": "1f1b",
        "precision": "bf16-mixed", "remat": "none", "zero": 0, "optimizer": {"name": "adamw", "learning_rate": 1.0e-3}},
    "options-moe-context": {
        "name": "options-moe-context", "topology": "dgx-h100",
        "model": {**_TINY, "experts": 4, "top_k": 2, "expert_d_ff": 32, "shared_experts": 1, "first_dense_layers": 1,
                  "moe_every": 1, "capacity_factor": 1.25, "router_aux_loss": 0.01},
        "batch": {"global_batch": 8, "microbatches": 2}, "mesh": {"expert": 2, "context": 2, "tensor": 2},
        "layers_per_stage": [4], "sequence_parallel": True, "expert_imbalance": 1.5, "schedule": "1f1b",
        "precision": "bf16-mixed", "remat": "none", "zero": 1},
}
PLANS.update(OPTION_PLANS)
#: Small seeds for the commands that simulate (the big ones are covered by plan check and memory).
SMALL_TOPOLOGIES = ("host-cpu-8", "a100-pcie-8", "eth-100g-8", "tpu-v5e-4x4", "graph-4")
#: Small seed plans (8 devices or fewer) for the commands whose valid cases do real work (search, check-sharding).
SMALL_PLANS = ("demo", "llama-tiny", *OPTION_PLANS)

_SWEEP_TOPOLOGY = {
    "name": "two-level",
    "device": {"name": "H100", "flops": {"bf16": "989TFLOP/s", "fp32": "67TFLOP/s"}, "memory": "80GB",
               "memory_bandwidth": "3.35TB/s"},
    "levels": [{"name": "node", "size": 8, "bandwidth": "450GB/s", "latency": "1us", "kind": "nvswitch"},
               {"name": "cluster", "size": 2, "bandwidth": "400Gb/s", "latency": "3us", "kind": "infiniband"}]}
_EXAMPLE = yaml.safe_load((ROOT / "examples" / "sweeps" / "gpt-70b-network.yaml").read_text())
#: Sweep SPEC seeds: tests/test_sweep.py's tiny grid (4 points), and the example cut to one small point.
SWEEPS = {
    "tiny": {"name": "tiny", "plan": {"name": "tiny", "model": {"layers": 4, "d_model": 64, "heads": 4, "d_ff": 256,
                                                              "seq_len": 32, "vocab": 256},
                                      "batch": {"global_batch": 16, "microbatches": 2},
                                      "mesh": {"data": 2, "tensor": 2, "stage": 2}, "schedule": "1f1b"},
             "topology": _SWEEP_TOPOLOGY, "fill": "data", "price_per_device_hour": {"H100": 3.0},
             "grid": {"topology.nodes": [1, 2], "plan.mesh.stage": [1, 2]}},
    "gpt-70b-network-cut": {
        **_EXAMPLE, "plan": {**_EXAMPLE["plan"], "model": {**_EXAMPLE["plan"]["model"], "layers": 8}},
        "search": {**_EXAMPLE["search"], "schedules": ["1f1b"], "remat": ["full"], "replay": 1},
        "grid": {"topology.levels.cluster.bandwidth, price_per_device_hour": [["400Gb/s", 2.50]],
                 "topology.devices": [16]}},
}

#: The placeholder for the case's folder in file texts and arguments.
TMP = "@TMP@"

# -- values -------------------------------------------------------------------------

_HUGE = [10**30, 2**50, 2**53, 2**53 + 1, 2**63, 10**400, -(10**30), 1_048_577, 100_001, 65_536, 10**6]
BAD_VALUES = st.one_of(
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -1e-320, 0.0, -0.5]),
    st.sampled_from(_HUGE), st.integers(-3, 3), st.integers(), st.floats(),
    st.booleans(), st.none(),
    st.text(max_size=12), st.sampled_from(["x" * 10_000, "x" * 100_000, "1e309GB", "nanGB/s", "-1us", ".inf",
                                           "xy", "10**30", "\x00", "\u202e", "../../etc/passwd"]),
    st.lists(st.integers(-2, 5), max_size=4), st.just([[1, [2, [3, [4]]]]]), st.just([]), st.just({}),
    st.dictionaries(st.text(max_size=4), st.integers(-2, 5), max_size=3), st.just({float("inf"): 1}),
).map(copy.deepcopy)  # a fresh copy: later mutations must not change the strategy's own constants

TOPOLOGY_REFS = st.sampled_from([f"{TMP}/topology.yaml", f"{TMP}/missing.yaml", f"{TMP}/" + "t" * 5000 + ".yaml",
                                 "t" * 300, TMP, "/dev/null", "host-cpu-8", "dgx-h100", "no-such-topology", ""])

# -- plan keys by name, near their valid values ---------------------------------------------

#: Plan keys fuzzed by name (path from the document's root), with values near the valid ones.
PLAN_OPTIONS: dict[tuple, list] = {
    ("model", "attention"): ["plain", "flash", "Flash", "blockwise", "", "flash "],
    ("model", "attention_block"): [1, 2, 3, 7, 8, 16, 32, 0, -8, 2**40, 8.0, 8.5, "8"],
    ("sequence_parallel",): [True, False, "true", "yes", 1, 0],
    ("layers_per_stage",): ["balanced-ends", "balanced", "Balanced-Ends", [1, 3], [2, 2], [3, 1], [4, 0], [0, 4],
                            [3, 3], [1, 1, 1, 1], [1, 2, 2, 1], [], [-1, 5], [1.5, 2.5], [[1], [3]], [True, 3],
                            ["1", "3"], [2**63, 1], [2, 2, 2]],
    ("precision",): ["fp8-mixed", "fp8", "FP8-mixed", "bf16-mixed", "fp8_mixed"],
    ("mesh", "tensor"): [1, 2, 4],
    ("model", "seq_len"): [8, 12, 16, 24],
    ("mesh", "context"): [1, 2, 3, 4, 8, 0, -2, 2.0, "2"],
    ("mesh", "expert"): [1, 2, 4, 8, 3, 0, "4"],
    ("mesh", "order"): [["stage", "data", "fsdp", "tensor"], ["context", "tensor"], ["expert"], []],
    ("model", "experts"): [0, 1, 2, 4, 8, 6, -1, 2**40, 4.0, "8"],
    ("model", "top_k"): [1, 2, 4, 5, 0, 2**40],
    ("model", "expert_d_ff"): [8, 16, 32, 33, 0, None, 2**40],
    ("model", "shared_experts"): [0, 1, 2, -1, 2**40],
    ("model", "first_dense_layers"): [0, 1, 3, 4, 5, -1],
    ("model", "moe_every"): [1, 2, 3, 0, -1],
    ("model", "capacity_factor"): [None, 1, 1.25, 2.0, 0, -1, 1e-300, 1e308, "1.25"],
    ("model", "router_aux_loss"): [0, 0.01, 1, -0.01, 1e308],
    ("expert_imbalance",): [1, 1.0, 1.5, 4, 0.5, 0, 1e308, "1.5"],
}
#: Topology keys added since: the price, fp8 peak, and the GEMM shape and flash calibration.
TOPOLOGY_OPTIONS: dict[tuple, list] = {
    ("price_per_device_hour",): [2.5, 0, 0.0, -1, "cheap", "$2", "2.5", 1e308, True, None],
    ("device", "flops", "fp8"): ["1979TFLOP/s", "0TFLOP/s", "-1TFLOP/s", "nanTFLOP/s", "1e400TFLOP/s", 0, "fast", 1e15],
    **{("calibration", "compute", key): [0, -1, 117, 1.5, 0.5, 2, "5us", "1ms", "-5us", True, 1e308]
       for key in ("gemm_half_mn", "gemm_half_k", "gemm_latency_s", "flash_efficiency")},
}


@st.composite
def options_mutated(draw: Any, doc: Any, options: dict[tuple, list]) -> Any:
    """``doc`` with one to three of ``options``' keys set (created where absent) to a near-valid or a bad value."""
    doc = copy.deepcopy(doc)
    if not isinstance(doc, dict):
        return doc
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(sorted(options)))
        parent = doc
        for key in path[:-1]:
            if not isinstance(parent.get(key), dict):
                parent[key] = {}
            parent = parent[key]
        parent[path[-1]] = draw(st.one_of(st.sampled_from(options[path]), BAD_VALUES) if draw(st.integers(0, 3))
                                else BAD_VALUES)
    return copy.deepcopy(doc)


# -- mutating documents ------------------------------------------------------------------


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) into ``doc``, containers included, the root excluded."""
    out = []
    if isinstance(doc, dict):
        items = list(doc.items())
    elif isinstance(doc, list):
        items = list(enumerate(doc))
    else:
        return out
    for key, value in items:
        out.append((*prefix, key))
        out.extend(_paths(value, (*prefix, key)))
    return out


def _parent(doc: Any, path: tuple) -> Any:
    for key in path[:-1]:
        doc = doc[key]
    return doc


@st.composite
def mutated(draw: Any, doc: Any, topology_key: bool = False) -> Any:
    """``doc`` with one to three random mutations (values, keys, structure)."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        if not paths or not isinstance(doc, (dict, list)):
            return draw(BAD_VALUES)
        path = draw(st.sampled_from(paths))
        parent, key = _parent(doc, path), path[-1]
        op = draw(st.sampled_from(["replace", "replace", "replace", "delete", "rename", "inf-key", "wrap", "root"]))
        if op == "replace":
            parent[key] = draw(TOPOLOGY_REFS) if topology_key and key == "topology" and draw(st.booleans()) \
                else draw(BAD_VALUES)
        elif op == "delete":
            if isinstance(parent, dict):
                del parent[key]
            else:
                parent.pop(key)
        elif op in ("rename", "inf-key") and isinstance(parent, dict):
            value = parent.pop(key)
            new = float("inf") if op == "inf-key" else draw(st.sampled_from(
                [str(key).upper(), f"{key}s", str(key)[:-1] or "k", "x" * 300, 7, True]))
            parent[new] = value
        elif op == "wrap":
            parent[key] = [parent[key]]
        elif op == "root":
            return draw(st.sampled_from([[doc], "text", 3, None]))
    if topology_key and isinstance(doc, dict) and draw(st.integers(0, 3)) == 0:
        doc["topology"] = draw(TOPOLOGY_REFS)
    return doc


def _dump(doc: Any) -> str:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


@st.composite
def file_text(draw: Any, seeds: dict[str, Any], topology_key: bool = False,
              options: dict[tuple, list] | None = None) -> bytes:
    """A mutated seed as YAML bytes, the ``options`` keys set near their valid values, or text-level damage."""
    seed = seeds[draw(st.sampled_from(sorted(seeds)))]
    how = draw(st.sampled_from(["mutate"] * 6 + ["options"] * (3 if options else 0)
                               + ["duplicate-line", "cut", "flip", "bytes", "bom", "utf16"]))
    if how == "mutate":
        return _dump(draw(mutated(seed, topology_key))).encode()
    if how == "options":
        return _dump(draw(options_mutated(seed, options))).encode()
    text = _dump(seed)
    if how == "duplicate-line":
        lines = text.splitlines(keepends=True)
        i = draw(st.integers(0, len(lines) - 1))
        return "".join(lines[: i + 1] + [lines[i]] + lines[i + 1:]).encode()
    if how == "cut":
        return text[: draw(st.integers(0, len(text)))].encode()
    if how == "flip":
        raw = bytearray(text.encode())
        i = draw(st.integers(0, len(raw) - 1))
        raw[i] = draw(st.integers(0, 255))
        return bytes(raw)
    if how == "bom":
        return b"\xef\xbb\xbf" + text.encode()
    if how == "utf16":
        return text.encode("utf-16")
    return draw(st.binary(max_size=300))


# -- argument values ----------------------------------------------------------------------

BAD_NUMBERS = st.sampled_from(["nan", "inf", "-inf", "1e309", "-1", "0", "1", "2", "3", "70000", "99", "-99",
                               "1000", "100000", "1" + "0" * 30, "abc", "", "1.5", "0x10", "4,4", "x" * 5000])
BAD_BYTES = st.sampled_from(["1GiB", "4MB", "0", "-1", "nan", "inf", "1e309", "1e400GB", "nanB", "1" + "0" * 400,
                             "12 parsecs", "", "x" * 3000])
BAD_COSTS = st.sampled_from(["1,1,1", "1,2,0", "nan,1,1", "inf,1,1", "1,-inf,1", "1,1", "1;2;3", "1,1,1;1,1,1",
                             "-1,1,1", "1e309,1,1", "1,1,1e308", "", ";;", "a,b,c", "1," * 5000])


@dataclass
class Case:
    """One command line (``TMP`` marks the case's folder) and the files to write there first."""

    command: str
    argv: list[str]
    files: dict[str, bytes] = field(default_factory=dict)
    #: ``run``, ``check-sharding``, ``collective --execute``: the input may be valid (its damage can be harmless);
    #: then reaching JAX is right, if the fuzzer's own check of the input (``fuzz_inputs.may_start_jax``) agrees.
    plan_may_be_valid: bool = False
    #: What to make in the folder besides the files (benchmarks/fuzz_sweeps.py: a FIFO, a link, a foreign or
    #: locked database, ...); empty for none.
    setup: str = ""


def _maybe(draw: Any, flag: str, values: st.SearchStrategy) -> list[str]:
    return [flag, draw(values)] if draw(st.booleans()) else []
