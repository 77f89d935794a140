"""How many layers each pipeline stage holds: the plan's ``layers_per_stage`` resolved to one count per stage.

A plan without ``layers_per_stage`` splits its layers evenly (``layers``
divisible by ``stage x virtual_stages``, as always). The key may instead be

- an explicit list, one count per stage (``len == mesh.stage``, each >= 1,
  summing to ``model.layers``);
- ``balanced-ends``: the first and the last stage hold one layer fewer than
  each stage between them (whose counts are equal), since the first also
  embeds and the last computes the head and loss (the Llama 3 paper,
  Dubey et al. 2024, section 3.3.2: 126 layers on 16 stages as
  ``7, 8 x 14, 7``). Exactly: with ``p`` stages every middle stage holds
  ``x = (layers + 2) / p`` layers and the two ends ``x - 1``, so the rule
  needs ``p >= 2``, ``p`` dividing ``layers + 2`` and ``x >= 2``; with
  ``p = 2`` it is the even split.

Interleaved schedules (``virtual_stages`` v > 1): a stage's count is split
over its v chunks by :func:`chunk_counts`, as evenly as possible (each chunk
``n // v`` or one more), the ``n mod v`` extra layers going to the chunks in
ascending order except that the model's two ends come last: the first
stage's chunk 0 (which also embeds) and the last stage's chunk v - 1 (which
also computes the head and loss) are the lighter. So Meta's layout, 126
layers on 16 stages as ``7, 8 x 14, 7`` with v = 8, gives every chunk one
layer but the first model chunk (the embedding alone) and the last (the
head and loss alone), as the Llama 3 paper describes; with v = 2 the first
stage holds ``3, 4`` and the last ``4, 3``. Only those two end chunks may
hold no layer (a stage of ``n`` layers needs ``n >= v`` less the end chunks
it holds); a plan without ``layers_per_stage`` keeps needing ``layers``
divisible by ``stage x virtual_stages`` (every chunk equal).

This module resolves and validates the counts (the plan calls it on
construction) and splits them over chunks (:func:`chunk_counts`); which
layer indices and parameters each (stage, chunk) holds is decided from those
by ``testbed.model.layout.chunk_layers``, the one place every consumer reads.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from testbed.errors import InputError

__all__ = ["BALANCED_ENDS", "RULES", "resolve_layers_per_stage", "balanced_ends", "near_even", "chunk_counts",
           "chunks_fit"]

#: The named rule: one layer fewer on the first and on the last stage.
BALANCED_ENDS = "balanced-ends"
#: Every named rule ``layers_per_stage`` accepts as a string.
RULES = (BALANCED_ENDS,)

_FIELD = "layers_per_stage"


def balanced_ends(layers: int, stages: int) -> tuple[int, ...]:
    """The ``balanced-ends`` split of ``layers`` over ``stages`` (module docstring); InputError if it has none."""
    if stages < 2:
        raise InputError(f"`{BALANCED_ENDS}` takes a layer from the first and the last stage, so it needs "
                         f"mesh.stage >= 2 (got {stages}); remove layers_per_stage for one stage", field=_FIELD)
    if (layers + 2) % stages or (layers + 2) // stages < 2:
        fits = [n for n in range(max(1, layers - stages), layers + stages + 1)
                if (n + 2) % stages == 0 and (n + 2) // stages >= 2]
        raise InputError(f"`{BALANCED_ENDS}` puts x - 1 layers on the first and last stage and x on the "
                         f"{stages - 2} between, so model.layers + 2 ({layers} + 2) must be a multiple of mesh.stage "
                         f"({stages}) with x >= 2; layer counts near {layers} that fit: "
                         f"{', '.join(map(str, fits)) or 'none'}; or give an explicit list of {stages} counts",
                         field=_FIELD)
    x = (layers + 2) // stages
    return (x - 1, *([x] * (stages - 2)), x - 1) if stages > 2 else (x - 1, x - 1)


def near_even(layers: int, stages: int) -> tuple[int, ...] | None:
    """The split the plan search gives a stage count that does not divide ``layers``; None when it does.

    Every stage holds ``layers // stages`` or one more; the extra layers go to
    the middle stages first (from the second on), then to the first stage,
    then to the last: the ends, which also embed and compute the head and
    loss, stay the lighter, as in ``balanced-ends`` (which this equals
    whenever that rule applies, e.g. Llama 3's 126 layers on 16 stages).
    None when ``stages`` divides ``layers`` (the even split) or exceeds it.
    """
    if stages < 1 or layers < stages or layers % stages == 0:
        return None
    base, extra = divmod(layers, stages)
    order = [*range(1, stages - 1), 0, stages - 1][:extra]
    return tuple(base + (i in order) for i in range(stages))


def resolve_layers_per_stage(value: Sequence[int] | str | None, layers: int, stages: int,
                             virtual: int = 1) -> tuple[int, ...]:
    """Layers held by each of ``stages`` stages (all its ``virtual`` chunks together) under ``value``.

    ``value`` is the plan's ``layers_per_stage``: None (the even split), a
    rule name of :data:`RULES`, or one count per stage. Every error is an
    InputError naming ``layers_per_stage`` (or ``model.layers`` for the even
    split) with what would be valid.
    """
    if isinstance(value, list):
        value = tuple(value)
    try:
        hash(value)
    except TypeError:  # entries that are not numbers (lists, mappings)
        raise InputError(f"expected `{BALANCED_ENDS}` or a list of {stages} whole numbers, got {value!r:.80}",
                         field=_FIELD) from None
    return _resolve(value, layers, stages, virtual)


@functools.lru_cache(maxsize=4096)  # read per stage and chunk by the cost and memory models
def _resolve(value: tuple[int, ...] | str | None, layers: int, stages: int, virtual: int) -> tuple[int, ...]:
    if value is None:
        if layers % (stages * virtual):
            raise InputError(f"layers {layers} must be divisible by stage x virtual_stages = {stages * virtual} "
                             f"(or give layers_per_stage: a list of {stages} per-stage counts)",
                             field="model.layers")
        return (layers // stages,) * stages
    if isinstance(value, str):
        if value not in RULES:
            raise InputError(f"unknown rule `{value}`; give `{BALANCED_ENDS}` or a list of {stages} per-stage "
                             f"layer counts", field=_FIELD)
        counts = balanced_ends(layers, stages)
        _check_chunks(counts, virtual, "the rule's ")
        return counts
    if not isinstance(value, (list, tuple)):
        raise InputError(f"expected `{BALANCED_ENDS}` or a list of {stages} per-stage layer counts, got {value!r}",
                         field=_FIELD)
    counts = tuple(value)
    if len(counts) != stages:
        raise InputError(f"needs one layer count per pipeline stage: mesh.stage is {stages}, the list has "
                         f"{len(counts)} entries ({_show(counts)})", field=_FIELD)
    for i, n in enumerate(counts):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InputError(f"entry {i} must be a whole number >= 1 (every stage holds a layer), got {n!r}",
                             field=_FIELD)
    if sum(counts) != layers:
        raise InputError(f"the counts {_show(counts)} sum to {sum(counts)}, but model.layers is {layers}; "
                         f"they must add up to it", field=_FIELD)
    _check_chunks(counts, virtual, "")
    return counts


def _ends(stage: int, stages: int, virtual: int) -> tuple[int, ...]:
    """The chunks of ``stage`` that hold a model end (embedding: stage 0's chunk 0; head: the last's chunk v - 1)."""
    return tuple(c for s, c in ((0, 0), (stages - 1, virtual - 1)) if s == stage)


def chunks_fit(counts: Sequence[int], virtual: int) -> bool:
    """Whether every stage of ``counts`` holds enough layers for ``virtual`` chunks (:func:`chunk_counts`)."""
    return all(n >= virtual - len(set(_ends(i, len(counts), virtual))) for i, n in enumerate(counts))


def _check_chunks(counts: tuple[int, ...], virtual: int, whose: str) -> None:
    """InputError unless every chunk but the two model ends holds a layer under :func:`chunk_counts`."""
    for i, n in enumerate(counts):
        need = virtual - len(set(_ends(i, len(counts), virtual)))
        if n < need:
            raise InputError(f"{whose}entry {i} ({n}) is too few for virtual_stages {virtual}: each of the stage's "
                             f"{virtual} chunks must hold a layer (only the first stage's first chunk and the last "
                             f"stage's last chunk may hold none), so stage {i} needs at least {need}", field=_FIELD)


def chunk_counts(counts: Sequence[int], virtual: int) -> tuple[tuple[int, ...], ...]:
    """Per stage, the layers of each of its ``virtual`` chunks: the interleaved split (module docstring).

    Each chunk holds ``n // virtual`` or one more; the extra layers go to the
    chunks in ascending order, the model's ends (stage 0's chunk 0, the last
    stage's chunk ``virtual - 1``) last, so they stay the lighter. An even
    count splits evenly; ``virtual`` 1 gives ``((n,), ...)``.
    """
    return _chunk_counts(tuple(counts), virtual)


@functools.lru_cache(maxsize=4096)  # a search reads it per chunk of every plan it prices
def _chunk_counts(counts: tuple[int, ...], virtual: int) -> tuple[tuple[int, ...], ...]:
    stages, out = len(counts), []
    for s, n in enumerate(counts):
        ends = _ends(s, stages, virtual)
        order = [c for c in range(virtual) if c not in ends] + list(dict.fromkeys(ends))
        base, extra = divmod(n, virtual)
        out.append(tuple(base + (c in order[:extra]) for c in range(virtual)))
    return tuple(out)


def _show(counts: tuple) -> str:
    """A list for a message, clipped past 16 entries."""
    shown = ", ".join(repr(n) for n in counts[:16])
    return f"[{shown}{', ...' if len(counts) > 16 else ''}]"
