"""The GPT's parameter layout: one table every count, shape, sharding and buffer is derived from.

The model (``testbed.model.costs`` counts it, ``testbed.runner.model`` builds it)::

    {"embed": {"tokens": [vocab, d], "positions": [seq, d]},
     "layers": [ {"ln1": {scale, bias}, "attn": {wqkv [d,3,d], bqkv [3,d], wo [d,d], bo [d]},
                  "ln2": {scale, bias}, "mlp": {w1 [d,f], b1 [f], w2 [f,d], b2 [d]}}, ... ],
     "head": {"norm": {scale, bias}, "w": [d, vocab]}}      # no "w" when tied

for the default GPT. The model family options of :class:`ModelSpec` change
rows: ``head_dim`` makes the attention's ``d`` (Q's and the out projection's) ``q = heads x head_dim``;
``kv_heads`` < ``heads`` replaces ``wqkv``/``bqkv`` by ``wq [d,q]``,
``bq [q]``, ``wkv [d,2,kv_dim]``, ``bkv [2,kv_dim]``; ``parallel_block`` drops ``ln2``; ``mlp: swiglu`` adds
the up projection ``w3 [d,f]`` (and ``b3``); ``norm: rmsnorm`` and
``bias: false`` drop the norms' biases, ``bias: false`` also the linear
ones; ``position: rope`` drops the position table. ``vocab`` rows are the
padded vocab (:attr:`ModelSpec.padded_vocab`).

Mixture of experts (``model.experts`` > 0): the layers :meth:`ModelSpec.is_moe_layer` names replace the
dense ``mlp`` by ``moe``: a router ``[d, experts]`` (replicated), the routed experts' stacked weights
``w1 [experts, d, fe]`` (``w3`` too with SwiGLU; ``b1 [experts, fe]``, ``b3``, ``b2 [experts, d]`` with
biases) and ``w2 [experts, fe, d]``, where ``fe`` is the expert width (``expert_d_ff``, else ``d_ff``),
and with ``shared_experts`` S an always-active dense MLP ``shared_w1 [d, S fe]`` (``shared_w3``),
``shared_w2 [S fe, d]`` (and biases). The expert axis splits dim 0 of the routed experts'
weights (:attr:`ParamSpec.expert_dim`), the tensor axis their ``fe`` dim (Megatron's column/row
split within every expert). Layers differ then, so :func:`layer_params` takes the layer index.

That picture is :data:`_TABLE` below, row by row; nothing else writes it.
Each row says which part of the model the parameter belongs to (:class:`Part`), its path under
that part's root, its shape in :class:`ModelSpec` fields, the dim the tensor axis splits (Megatron:
QKV and MLP-in by columns, the out projection and MLP-out by rows, the token table and the head by
vocab; LayerNorms, the position table and the row-split biases have none: replicated) and how the
runner initialises it (the random key it draws from, so init values never move).

Where the pieces sit in a pipeline (:func:`chunk_layers`, :func:`chunk_params`):
each stage holds the plan's per-stage layer count (``Plan.stage_layers``:
even by default, or ``layers_per_stage``), split over its virtual chunks
as evenly as possible (``testbed.plan.stages.chunk_counts``), consecutive layers in model-chunk order; the embedding on
stage 0's chunk 0, the head on the last stage's last chunk; with tied
embeddings on another chunk than the embedding's, that chunk holds a copy
of the token table (Megatron style; its gradient is all-reduced with the
original), so held parameters then exceed the model's.

FSDP and ZeRO shard every parameter by ONE rule, padded where the shard
count does not divide it: testbed.model.param_spec says how.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import NamedTuple

from testbed.errors import InputError
from testbed.plan.spec import Mlp, ModelSpec, Norm, Position
from testbed.plan.stages import chunk_counts, resolve_layers_per_stage

__all__ = [
    "Part", "Init", "ParamSpec", "INIT_STD", "GLOBAL_KEYS", "LAYER_KEYS", "LAYER_LEAVES",
    "layer_keys", "is_moe_layer", "embedding_params", "layer_params", "layers_params", "head_params", "tied_table", "model_params", "param_at", "shard_dim",
    "chunk_layers", "embedding_holder", "head_holder", "holds", "chunk_params", "held_elements",
]

#: Standard deviation of the random weights (GPT-2); residual projections are scaled further.
INIT_STD = 0.02


from testbed.model.param_spec import Init, ParamSpec, Part, shard_dim  # noqa: F401 (re-exported)


# -- the table ------------------------------------------------------------------------------

class _Row(NamedTuple):
    part: Part
    path: tuple[str, ...]
    dims: tuple[str | int, ...]       # ModelSpec field (or property) names, or literal sizes
    tensor_dim: int | None
    init: Init
    rng: int | None = None
    when: tuple[str, ...] = ()        # _WHEN conditions: present only for the models meeting them all
    units: str | None = None          # ModelSpec field counting whole units (heads) along the tensor dim:
                                      # split only when the tensor degree divides it, else replicated
    moe: bool | None = None           # None: every layer; False: dense-MLP layers only; True: MoE layers only
    expert_dim: int | None = None     # the experts dim (routed experts' stacked weights)


#: Under the embedding root: the table a tied head multiplies by (transposed).
_TIED_PATH = ("tokens",)
_E, _L, _H = Part.EMBEDDING, Part.LAYER, Part.HEAD
_D, _F, _V, _KV, _Q = "d_model", "d_ff", "padded_vocab", "kv_dim", "q_dim"
#: MoE sizes: routed experts, one expert's width, the shared experts' joint width.
_X, _FE, _FS = "experts", "_expert_width", "_shared_width"


def _shared_width(s: ModelSpec) -> int:
    return s.shared_experts * s.expert_width


_SIZES: dict[str, Callable[[ModelSpec], int]] = {_FE: lambda s: s.expert_width, _FS: _shared_width}


#: Conditions a row's ``when`` names (all must hold for the model to have the row).
_WHEN: dict[str, Callable[[ModelSpec], bool]] = {
    "untied": lambda s: not s.tied_embeddings,
    "learned": lambda s: s.position is Position.LEARNED,
    "norm_bias": lambda s: s.norm is Norm.LAYERNORM and s.bias,
    "mha": lambda s: not s.grouped, "gqa": lambda s: s.grouped, "serial": lambda s: not s.parallel_block,
    "bias": lambda s: s.bias,
    "swiglu": lambda s: s.mlp is Mlp.SWIGLU,
    "shared": lambda s: s.shared_experts > 0,
}


#: The layout, in the runner's init order. q, k, v are stacked on their own axis so a split of the
#: last (heads x head_dim) axis hands each tensor rank whole heads of all three. With grouped-query
#: attention Q has its own matrix and K, V are stacked (``wkv [d, 2, kv_heads x head_dim]``): the
#: tensor axis splits whole K/V heads when it divides ``kv_heads``, and leaves ``wkv`` whole on every
#: rank when ``kv_heads`` < tensor (each rank projects all K/V heads and uses its query heads' groups).
#: SwiGLU's ``w1`` is the gate, ``w3`` the up projection, both split by columns; ``w2`` the down one.
#: Rows with ``when`` exist only for the models it accepts (the defaults are GPT-2's rows).
_TABLE: tuple[_Row, ...] = (
    _Row(_E, ("tokens",), (_V, _D), 0, Init.NORMAL, rng=0),
    _Row(_E, ("positions",), ("seq_len", _D), None, Init.NORMAL, rng=1, when=("learned",)),
    _Row(_L, ("ln1", "scale"), (_D,), None, Init.ONES),
    _Row(_L, ("ln1", "bias"), (_D,), None, Init.ZEROS, when=("norm_bias",)),
    _Row(_L, ("attn", "wqkv"), (_D, 3, _Q), 2, Init.NORMAL, rng=0, when=("mha",)),
    _Row(_L, ("attn", "bqkv"), (3, _Q), 1, Init.ZEROS, when=("mha", "bias")),
    _Row(_L, ("attn", "wq"), (_D, _Q), 1, Init.NORMAL, rng=0, when=("gqa",)),
    _Row(_L, ("attn", "bq"), (_Q,), 0, Init.ZEROS, when=("gqa", "bias")),
    _Row(_L, ("attn", "wkv"), (_D, 2, _KV), 2, Init.NORMAL, rng=4, when=("gqa",), units="num_kv_heads"),
    _Row(_L, ("attn", "bkv"), (2, _KV), 1, Init.ZEROS, when=("gqa", "bias"), units="num_kv_heads"),
    _Row(_L, ("attn", "wo"), (_Q, _D), 0, Init.NORMAL_RESIDUAL, rng=1),
    _Row(_L, ("attn", "bo"), (_D,), None, Init.ZEROS, when=("bias",)),
    _Row(_L, ("ln2", "scale"), (_D,), None, Init.ONES, when=("serial",)),
    _Row(_L, ("ln2", "bias"), (_D,), None, Init.ZEROS, when=("norm_bias", "serial")),
    _Row(_L, ("mlp", "w1"), (_D, _F), 1, Init.NORMAL, rng=2, moe=False),
    _Row(_L, ("mlp", "b1"), (_F,), 0, Init.ZEROS, when=("bias",), moe=False),
    _Row(_L, ("mlp", "w3"), (_D, _F), 1, Init.NORMAL, rng=5, when=("swiglu",), moe=False),
    _Row(_L, ("mlp", "b3"), (_F,), 0, Init.ZEROS, when=("swiglu", "bias"), moe=False),
    _Row(_L, ("mlp", "w2"), (_F, _D), 0, Init.NORMAL_RESIDUAL, rng=3, moe=False),
    _Row(_L, ("mlp", "b2"), (_D,), None, Init.ZEROS, when=("bias",), moe=False),
    _Row(_L, ("moe", "router"), (_D, _X), None, Init.NORMAL, rng=6, moe=True),
    _Row(_L, ("moe", "w1"), (_X, _D, _FE), 2, Init.NORMAL, rng=7, moe=True, expert_dim=0),
    _Row(_L, ("moe", "b1"), (_X, _FE), 1, Init.ZEROS, when=("bias",), moe=True, expert_dim=0),
    _Row(_L, ("moe", "w3"), (_X, _D, _FE), 2, Init.NORMAL, rng=8, when=("swiglu",), moe=True, expert_dim=0),
    _Row(_L, ("moe", "b3"), (_X, _FE), 1, Init.ZEROS, when=("swiglu", "bias"), moe=True, expert_dim=0),
    _Row(_L, ("moe", "w2"), (_X, _FE, _D), 1, Init.NORMAL_RESIDUAL, rng=9, moe=True, expert_dim=0),
    _Row(_L, ("moe", "b2"), (_X, _D), None, Init.ZEROS, when=("bias",), moe=True, expert_dim=0),
    _Row(_L, ("moe", "shared_w1"), (_D, _FS), 1, Init.NORMAL, rng=10, when=("shared",), moe=True),
    _Row(_L, ("moe", "shared_b1"), (_FS,), 0, Init.ZEROS, when=("shared", "bias"), moe=True),
    _Row(_L, ("moe", "shared_w3"), (_D, _FS), 1, Init.NORMAL, rng=11, when=("shared", "swiglu"), moe=True),
    _Row(_L, ("moe", "shared_b3"), (_FS,), 0, Init.ZEROS, when=("shared", "swiglu", "bias"), moe=True),
    _Row(_L, ("moe", "shared_w2"), (_FS, _D), 0, Init.NORMAL_RESIDUAL, rng=12, when=("shared",), moe=True),
    _Row(_L, ("moe", "shared_b2"), (_D,), None, Init.ZEROS, when=("shared", "bias"), moe=True),
    _Row(_H, ("norm", "scale"), (_D,), None, Init.ONES),
    _Row(_H, ("norm", "bias"), (_D,), None, Init.ZEROS, when=("norm_bias",)),
    _Row(_H, ("w",), (_D, _V), 1, Init.NORMAL, rng=2, when=("untied",)),
)

#: The default GPT (GPT-2's architecture), for the module constants below.
_GPT = ModelSpec(layers=1, d_model=1, heads=1, d_ff=1, seq_len=1, vocab=1)


@functools.lru_cache(maxsize=256)  # read per layer of every chunk a search prices
def _kinds(spec: ModelSpec) -> tuple[bool, ...]:
    """Whether each layer is an MoE layer (:meth:`ModelSpec.is_moe_layer`, the one rule)."""
    return tuple(bool(spec.experts) and spec.is_moe_layer(i) for i in range(spec.layers))


def _rows(spec: ModelSpec, part: Part | None = None, moe: bool | None = None) -> tuple[_Row, ...]:
    """The model's rows (of ``part``); layer rows of every layer kind the model has, or of one kind."""
    present = set(_kinds(spec)) if moe is None else {moe}
    return tuple(r for r in _TABLE if (part is None or r.part is part)
                 and all(_WHEN[w](spec) for w in r.when) and (r.moe is None or r.moe in present))


def layer_keys(spec: ModelSpec) -> int:
    """Random keys each layer splits its own key into: one past the largest ``rng`` of the model's layer rows
    (4 for the default GPT, so its values never move when rows are added for other models)."""
    return 1 + max(r.rng for r in _rows(spec, _L) if r.rng is not None)


def is_moe_layer(spec: ModelSpec, index: int) -> bool:
    """Whether layer ``index`` (0-based) holds the ``moe`` rows instead of the dense ``mlp`` ones."""
    return _kinds(spec)[index]


#: Random keys drawn from the seed before the layers' (token table, positions, head; the head's is
#: drawn even when tied, and the positions' even without a position table, so the layers' keys do
#: not depend on tying or positions).
GLOBAL_KEYS = 1 + max(r.rng for r in _TABLE if r.part is not _L and r.rng is not None)
#: Random keys each layer of the default GPT splits its own key into (:func:`layer_keys` in general).
LAYER_KEYS = layer_keys(_GPT)
#: Parameter arrays of one layer of the default GPT (``len(layer_params(spec))`` in general).
LAYER_LEAVES = len(_rows(_GPT, _L))


def _resolve(row: _Row, spec: ModelSpec) -> ParamSpec:
    std = {Init.NORMAL: INIT_STD, Init.NORMAL_RESIDUAL: INIT_STD / math.sqrt(2 * spec.layers)}.get(row.init, 0.0)
    shape = tuple(d if isinstance(d, int) else _SIZES[d](spec) if d in _SIZES else getattr(spec, d)
                  for d in row.dims)
    return ParamSpec(part=row.part, path=row.path, shape=shape, tensor_dim=row.tensor_dim,
                     init=row.init, std=std, rng=row.rng,
                     tensor_units=getattr(spec, row.units) if row.units else 0, expert_dim=row.expert_dim)


@functools.lru_cache(maxsize=256)
def _params(spec: ModelSpec, part: Part, moe: bool | None = None) -> tuple[ParamSpec, ...]:
    return tuple(_resolve(r, spec) for r in _rows(spec, part, moe))


def embedding_params(spec: ModelSpec) -> tuple[ParamSpec, ...]:
    """The token table and the learned position table."""
    return _params(spec, Part.EMBEDDING)


def layer_params(spec: ModelSpec, index: int | None = None) -> tuple[ParamSpec, ...]:
    """Layer ``index``'s parameters: two norms, the attention projections, and the dense MLP or the MoE block.

    ``index`` None: the parameters every layer has, for a model whose layers are all alike (a dense model, or
    MoE in every layer); a model mixing dense and MoE layers must name the layer (ValueError otherwise).
    """
    kinds = _kinds(spec)
    if index is None:
        if len(set(kinds)) > 1:
            raise ValueError("the model mixes dense and MoE layers: layer_params needs the layer index")
        return _params(spec, Part.LAYER, kinds[0])
    if not 0 <= index < spec.layers:
        raise ValueError(f"layer index {index} outside 0..{spec.layers - 1}")
    return _params(spec, Part.LAYER, kinds[index])


def layers_params(spec: ModelSpec, layers: Iterable[int]) -> tuple[tuple[ParamSpec, int], ...]:
    """(parameter, copies) over the layers ``layers``: each layer kind's rows once per layer of that kind."""
    kinds = _kinds(spec)
    counts: dict[bool, int] = {}
    for i in layers:
        counts[kinds[i]] = counts.get(kinds[i], 0) + 1
    held: dict[ParamSpec, int] = {}
    for kind in sorted(counts):
        for p in _params(spec, Part.LAYER, kind):
            held[p] = held.get(p, 0) + counts[kind]
    return tuple(held.items())


def head_params(spec: ModelSpec) -> tuple[ParamSpec, ...]:
    """The final LayerNorm and the output projection (none when tied to the token table)."""
    return _params(spec, Part.HEAD)


def tied_table(spec: ModelSpec) -> ParamSpec:
    """The embedding parameter a tied head reuses as its output projection: the token table."""
    return next(p for p in embedding_params(spec) if p.path == _TIED_PATH)


def model_params(spec: ModelSpec) -> tuple[ParamSpec, ...]:
    """Embedding, the distinct layer parameters (one layer of each kind the model has), head."""
    return embedding_params(spec) + _params(spec, Part.LAYER) + head_params(spec)


def param_at(spec: ModelSpec, names: Iterable[str]) -> ParamSpec:
    """The table entry of a params-pytree leaf, from the string keys on its path.

    Keys before the first part root (a chunk's wrapping) are skipped;
    list indices are not names. Raises KeyError for a leaf the table lacks.
    """
    names = list(names)
    roots = {p.root: p for p in Part}
    start = next((i for i, n in enumerate(names) if n in roots), None)
    if start is not None:
        path = tuple(names[start + 1:])
        for param in _params(spec, roots[names[start]]):
            if param.path == path:
                return param
    raise KeyError(f"no parameter at {'/'.join(names)!r} in the model's layout")


# -- where the parameters sit in a pipeline -------------------------------------------------

def _stage_counts(spec: ModelSpec, stages: int, virtual: int, stage_layers: tuple[int, ...] | None
                  ) -> tuple[int, ...]:
    """Layers per stage: ``stage_layers`` checked (``testbed.plan.stages``' rules), or the even split."""
    for name, value in (("stages", stages), ("virtual", virtual)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"must be a positive whole number, got {value!r}", field=name)
    return resolve_layers_per_stage(None if stage_layers is None else tuple(stage_layers), spec.layers, stages,
                                    virtual)


def chunk_layers(spec: ModelSpec, stages: int, virtual: int = 1,
                 stage_layers: tuple[int, ...] | None = None) -> tuple[tuple[range, ...], ...]:
    """``[stage][chunk] -> range`` of layer indices (Megatron interleaving).

    Model chunk ``c * stages + s`` lives on stage ``s`` as its virtual chunk
    ``c``; the model chunks hold consecutive layers in that order. Stage
    ``s`` holds ``stage_layers[s]`` layers (a plan's :attr:`Plan.stage_layers`;
    None: ``layers / stages`` each), split over its chunks by
    :func:`testbed.plan.stages.chunk_counts` (as evenly as possible, the
    model's two end chunks the lighter). Every pipeline split of layers is
    decided here. Memoized (a search reads it for every chunk of every plan): the answer is immutable.
    """
    return _chunk_layers(spec, stages, virtual, None if stage_layers is None else tuple(stage_layers))


@functools.lru_cache(maxsize=4096)
def _chunk_layers(spec: ModelSpec, stages: int, virtual: int, stage_layers: tuple[int, ...] | None
                  ) -> tuple[tuple[range, ...], ...]:
    per = chunk_counts(_stage_counts(spec, stages, virtual, stage_layers), virtual)
    out: list[list[range]] = [[range(0)] * virtual for _ in range(stages)]
    start = 0
    for c in range(virtual):
        for s in range(stages):
            out[s][c] = range(start, start + per[s][c])
            start += per[s][c]
    return tuple(map(tuple, out))


def embedding_holder(stages: int, virtual: int = 1) -> tuple[int, int]:
    """(stage, chunk) holding the embedding: the first model chunk."""
    return 0, 0


def head_holder(stages: int, virtual: int = 1) -> tuple[int, int]:
    """(stage, chunk) holding the head: the last model chunk."""
    return stages - 1, virtual - 1


def holds(stage: int, chunk: int, stages: int, virtual: int = 1) -> tuple[bool, bool]:
    """(holds the embedding, holds the head) for virtual chunk ``chunk`` of pipeline stage ``stage``."""
    here = (stage, chunk)
    return here == embedding_holder(stages, virtual), here == head_holder(stages, virtual)


@functools.lru_cache(maxsize=1024)
def chunk_params(spec: ModelSpec, stage: int, chunk: int, stages: int, virtual: int = 1, *,
                 tied_copy: bool = True, stage_layers: tuple[int, ...] | None = None
                 ) -> tuple[tuple[ParamSpec, int], ...]:
    """(parameter, copies) held by virtual chunk ``chunk`` of pipeline stage ``stage``.

    Each layer parameter once per layer of the chunk, the embedding and the
    head on their holders, and, with ``tied_copy`` and tied embeddings, the
    token table again on the head's chunk when that is not the embedding's.
    ``tied_copy=False`` gives the runner's chunk pytree (its pipeline refuses
    tied embeddings across stages; one program holds one tree).
    ``stage_layers`` as in :func:`chunk_layers`.
    """
    ranges = chunk_layers(spec, stages, virtual, stage_layers)
    if not 0 <= stage < stages:
        raise InputError(f"must be in 0..{stages - 1}, got {stage}", field="stage")
    if not 0 <= chunk < virtual:
        raise InputError(f"must be in 0..{virtual - 1}, got {chunk}", field="chunk")
    embed, head = holds(stage, chunk, stages, virtual)
    held = list(layers_params(spec, ranges[stage][chunk]))
    if embed:
        held[:0] = [(p, 1) for p in embedding_params(spec)]
    if head:
        held += [(p, 1) for p in head_params(spec)]
        if tied_copy and spec.tied_embeddings and not embed:
            held.append((tied_table(spec), 1))
    return tuple(held)


def held_elements(held: Iterable[tuple[ParamSpec, int]], tensor: int = 1, ways: int = 1, expert: int = 1,
                  experts_only: bool | None = None, expert_tensor: int | None = None) -> int:
    """Elements one device holds of ``held`` ((parameter, copies) pairs) at tensor and expert degree (the MoE
    layers' ``expert_tensor``: :meth:`ParamSpec.degrees`) and shard ways; ``experts_only`` True counts only
    routed experts' weights, False only the others."""
    return sum(copies * p.device_elements(tensor, ways, expert, expert_tensor) for p, copies in held
               if experts_only is None or p.is_expert == experts_only)
