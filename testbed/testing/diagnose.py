"""Diagnosis by experiment: re-run the parallel function with one controlled change at a time.

When outputs differ, :func:`diagnose` first re-runs the parallel function once
with every interposition recording (:mod:`testbed.testing.interpose`): the
collectives it calls and over which axes, the statistics it takes over dim 0,
the keys its shards use, the losses it differentiates. From those sites it
lists the changes that would undo a classic bug, most specific first:

1. every statistic over dim 0 ``pmean``-ed over a mapped axis (BatchNorm with per-device statistics);
2. every key the shards share folded with ``axis_index`` (dropout with the same key on every shard);
3. each ``psum`` made a ``pmean`` and each ``pmean`` a ``psum`` (a sum where a mean was meant, a mean
   taken twice);
4. each all_gather's ``axis`` moved to another dim (a gather over the wrong dimension);
5. each collective run over another mapped axis (a wrong axis name);
6. the differentiated loss scaled by an axis size or the number of gradient calls, or their inverse (a
   loss normalised by the local batch, gradients accumulated and averaged twice).

It runs at most ``budget`` of them (each one re-trace and compile of the parallel
function, none of the reference), stops at the first whose output equals the
reference within the comparison's tolerances, and reports it as a named cause;
when none matches it says what was tried and what the budget left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from testbed.testing.interpose import COLLECTIVES, Change, InterposeError, Site, Survey, interposed

__all__ = ["DEFAULT_BUDGET", "Experiment", "experiments", "diagnose"]

#: Re-runs a failing comparison may spend on experiments (plus one survey run): each compiles the parallel
#: function once, about 0.2-1 s for the examples' tiny models on one CPU core.
DEFAULT_BUDGET = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class Experiment:
    """A :class:`Change` with the words for it: ``tried`` (what was changed) and ``cause`` (the bug it undoes)."""

    change: Change
    tried: str
    cause: str


def _sites(survey: Survey, *kinds: str) -> list[Site]:
    """The first call from each source line of the given kinds (a change applies to every call from its line);
    collectives of constants (``psum(1, axis)``: the axis size) left out."""
    seen, out = set(), []
    for site in survey.sites:
        if site.kind in kinds and site.line not in seen and not site.constant:
            seen.add(site.line)
            out.append(site)
    return out


def _where(sites: Sequence[Site]) -> str:
    places = sorted({s.where for s in sites})
    return ", ".join(places[:4]) + (f" and {len(places) - 4} more" if len(places) > 4 else "")


def _axes(site: Site) -> str:
    return ", ".join(f"'{a}'" for a in site.axes)


def _statistics(survey: Survey) -> list[Experiment]:
    stats = _sites(survey, "mean", "var", "std")
    return [Experiment(change=Change(what="pmean_statistics", axis=axis),
                       tried=f"statistics over dim 0 pmean-ed over '{axis}'",
                       cause=f"batch statistics are per device: pmean them over '{axis}' (the statistics over dim 0 "
                             f"at {_where(stats)}: each device normalises by its own rows' mean/variance)")
            for axis in survey.env if stats]


def _keys(survey: Survey) -> list[Experiment]:
    if not _sites(survey, "key"):
        return []
    return [Experiment(change=Change(what="fold_keys", axis=axis), tried=f"keys folded with axis_index('{axis}')",
                       cause=f"every shard draws the same random numbers from one key: fold each shard's key with its "
                             f"index, jax.random.fold_in(key, jax.lax.axis_index('{axis}'))")
            for axis in survey.env]


def _flips(survey: Survey) -> list[Experiment]:
    out = []
    for site in _sites(survey, "psum", "pmean"):
        if site.kind == "psum":
            out.append(Experiment(change=Change(what="as_pmean", site=site), tried=f"the psum at {site.where} as pmean",
                                  cause=f"the psum over {_axes(site)} at {site.where} should be a pmean: a sum where "
                                        f"the mean was meant (or, where the sum of gradients is meant, the loss is "
                                        f"normalised by the local batch instead of the global one)"))
        else:
            out.append(Experiment(change=Change(what="as_psum", site=site), tried=f"the pmean at {site.where} as psum",
                                  cause=f"the pmean over {_axes(site)} at {site.where} should be a psum: the values "
                                        f"are averaged twice (already normalised by the global batch, or already "
                                        f"averaged by JAX under check_vma)"))
    return out


def _gather_dims(survey: Survey) -> list[Experiment]:
    out = []
    for site in _sites(survey, "all_gather"):
        if site.ndim is None or site.dim is None:
            continue
        for dim in range(site.ndim):  # the output's dims (one more than the input's unless tiled)
            if dim != site.dim % site.ndim:
                out.append(Experiment(
                    change=Change(what="gather_dim", site=site, dim=dim),
                    tried=f"the all_gather at {site.where} along dim {dim}",
                    cause=f"the all_gather over {_axes(site)} at {site.where} gathers along dim {site.dim} where dim "
                          f"{dim} was meant (its `axis` argument)"))
    return out


def _swaps(survey: Survey) -> list[Experiment]:
    out = []
    for site in _sites(survey, *COLLECTIVES):
        if len(site.axes) != 1:
            continue
        for axis in survey.env:
            if axis not in site.axes:
                out.append(Experiment(change=Change(what="swap_axis", site=site, axis=axis),
                                      tried=f"the {site.kind} at {site.where} over '{axis}'",
                                      cause=f"the {site.kind} at {site.where} runs over {_axes(site)} where '{axis}' "
                                            f"was meant (a wrong axis name)"))
    return out


def _loss_scales(survey: Survey) -> list[Experiment]:
    grads = [s for s in survey.sites if s.kind == "grad"]
    if not grads:
        return []
    where = _where(grads)
    factors: dict[float, str] = {}
    for axis, n in survey.env.items():
        if n >= 2:
            factors.setdefault(1 / n, f"the loss is {n} times too large for its gradients: normalised by the local "
                                      f"batch where the global batch was meant (divide by the local rows x {n} shards "
                                      f"of '{axis}'), summed over '{axis}' where averaged, or, under shard_map with "
                                      f"check_vma=True (where JAX already sums the gradients of parameters replicated "
                                      f"over '{axis}'), not averaged over '{axis}' before a second reduction "
                                      f"(lax.pmean(loss, '{axis}') and no reduction of the gradients; the loss at "
                                      f"{where})")
            factors.setdefault(float(n), f"the loss is {n} times too small: averaged twice over '{axis}' (normalised "
                                         f"by the global batch and pmean-ed too; the loss at {where})")
    calls = len(grads)
    if calls >= 2:
        factors.setdefault(float(calls), f"the gradients of the {calls} accumulated microbatches are averaged twice "
                                         f"(each loss divided by {calls} and their sum divided by {calls} again; the "
                                         f"loss at {where})")
        factors.setdefault(1 / calls, f"the gradients of the {calls} accumulated microbatches are summed where "
                                      f"averaged (divide their sum by {calls}; the loss at {where})")
    return [Experiment(change=Change(what="scale_loss", factor=f), tried=f"the loss scaled by {_factor(f)}", cause=c)
            for f, c in factors.items()]


def _factor(f: float) -> str:
    return f"{f:g}" if f >= 1 else f"1/{round(1 / f)}"


def experiments(survey: Survey) -> list[Experiment]:
    """The changes worth trying given what a survey run saw, most specific first (module doc)."""
    return (_statistics(survey) + _keys(survey) + _flips(survey) + _gather_dims(survey) + _swaps(survey)
            + _loss_scales(survey))


def diagnose(run_parallel: Callable[..., Any], args: Sequence[Any], matches: Callable[[Any], bool],
             budget: int = DEFAULT_BUDGET) -> str | None:
    """Run the survey and up to ``budget`` experiments; the diagnosis as text (None: nothing to try).

    ``run_parallel(*args)`` calls the user's parallel function; ``matches(output)`` says whether an output
    equals the reference within the comparison's tolerances.
    """
    if budget <= 0:
        return None
    try:
        with interposed(None) as survey:
            run_parallel(*args)
    except InterposeError as err:
        return f"diagnosis not run: {err}"
    except Exception as err:  # noqa: BLE001 -- the patched trace failed: say so rather than hide the comparison
        return f"diagnosis not run: the survey re-run raised {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    todo = experiments(survey)
    if not survey.env:  # no shard_map or pmap was traced: nothing parallel to change
        return None
    if not todo:
        return ("diagnosis: the re-run saw no collective, statistic over dim 0, shared key or differentiated loss "
                "inside a mapped region to change (names bound by `from jax.lax import ...` are not seen)")
    tried = []
    for experiment in todo[:budget]:
        try:
            with interposed(experiment.change):
                ok = matches(run_parallel(*args))
            tried.append(experiment.tried)
        except Exception as err:  # noqa: BLE001 -- a change JAX rejects (a check_vma type error) is no match
            ok = False
            tried.append(f"{experiment.tried} (raised {type(err).__name__})")
        if ok:
            return (f"diagnosis (re-ran the parallel function with one change at a time; {len(tried)} re-run(s)): it "
                    f"matches the reference with {experiment.tried} -- {experiment.cause}")
    left = len(todo) - len(tried)
    more = f"; {left} more not run (budget diagnose={budget})" if left else ""
    return (f"diagnosis: no single change made it match; tried {len(tried)}: " + "; ".join(tried) + more)
