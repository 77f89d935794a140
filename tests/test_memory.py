"""testbed.model.memory: ZeRO/fsdp/tensor sharding, schedule in-flight activations, remat, OOM, the CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import yaml

from testbed.model import costs as tm
from testbed.cli import main
from testbed.model import layout
from testbed.model.memory import inflight_microbatches, memory_breakdown, state_bytes_per_param
from testbed.plan.runtime import RuntimeSpec
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, Remat, ScheduleSpec
from testbed.plan.io import bundled_plan_names, load_plan
from testbed.topology.io import bundled_names, load_topology

SPEC = ModelSpec(layers=4, d_model=64, heads=4, d_ff=256, seq_len=32, vocab=256)
HOST = load_topology("host-cpu-8")
CONTRACT = ("params_count", "params", "grads", "optimizer", "activations", "workspace", "total", "capacity", "fits")


def _plan(**kw) -> Plan:
    mesh = MeshSpec(**kw.pop("mesh", {}))
    batch = BatchSpec(global_batch=kw.pop("batch", 16), microbatches=kw.pop("mb", 1))
    return Plan(model=kw.pop("model", SPEC), batch=batch, mesh=mesh, **kw)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_zero_stages_shard_states_in_order(precision: str) -> None:
    # Two microbatches: the gradient buffer accumulates, so all model states are live at the peak.
    # Full remat re-gathers ZeRO-3 weights per layer (without it they are kept as residuals, below).
    m = [memory_breakdown(_plan(mesh={"data": 8}, mb=2, zero=z, precision=precision, remat="full"), HOST)
         for z in range(4)]
    assert all(a.total > b.total for a, b in zip(m, m[1:]))
    assert m[1].optimizer < m[0].optimizer and m[1].grads == m[0].grads and m[1].params == m[0].params
    assert m[2].grads < m[1].grads and m[2].params == m[1].params
    assert m[3].params < m[2].params
    assert m[0].activations == m[3].activations
    # ZeRO paper accounting: 16 bytes per parameter of model states, unsharded.
    assert sum(state_bytes_per_param(_plan(precision=precision))) == 16
    assert m[0].params + m[0].grads + m[0].optimizer == 16 * tm.param_count(SPEC)


@pytest.mark.parametrize("remat", list(Remat))
def test_zero3_gathers_one_block_and_its_prefetch(remat: Remat) -> None:
    # Gathered per block, forward and backward (the backward gathers again), whatever the remat: the block
    # computing and `fsdp_prefetch` blocks ahead are live, never the whole stage.
    z2 = memory_breakdown(_plan(mesh={"data": 8}, mb=2, zero=2, remat=remat), HOST)
    layer = sum(p.size for p in layout.layer_params(SPEC, 0))
    embed = sum(p.size for p in layout.embedding_params(SPEC))
    head = sum(p.size for p in layout.head_params(SPEC))
    assert embed + SPEC.layers * layer + head == tm.param_count(SPEC)
    blocks = sorted([layer] * SPEC.layers + [embed, head], reverse=True)
    # A microbatch's unsharded fp32 gradients: ZeRO-2 writes the whole stage's before reduce-scattering them,
    # ZeRO-3 one block's at a time (reduce-scattered in each block's backward).
    z2_rest = z2.workspace - 4 * tm.param_count(SPEC)
    for prefetch in (0, 1, 3):
        z3 = memory_breakdown(_plan(mesh={"data": 8}, mb=2, zero=3, remat=remat,
                                    runtime=RuntimeSpec(fsdp_prefetch=prefetch)), HOST)
        assert z3.params * 8 == z2.params
        assert z3.workspace == z2_rest + 4 * blocks[0] + 4 * sum(blocks[:1 + prefetch])
    whole = memory_breakdown(_plan(mesh={"data": 8}, mb=2, zero=3, remat=remat,
                                   runtime=RuntimeSpec(fsdp_prefetch=64)), HOST)
    assert whole.workspace == z2_rest + 4 * blocks[0] + 4 * tm.param_count(SPEC)  # never more than the stage holds


def test_zero_without_data_parallelism_changes_nothing() -> None:
    base = memory_breakdown(_plan(), HOST)
    assert memory_breakdown(_plan(zero=3), HOST).total == base.total


@pytest.mark.parametrize("axis", ["tensor", "fsdp"])
def test_states_fall_with_tensor_and_fsdp_degree(axis: str) -> None:
    m = [memory_breakdown(_plan(mesh={axis: n}), HOST) for n in (1, 2, 4)]
    for a, b in zip(m, m[1:]):
        # Gradients at the peak instant: an XLA step with a collective computes its weight gradients after the
        # layers' backward (testbed.model.kept.weight_grads_deferred), so its peak may hold none.
        assert b.params < a.params and b.grads <= a.grads and b.optimizer < a.optimizer
    if axis == "tensor":
        assert all(b.activations < a.activations for a, b in zip(m, m[1:]))
        assert all(b.total < a.total for a, b in zip(m, m[1:]))
    else:
        # fsdp also splits the batch: fewer sequences per device.
        assert all(b.activations < a.activations for a, b in zip(m, m[1:]))


@pytest.mark.parametrize("remat", list(Remat))
def test_activations_linear_in_microbatch(remat: Remat) -> None:
    one = memory_breakdown(_plan(batch=8, mb=4, remat=remat, mesh={"stage": 2}), HOST)
    three = memory_breakdown(_plan(batch=24, mb=4, remat=remat, mesh={"stage": 2}), HOST)
    for a, b in zip(one.per_stage, three.per_stage):
        assert b.activations == 3 * a.activations


def test_activations_in_seq_len_linear_with_remat_and_exact_quadratic_without() -> None:
    def acts(seq: int, remat: Remat) -> int:
        return memory_breakdown(_plan(model=replace(SPEC, seq_len=seq), remat=remat, mb=2), HOST).activations

    for remat in (Remat.SELECTIVE, Remat.FULL):
        assert acts(64, remat) == 2 * acts(32, remat)
    # No remat: linear part doubles, the score term (b * heads * seq^2 * 4 bytes per layer) quadruples.
    score = SPEC.layers * 8 * SPEC.heads * 32 ** 2 * 4
    assert acts(64, Remat.NONE) - 4 * score == 2 * (acts(32, Remat.NONE) - score)


def test_remat_order() -> None:
    m = {r: memory_breakdown(_plan(remat=r, mb=2), HOST) for r in Remat}
    assert m[Remat.FULL].activations < m[Remat.SELECTIVE].activations < m[Remat.NONE].activations


def test_inflight_follows_schedule() -> None:
    gpipe = _plan(model=replace(SPEC, layers=8), batch=8, mb=8, mesh={"stage": 4}, schedule=ScheduleSpec(name="gpipe"))
    ofob = replace(gpipe, schedule=ScheduleSpec(name="1f1b"))
    assert inflight_microbatches(gpipe) == (8, 8, 8, 8)
    assert inflight_microbatches(ofob) == (4, 3, 2, 1)
    g, o = memory_breakdown(gpipe, HOST), memory_breakdown(ofob, HOST)
    assert g.activations > o.activations
    assert [s.activations for s in o.per_stage][:3] == sorted([s.activations for s in o.per_stage][:3], reverse=True)
    inter = replace(ofob, schedule=ScheduleSpec(name="interleaved", virtual_stages=2))
    peaks = inflight_microbatches(inter)
    assert all(1 <= n <= 16 for n in peaks) and peaks[0] >= peaks[-1]


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_lazy_gradients_leave_the_peak_only_where_every_forward_runs_first(zero: int) -> None:
    """runtime.lazy_grads (PyTorch's .grad, allocated by the first backward): 1F1B runs its first backward at its
    activation peak, so nothing changes; interleaved with m = p runs every forward of stage 0 first, so its peak
    holds one chunk's gradients (the first backward's, being written) instead of all of them, and the total falls by
    the rest; it never rises."""
    ofob = _plan(model=replace(SPEC, layers=8), batch=8, mb=4, mesh={"stage": 4, "data": 2}, zero=zero,
                 schedule=ScheduleSpec(name="1f1b"))
    inter = replace(ofob, schedule=ScheduleSpec(name="interleaved", virtual_stages=2))
    for plan in (ofob, inter):
        lazy = replace(plan, runtime=replace(plan.runtime, lazy_grads=True))
        eager_rows, lazy_rows = memory_breakdown(plan, HOST).per_stage, memory_breakdown(lazy, HOST).per_stage
        assert all(b.total <= a.total for a, b in zip(eager_rows, lazy_rows))
        if plan is ofob:
            assert lazy_rows == eager_rows
    eager0, lazy0 = memory_breakdown(inter, HOST).per_stage[0], memory_breakdown(
        replace(inter, runtime=replace(inter.runtime, lazy_grads=True)), HOST).per_stage[0]
    assert lazy0.activations == eager0.activations and lazy0.grads == eager0.grads // 2
    assert eager0.total - lazy0.total == eager0.grads - eager0.grads // 2


def test_breakdown_parts_sum_and_per_stage_worst() -> None:
    m = memory_breakdown(_plan(batch=8, mb=4, mesh={"stage": 2, "tensor": 2, "data": 2}, zero=1), HOST)
    assert m.total == max(s.total for s in m.per_stage)
    assert m.total == m.params + m.grads + m.optimizer + m.activations + m.workspace
    assert m.params_count == tm.param_count(SPEC)
    assert m.capacity == int(HOST.device.memory_bytes) and m.fits


@pytest.mark.parametrize("remat", list(Remat))
def test_one_microbatch_peak_is_below_the_all_live_bound(remat: Remat) -> None:
    # Without accumulation, activations are freed while gradients appear: the peak instant can hold
    # no more than all states + all activations + the largest workspace.
    one = memory_breakdown(_plan(batch=4, remat=remat), HOST)
    two = memory_breakdown(_plan(batch=8, mb=2, remat=remat), HOST)
    assert one.grads <= two.grads and one.activations <= two.activations
    assert one.total <= two.total
    assert one.params + one.optimizer == two.params + two.optimizer


@pytest.mark.parametrize("plan_name", bundled_plan_names())
def test_every_bundled_plan_on_every_bundled_topology(plan_name: str) -> None:
    plan = load_plan(plan_name)
    for name in bundled_names():
        topology = load_topology(name)
        m = memory_breakdown(plan, topology)
        assert 0 < m.total and m.fits == (m.total <= topology.device.memory_bytes)


def _write_plan(tmp_path, **fields) -> str:
    data = {"name": "big", "topology": "dgx-h100",
            "model": {"kind": "gpt", "layers": 32, "d_model": 5120, "heads": 40, "d_ff": 20480, "seq_len": 2048,
                      "vocab": 50304},
            "batch": {"global_batch": 2, "microbatches": 2}, "mesh": {"data": 1}, "precision": "fp32"}
    data.update(fields)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_cli_predicts_oom_for_10b_fp32_adam_on_one_gpu(tmp_path, capsys) -> None:
    path = _write_plan(tmp_path)
    assert main(["memory", "--plan", path, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert all(key in data for key in CONTRACT)
    assert data["params_count"] > 10e9 and not data["fits"]
    assert data["params"] + data["grads"] + data["optimizer"] == 16 * data["params_count"] > data["capacity"]
    assert main(["memory", "--plan", path, "--fail-if-oom", "--json"]) == 1


def test_cli_fits_and_bad_input(tmp_path, capsys) -> None:
    assert main(["memory", "--plan", "demo", "--fail-if-oom"]) == 0
    assert "fits" in capsys.readouterr().out
    assert main(["memory", "--plan", str(tmp_path / "missing.yaml")]) == 2
    path = _write_plan(tmp_path, topology=None)
    assert main(["memory", "--plan", path]) == 2
    assert "topology" in capsys.readouterr().err
