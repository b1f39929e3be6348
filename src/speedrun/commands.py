"""`speedrun train` and `speedrun recipes`."""
from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from speedrun.recipe import RecipeError, load_recipe


def register(sub: argparse._SubParsersAction) -> None:
    """Add the trainer's commands to the top-level parser."""
    p = sub.add_parser("recipes", help="list the built-in recipes, or print one as a table")
    p.add_argument("name", nargs="?", help="a built-in recipe name or a recipe .py file")
    p.set_defaults(func=cmd_recipes)


def cmd_recipes(args: argparse.Namespace) -> int:
    from speedrun.recipes import BUILTIN, DEFAULT

    console = Console()
    if args.name is None:
        table = Table("name", "model", "dataset", "devices", "epochs", "target", box=None)
        for r in BUILTIN.values():
            name = f"{r.name} (default)" if r.name == DEFAULT else r.name
            table.add_row(name, r.model, r.dataset, str(r.world_size), str(r.epochs), str(r.target or "-"))
        console.print(table)
        return 0
    recipe = load_recipe(args.name)
    opt = recipe.optimizer
    console.print(
        f"[bold]{recipe.name}[/bold]: {recipe.description}\n"
        f"model {recipe.model}, dataset {recipe.dataset}, written for {recipe.world_size} device(s), "
        f"target {recipe.target or 'none'}\n"
        f"optimizer {opt.name} momentum {opt.momentum} nesterov {opt.nesterov} weight decay {opt.weight_decay} "
        f"(none on {opt.no_decay.replace('_', ' + ')}), label smoothing {opt.label_smoothing}"
    )
    rows = recipe.table()
    table = Table(*rows[0].keys())
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    console.print(table)
    return 0


__all__ = ["register", "RecipeError"]
