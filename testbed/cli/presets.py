"""`testbed presets`: every model preset's full configuration, its default batch and its source.

A preset is a plan's ``model`` mapping (``model: {preset: llama3-405b}``);
this lists the whole resolved mapping (every key the model section takes,
defaults filled in), so a user sees exactly which sequence length, batch
and architecture a name stands for, and where each number comes from.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from testbed.output import CommandResult

__all__ = ["presets", "preset_rows"]


def preset_rows(names: list[str] | None = None) -> list[dict]:
    """One row per preset: name, the full model mapping, parameters, default global batch and source."""
    from testbed.explore.base_plan import preset_plan
    from testbed.plan import presets as p
    from testbed.model.costs import param_count
    from testbed.plan.io import plan_to_dict

    rows = []
    for name in names or p.preset_names():
        plan = preset_plan(name)
        rows.append({"name": name, "model": plan_to_dict(plan)["model"], "params": param_count(plan.model),
                     "global_batch": p.DEFAULT_BATCH[name],
                     "tokens_per_batch": p.DEFAULT_BATCH[name] * plan.model.seq_len, "source": p.SOURCES[name]})
    return rows


def _add(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", metavar="PRESET", help="presets to list (default: all)")


def _execute(args: argparse.Namespace) -> CommandResult:
    from testbed.errors import InputError, closest
    from testbed.plan.presets import preset_names

    for name in args.names:
        if name not in preset_names():
            hint = closest(name, preset_names())
            raise InputError(f"unknown preset `{name}`" + (f" (did you mean `{hint}`?)" if hint else "")
                             + f"; valid: {', '.join(preset_names())}", field="PRESET")
    rows = preset_rows(list(args.names))

    def render(console) -> None:
        if args.names:
            _render_details(console, rows)
        else:
            _render_summary(console, rows)

    return CommandResult({"presets": rows}, render)


def _count(n: int) -> str:
    """A parameter count in the unit that keeps it short: 405.9B, 162M, 107K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}" if n < 100 * scale else f"{n / scale:.0f}{unit}"
    return str(n)


def _render_summary(console, rows: list[dict]) -> None:
    """One line per preset (fits 80 columns); ``testbed presets NAME`` shows one in full."""
    from testbed.cli.tables import Col, compact, fitted_table

    columns = [Col(header="name", key=True, justify="left"), Col(header="params"), Col(header="layers"),
               Col(header="d_model"), Col(header="heads", drop=2), Col(header="seq"), Col(header="batch", drop=1),
               Col(header="experts", drop=3)]
    cells = []
    for r in rows:
        m = r["model"]
        experts = f"{m['experts']} top {m['top_k']}" if m.get("experts") else "-"
        cells.append([r["name"], _count(r["params"]), str(m["layers"]), str(m["d_model"]),
                      f"{m['heads']}/{m.get('kv_heads', m['heads'])}", str(m["seq_len"]), str(r["global_batch"]),
                      experts])
    console.print(fitted_table(console, columns, cells, title="model presets", **compact()))
    console.print("params: parameter count; heads: query/key-value heads; seq: tokens per sequence; batch: the "
                  "default global batch (sequences); `testbed presets NAME` shows the whole configuration and its "
                  "source; a plan uses one as `model: {preset: NAME}` (any key may be overridden beside it)")


def _render_details(console, rows: list[dict]) -> None:
    """Each named preset's whole model mapping, one key per line, then its batch and source."""
    for r in rows:
        console.print(f"[bold]{r['name']}[/bold]: {r['params']:,} parameters; default batch {r['global_batch']} "
                      f"sequences ({r['tokens_per_batch']:,} tokens)")
        for key, value in r["model"].items():
            console.print(f"  {key:<22} {value}", markup=False)
        console.print(f"  source: {r['source']}", markup=False)


presets = SimpleNamespace(add_arguments=_add, execute=_execute)
