"""`speedrun compare` and `speedrun ablate`: many runs side by side, and what each trick is worth."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from rich.console import Console

from speedrun.commands import absolute_data, print_table, recipe_for
from speedrun.errors import SpeedrunError


def register(sub: argparse._SubParsersAction) -> None:
    """Add `compare` and `ablate` to the top-level parser."""
    p = sub.add_parser(
        "compare", help="compare runs: a table of what differs and how they did, and one accuracy plot",
        description="One table of the runs (recipe fields that differ, device, time to target, best and final "
        "top-1, images/s), sorted by time to target, and a PNG overlaying their accuracy against wall time. "
        "Each argument is a run directory, a directory holding runs (an ablation), or a job's name (its runs "
        "are read from its hosts). Runs still going are shown as they are.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR|JOB")
    p.add_argument("--plot", type=Path, default=Path("compare.png"), metavar="FILE",
                   help="where the accuracy plot goes (default: compare.png)")
    p.set_defaults(func=cmd_compare)

    from speedrun.ablate import TRICKS

    p = sub.add_parser(
        "ablate", help="run a recipe with each trick turned off in turn, and report what each is worth",
        description="Runs RECIPE and, for each trick it uses, RECIPE with that trick off, --seeds times each, then "
        "reports each trick's time to target relative to the full recipe (mean and range over seeds), the compare "
        "table and plot. The same command again continues an interrupted ablation. What 'off' means: "
        + "; ".join(f"{t.name}: {t.off}" for t in TRICKS.values()) + ".",
    )
    p.add_argument("recipe", metavar="RECIPE", help="built-in recipe name or a .py file defining `recipe`")
    p.add_argument("--data", default=None, metavar="PATH", help="dataset location, as for train")
    p.add_argument("--only", default=None, metavar="TRICK,...", help=f"these tricks only ({', '.join(TRICKS)})")
    p.add_argument("--seeds", type=int, default=1, metavar="N", help="runs per variant, seeds 0..N-1 (default 1)")
    p.add_argument("--target", default=None, metavar="METRIC=VALUE", help="the target, as for train")
    p.add_argument("--epochs", type=int, default=None, metavar="N", help="cut or stretch the recipe, as for train")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="the ablation's directory (default: runs/ablate-<recipe>; on a job, under its run directory)")
    p.add_argument("--job", default=None, metavar="NAME", help="run on this job's hosts, in parallel")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="passed to every run")
    p.add_argument("--workers", type=int, default=None, metavar="N", help="passed to every run")
    p.set_defaults(func=cmd_ablate)


def cmd_compare(args: argparse.Namespace) -> int:
    from speedrun.compare import collect_job, compare, find_runs, read_run

    console = Console(stderr=False)
    warn = lambda line: console.print(f"[yellow]{line}[/yellow]")  # noqa: E731
    runs = []
    for arg in args.runs:
        path = Path(arg)
        if path.is_dir():
            found = [path] if (path / "results.json").is_file() else find_runs(path)
            if not found:
                raise SpeedrunError(f"{path} holds no run (no results.json at or under it)")
            runs += [read_run(p) for p in found]
        elif path.exists():
            raise SpeedrunError(f"{path} is a file: give run directories or job names")
        else:
            from speedrun.cluster import registry

            if not registry.exists(arg):
                raise SpeedrunError(f"{arg} is neither a directory nor a job this machine knows (see `speedrun ls`; jobs are recorded in $SPEEDRUN_HOME, else ~/.config/speedrun)")
            job_runs = collect_job(arg, warn=warn)
            if not job_runs:
                raise SpeedrunError(f"job {arg} has no runs yet")
            runs += job_runs
    result = compare(runs, args.plot)
    print_table(console, result.rows())
    console.print(f"{len(runs)} runs; plot: {result.plot}", soft_wrap=True)
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    from speedrun import ablate
    from speedrun.compare import compare, fetch_run_files
    from speedrun.recipe import Target

    if args.seeds < 1:
        raise SpeedrunError(f"--seeds must be at least 1, got {args.seeds}")
    recipe = recipe_for(args.recipe, args.data)
    if args.epochs is not None:
        recipe = recipe.with_epochs(args.epochs)
    if args.target is not None:
        recipe = dataclasses.replace(recipe, target=None if args.target.lower() == "none" else Target.parse(args.target))
    recipe.validate()
    only = [t.strip() for t in args.only.split(",") if t.strip()] if args.only else None
    tricks = tuple(name for name in ablate.variants(recipe, only) if name != ablate.FULL)
    data = absolute_data(args.data)
    train_args = [*(["--device", args.device] if args.device else []), *(["--workers", str(args.workers)] if args.workers else [])]
    plan = ablate.Plan(recipe, tricks, args.seeds, data, tuple(train_args))

    console = Console()
    console.print(f"ablation of {recipe.name}: {len(tricks)} tricks x {args.seeds} seed(s) + the full recipe "
                  f"= {len(plan.runs())} runs", soft_wrap=True)
    print_table(console, [{"trick": t, "off means": ablate.TRICKS[t].off} for t in tricks])
    say = lambda line: console.print(line, soft_wrap=True)  # noqa: E731
    if args.job:
        from speedrun.cluster.lifecycle import open_job
        from speedrun.cluster.registry import speedrun_home

        job = open_job(args.job)
        remote = str(args.out or ablate.default_out(recipe).name)
        out = speedrun_home() / "ablate" / args.job / Path(remote).name
        ablate.prepare(out, plan)  # the local copy, where the results come back
        ablate.run_on_job(job, remote, plan, say)
        fetch_run_files(job, f"{job.run_dir}/{remote}", out, per_task=False, warn=say)
        live = False
    else:
        out = args.out or ablate.default_out(recipe)
        ablate.prepare(out, plan)
        ablate.run_local(out, plan, say)
        live = True

    runs = ablate.read_runs(out, plan, live)
    results = ablate.summarise(plan, runs)
    rows = ablate.table(results)
    print_table(console, rows, title=f"time to {recipe.target or 'the end'}, {args.seeds} seed(s)")
    (out / "ablation.json").write_text(json.dumps({"plan": plan.to_dict(), "rows": rows,
                                                   "results": [dataclasses.asdict(r) for r in results]}, indent=2) + "\n")
    comparison = compare(list(runs.values()), out / "compare.png")
    print_table(console, comparison.rows())
    console.print(f"written: {out / 'ablation.json'}, plot {comparison.plot}", soft_wrap=True)
    return 0
