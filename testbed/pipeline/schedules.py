"""Pipeline schedules as tables: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2.

A :class:`Schedule` is a frozen per-stage list of :class:`Action` s (forward
``F``, backward ``B``, weight-gradient ``W``) in execution order. The
simulator turns it into a task graph and the runner executes it, so both
read the very same table; neither re-derives an order on its own.

Conventions
-----------
* Model chunk ``g = chunk * stages + stage`` (Megatron interleaved): stage
  ``s`` holds chunks ``s, p + s, 2p + s, ...`` as virtual chunks ``0..v-1``.
* ``F(mb, g)`` needs ``F(mb, g-1)``; ``B(mb, g)`` needs ``F(mb, g)`` and
  ``B(mb, g+1)``; ``W(mb, g)`` needs ``B(mb, g)``. Schedules without a split
  backward (gpipe, 1f1b, interleaved) use ``B`` for the full backward and have
  no ``W`` (``split_backward`` is False).
* A microbatch's activations for a chunk are held from its ``F`` until its
  last backward action (``W`` when split, else ``B``); :func:`peak_inflight`
  counts such (microbatch, chunk) pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from testbed.errors import InputError, closest
from testbed.plan.limits import MAX_STAGES
from testbed.plan.spec import Plan, ScheduleName

__all__ = [
    "splits_backward", "Action", "Schedule", "Send", "KINDS", "build_schedule", "dependencies", "validate",
    "execution_order", "peak_inflight", "held_during", "peak_deferred_weight_grads", "held_by_gradient_chunks",
    "sends", "schedule_names",
    "schedule_for_plan", "dependency_keys", "MAX_ACTIONS", "check_schedule_size",
]

KINDS = ("F", "B", "W")


@dataclass(frozen=True, slots=True, kw_only=False)
class Action:
    """One pipeline action: ``kind`` F/B/W of ``microbatch`` on virtual ``chunk``."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InputError(f"action kind must be one of {', '.join(KINDS)}, got {self.kind!r}", field="kind")
        if self.microbatch < 0 or self.chunk < 0:
            raise InputError("microbatch and chunk must be >= 0", field="microbatch")

    def label(self, virtual: int = 1) -> str:
        """``F3`` (or ``F3.1`` for chunk 1 when the schedule has virtual chunks)."""
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if virtual > 1 else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class Send:
    """A point-to-point transfer between stages: activation (after F) or gradient (after B)."""

    src: int
    dst: int
    what: str  # "activation" | "gradient"
    microbatch: int
    src_chunk: int
    dst_chunk: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """A pipeline schedule table: ``actions[stage]`` in execution order."""

    name: str
    stages: int
    microbatches: int
    virtual: int = 1
    split_backward: bool = False
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        for name in ("stages", "microbatches", "virtual"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"must be a positive whole number, got {value!r}", field=name)
        if len(self.actions) != self.stages:
            raise InputError(f"needs one action list per stage ({self.stages}), got {len(self.actions)}",
                             field="actions")

    @property
    def chunks(self) -> int:
        """Model chunks in total: stages x virtual."""
        return self.stages * self.virtual

    def model_chunk(self, stage: int, chunk: int) -> int:
        """Global model chunk index of virtual ``chunk`` on ``stage``."""
        return chunk * self.stages + stage

    def locate(self, model_chunk: int) -> tuple[int, int]:
        """(stage, virtual chunk) holding global ``model_chunk``."""
        return model_chunk % self.stages, model_chunk // self.stages

    def steps(self) -> list[list[str]]:
        """Per-stage action labels, e.g. ``[["F0", "F1", "B0", ...], ...]``."""
        return [[a.label(self.virtual) for a in row] for row in self.actions]


def schedule_names() -> tuple[str, ...]:
    """Valid schedule names."""
    return tuple(n.value for n in ScheduleName)


def dependencies(schedule: Schedule, stage: int, action: Action) -> list[tuple[int, Action]]:
    """What ``action`` on ``stage`` waits for: (stage, action) pairs, possibly on other stages."""
    g = schedule.model_chunk(stage, action.chunk)
    mb = action.microbatch
    deps: list[tuple[int, Action]] = []
    if action.kind == "F":
        if g > 0:
            s, c = schedule.locate(g - 1)
            deps.append((s, Action("F", mb, c)))
    elif action.kind == "B":
        deps.append((stage, Action("F", mb, action.chunk)))
        if g < schedule.chunks - 1:
            s, c = schedule.locate(g + 1)
            deps.append((s, Action("B", mb, c)))
    else:
        deps.append((stage, Action("B", mb, action.chunk)))
    return deps


def sends(schedule: Schedule) -> tuple[Send, ...]:
    """Every inter-stage transfer the table implies, in the order the senders produce them."""
    out: list[Send] = []
    for stage, row in enumerate(schedule.actions):
        for a in row:
            g = schedule.model_chunk(stage, a.chunk)
            if a.kind == "F" and g < schedule.chunks - 1:
                dst, c = schedule.locate(g + 1)
                if dst != stage:
                    out.append(Send(src=stage, dst=dst, what="activation", microbatch=a.microbatch,
                                    src_chunk=a.chunk, dst_chunk=c))
            elif a.kind == "B" and g > 0:
                dst, c = schedule.locate(g - 1)
                if dst != stage:
                    out.append(Send(src=stage, dst=dst, what="gradient", microbatch=a.microbatch,
                                    src_chunk=a.chunk, dst_chunk=c))
    return tuple(out)


def _expected(schedule: Schedule, stage: int) -> set[Action]:
    kinds = KINDS if schedule.split_backward else ("F", "B")
    return {Action(k, mb, c) for k in kinds for mb in range(schedule.microbatches) for c in range(schedule.virtual)}


def dependency_keys(schedule: Schedule, stage: int, kind: str, mb: int, chunk: int) -> list[tuple]:
    """:func:`dependencies` as plain ``(stage, kind, microbatch, chunk)`` tuples (fast path)."""
    p = schedule.stages
    g = chunk * p + stage
    if kind == "F":
        return [((g - 1) % p, "F", mb, (g - 1) // p)] if g > 0 else []
    if kind == "B":
        own = [(stage, "F", mb, chunk)]
        return own + [((g + 1) % p, "B", mb, (g + 1) // p)] if g < schedule.chunks - 1 else own
    return [(stage, "B", mb, chunk)]


def execution_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """A global order in which every action runs after its dependencies (stages keep table order).

    Raises :class:`InputError` if the table deadlocks (a dependency cycle
    through the per-stage orders).
    """
    p = schedule.stages
    rows = [[(s, a.kind, a.microbatch, a.chunk) for a in row] for s, row in enumerate(schedule.actions)]
    deps = [[dependency_keys(schedule, *key) for key in row] for row in rows]
    pos = [0] * p
    done: set[tuple] = set()
    order: list[tuple[int, Action]] = []
    total = sum(len(r) for r in rows)
    while len(order) < total:
        progressed = False
        for s in range(p):
            row, row_deps, i = rows[s], deps[s], pos[s]
            while i < len(row) and all(d in done for d in row_deps[i]):
                done.add(row[i])
                order.append((s, schedule.actions[s][i]))
                i += 1
            progressed |= i > pos[s]
            pos[s] = i
        if not progressed:
            stuck = ", ".join(f"stage {s}: {schedule.actions[s][pos[s]].label(schedule.virtual)}"
                              for s in range(p) if pos[s] < len(schedule.actions[s]))
            raise InputError(f"schedule `{schedule.name}` deadlocks; waiting: {stuck}", field="actions")
    return order


def validate(schedule: Schedule) -> None:
    """Raise :class:`InputError` unless every action appears exactly once and all dependencies can be met."""
    for s, row in enumerate(schedule.actions):
        expected = _expected(schedule, s)
        if len(row) != len(set(row)) or set(row) != expected:
            missing = sorted(a.label(schedule.virtual) for a in expected - set(row))
            extra = sorted(a.label(schedule.virtual) for a in set(row) - expected)
            dup = len(row) - len(set(row))
            raise InputError(f"stage {s} must run every action once; missing {missing}, unexpected {extra}, "
                             f"{dup} duplicated", field="actions")
        for a in row:
            if a.microbatch >= schedule.microbatches or a.chunk >= schedule.virtual:
                raise InputError(f"stage {s}: {a} is out of range", field="actions")
    execution_order(schedule)


def held_during(row: Sequence[Action], acquire: str = "F", release: str = "B") -> list[tuple[int, ...]]:
    """For each action of one stage's ``row``: the chunks of the microbatch sets held while it runs.

    A set is taken by its ``acquire`` action (``F``: held while the forward
    runs, since it writes it; otherwise from the next action on, e.g. the
    cotangent a split ``B`` keeps for ``W``) and freed after its ``release``
    action (held while that runs). One entry per held set, so a chunk repeats
    once per microbatch. The one rule of how long activations live, shared by
    testbed.model.memory (counts) and the runner's compiled-memory walk (bytes).
    """
    held: list[int] = []
    out = []
    for a in row:
        if a.kind == acquire == "F":
            held.append(a.chunk)
        out.append(tuple(held))
        if a.kind == acquire != "F":
            held.append(a.chunk)
        if a.kind == release:
            held.remove(a.chunk)
    return out


def _peak_held(row: Sequence[Action], acquire: str, release: str) -> int:
    """``max(len(h) for h in held_during(row, acquire, release))`` in linear time and constant memory.

    ``held_during`` lists every held set per action (quadratic in the
    microbatches: 10^5 of them took over 10 GB); a peak needs only the count.
    """
    held = peak = 0
    for a in row:
        if a.kind == acquire == "F":
            held += 1
        peak = max(peak, held)
        if a.kind == acquire != "F":
            held += 1
        if a.kind == release:
            held -= 1
    return peak


def peak_inflight(schedule: Schedule, release: str = "B") -> tuple[int, ...]:
    """Per stage, the most (microbatch, chunk) activation sets held at once.

    A set is held from its F until its ``release`` action: ``"B"`` (default;
    for split schedules the paper's convention, since B frees all but the
    weight-gradient inputs) or ``"W"`` (everything W still needs, split
    schedules only; same as ``"B"`` otherwise).
    """
    if release not in ("B", "W"):
        raise InputError(f"release must be B or W, got {release!r}", field="release")
    if not schedule.split_backward:
        release = "B"
    return tuple(_peak_held(row, "F", release) for row in schedule.actions)


def held_by_gradient_chunks(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
    """Per stage, indexed by ``g``: the most activation sets held at once while exactly ``g`` of the stage's
    chunks have gradients, i.e. have run (or are running) their first weight-gradient action of the step
    (``W`` when split, else ``B``). Entry ``g`` is 0 where no instant has ``g`` chunks with gradients.

    For stacks whose gradients are allocated by the step's first backward of each parameter and freed after
    the update (``runtime.lazy_grads``), the memory model weighs each entry's held sets against ``g`` chunks'
    gradients (testbed.model.memory): when every forward of a stage runs before its first backward (the first
    half of the stages of the interleaved schedule with ``microbatches <= stages``), the activation peak holds
    only the gradients the first backward is writing. Sets are held
    from ``F`` to ``B`` as :func:`peak_inflight` counts them; linear in the row.
    """
    writes = "W" if schedule.split_backward else "B"
    out = []
    for row in schedule.actions:
        held, done, best = 0, set(), [0] * (schedule.virtual + 1)
        for a in row:
            if a.kind == "F":
                held += 1
            if a.kind == writes:
                done.add(a.chunk)
            best[len(done)] = max(best[len(done)], held)
            if a.kind == "B":
                held -= 1
        out.append(tuple(best))
    return tuple(out)


def peak_deferred_weight_grads(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most W actions waiting after their B (0 without a split backward)."""
    if not schedule.split_backward:
        return (0,) * schedule.stages
    return tuple(_peak_held(row, "B", "W") for row in schedule.actions)


# -- builders --------------------------------------------------------------------

def _gpipe(p: int, m: int) -> list[list[Action]]:
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]


def _one_f_one_b(p: int, m: int) -> list[list[Action]]:
    rows = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        row = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            row += [Action("F", warmup + i), Action("B", i)]
        row += [Action("B", i) for i in range(m - warmup, m)]
        rows.append(row)
    return rows


def _interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B order (Narayanan et al. 2021)."""
    total = m * v

    def forward(k: int) -> Action:
        return Action("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def backward(k: int) -> Action:
        return Action("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    rows = []
    for s in range(p):
        warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
        row = [forward(k) for k in range(warmup)]
        for i in range(total - warmup):
            row += [forward(warmup + i), backward(i)]
        row += [backward(k) for k in range(total - warmup, total)]
        rows.append(row)
    return rows


def _zero_bubble(p: int, m: int, limits: list[int], deferred: int) -> list[list[Action]]:
    """Greedy unit-time list schedule in the spirit of Qi et al. 2023 (backward split into B and W).

    Every action takes one tick. At each tick a stage runs the first possible of:
    the oldest deferred W if more than ``deferred`` are waiting; the next B
    whose inputs have arrived; the next F if fewer than ``limits[s]``
    microbatches wait for their B (the activation memory bound); the oldest
    deferred W. Deferring W to idle ticks is what removes the bubbles.
    """
    rows: list[list[Action]] = [[] for _ in range(p)]
    never = 1 << 62
    f_end = [[never] * m for _ in range(p)]  # tick at which F(mb) on stage s has finished
    b_end = [[never] * m for _ in range(p)]
    next_f = [0] * p
    next_b = [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]
    tick = 0
    remaining = 3 * m * p
    while remaining:
        for s in range(p):
            b, f, waiting = next_b[s], next_f[s], pending_w[s]
            if len(waiting) > deferred:
                rows[s].append(Action("W", waiting.pop(0)))
            elif b < m and f_end[s][b] <= tick and (s == p - 1 or b_end[s + 1][b] <= tick):
                rows[s].append(Action("B", b))
                b_end[s][b] = tick + 1
                next_b[s] += 1
                waiting.append(b)
            elif f < m and f - b < limits[s] and (s == 0 or f_end[s - 1][f] <= tick):
                rows[s].append(Action("F", f))
                f_end[s][f] = tick + 1
                next_f[s] += 1
            elif waiting:
                rows[s].append(Action("W", waiting.pop(0)))
            else:
                continue
            remaining -= 1
        tick += 1
    return rows


#: Actions of one schedule table (stages x microbatches x virtual chunks x 2, or 3 with a split backward) at
#: most: the table, its dependency graph and its timing are built action by action (about 5 s per 200,000
#: actions on one core).
MAX_ACTIONS = 200_000
#: Stage-ticks of the zero-bubble list scheduler at most ((3 x microbatches + 2 x stages) x stages).
MAX_ZERO_BUBBLE_TICKS = 20_000_000


def check_schedule_size(kind: ScheduleName, stages: int, microbatches: int, virtual: int) -> None:
    """InputError before any work when a table would exceed :data:`MAX_ACTIONS` (or the zero-bubble tick bound)."""
    if stages > MAX_STAGES:
        raise InputError(f"must be at most {MAX_STAGES:,} (ordering the table takes about stages^2 steps), "
                         f"got {stages:,}", field="stages")
    split = kind in (ScheduleName.ZB_H1, ScheduleName.ZB_H2)
    actions = stages * microbatches * virtual * (3 if split else 2)
    if actions > MAX_ACTIONS:
        raise InputError(f"{stages} stages x {microbatches} microbatches x {virtual} virtual gives {actions:,} "
                         f"actions; at most {MAX_ACTIONS:,} are built (fewer stages or microbatches)",
                         field="microbatches")
    if split and (3 * microbatches + 2 * stages) * stages > MAX_ZERO_BUBBLE_TICKS:
        raise InputError(f"{kind} over {stages} stages x {microbatches} microbatches takes more than "
                         f"{MAX_ZERO_BUBBLE_TICKS:,} scheduling steps; use fewer stages", field="stages")


def splits_backward(name: str | ScheduleName) -> bool:
    """Whether schedule ``name`` splits the backward into B (input gradients) and W (weight gradients): the
    zero-bubble schedules (a table's ``split_backward``, known without building it)."""
    return ScheduleName(str(name).lower()) in (ScheduleName.ZB_H1, ScheduleName.ZB_H2)


def build_schedule(name: str | ScheduleName, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The table of schedule ``name`` for ``stages`` x ``microbatches`` (``virtual`` chunks for interleaved)."""
    try:
        kind = ScheduleName(str(name).lower())
    except ValueError:
        hint = closest(str(name), schedule_names())
        raise InputError(f"unknown schedule `{name}`" + (f"; did you mean `{hint}`?" if hint else "")
                         + f" Valid: {', '.join(schedule_names())}.", field="schedule") from None
    for field_name, value in (("stages", stages), ("microbatches", microbatches), ("virtual", virtual)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"must be a positive whole number, got {value!r}", field=field_name)
    p, m, v = stages, microbatches, virtual
    check_schedule_size(kind, p, m, v)
    if kind is not ScheduleName.INTERLEAVED and v != 1:
        raise InputError(f"virtual > 1 needs schedule `interleaved`, not `{kind}`", field="virtual")
    if kind is ScheduleName.INTERLEAVED and p > 1 and m % p:
        raise InputError(f"interleaved needs microbatches ({m}) divisible by stages ({p})", field="microbatches")
    split = splits_backward(kind)
    if kind is ScheduleName.GPIPE:
        rows = _gpipe(p, m)
    elif kind is ScheduleName.ONE_F_ONE_B:
        rows = _one_f_one_b(p, m)
    elif kind is ScheduleName.INTERLEAVED:
        rows = _interleaved(p, m, v)
    elif kind is ScheduleName.ZB_H1:
        rows = _zero_bubble(p, m, [p - s for s in range(p)], deferred=p - 1)
    else:
        rows = _zero_bubble(p, m, [2 * (p - s) - 1 for s in range(p)], deferred=2 * (p - 1))
    return Schedule(name=kind.value, stages=p, microbatches=m, virtual=v, split_backward=split,
                    actions=tuple(tuple(r) for r in rows))


def schedule_for_plan(plan: Plan) -> Schedule:
    """The table a plan asks for: its schedule over ``mesh.stage`` stages and ``batch.microbatches``."""
    return build_schedule(plan.schedule.name, plan.mesh.stage, plan.batch.microbatches, plan.schedule.virtual_stages)
