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
    from testbed.explore.space import preset_plan
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
        from rich.table import Table

        table = Table(title="model presets (model: {preset: NAME}; any key may be overridden beside it)")
        for column in ("name", "params", "seq", "batch", "configuration", "source"):
            table.add_column(column, overflow="fold")
        for r in rows:
            m = r["model"]
            config = ", ".join(f"{k} {v}" for k, v in m.items() if k not in ("kind", "seq_len"))
            table.add_row(r["name"], f"{r['params'] / 1e9:.2f}B", str(m["seq_len"]), str(r["global_batch"]), config,
                          r["source"])
        console.print(table)

    return CommandResult({"presets": rows}, render)


presets = SimpleNamespace(add_arguments=_add, execute=_execute)
