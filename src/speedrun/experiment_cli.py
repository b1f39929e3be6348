"""`speedrun compare` and `speedrun ablate`: many runs side by side, and what each trick is worth."""
from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
from pathlib import Path

from speedrun.config import absolute_data
from speedrun.console import output_console, print_table
from speedrun.errors import SpeedrunError
from speedrun.files import to_json
from speedrun.inputs import WORKERS, Bound, given, given_path
from speedrun.recipe import EPOCHS
from speedrun.recipes.fitting import recipe_for
from speedrun.trackers import METAVAR as TRACK_METAVAR
from speedrun.trackers import parse_tracks


def register(sub: argparse._SubParsersAction) -> None:
    """Add `compare` and `ablate` to the top-level parser."""
    p = sub.add_parser(
        "compare", help="compare runs: a table of what differs and how they did, and one accuracy plot",
        description="One table of the runs (recipe fields that differ, device, time to target, best and final "
        "top-1, images/s, and $ to target and total $ where runs know their machines' price), sorted by time "
        "(or $) to target, and a PNG overlaying their accuracy against wall time (or $ spent). "
        "Each argument is a run directory, a directory holding runs (an ablation), a job's name (its runs "
        "are read from its hosts), or mlflow://EXPERIMENT (the runs logged there with --track mlflow, at "
        "$MLFLOW_TRACKING_URI). Runs still going are shown as they are.",
    )
    p.add_argument("runs", type=given, nargs="+", metavar="RUN_DIR|JOB|mlflow://EXPERIMENT")
    p.add_argument("--plot", type=given_path, default=Path("compare.png"), metavar="FILE",
                   help="where the accuracy plot goes (default: compare.png; one that cannot be written is skipped, "
                   "the table is printed all the same)")
    p.add_argument("--by", choices=("time", "cost"), default="time",
                   help="sort by time to target (default) or by $ to target, and plot accuracy against wall time or "
                   "against $ spent (runs whose machines' price is known: results.json's price)")
    as_data = p.add_mutually_exclusive_group()
    as_data.add_argument("--json", action="store_true", help="print the table as a JSON list of rows, for scripts")
    as_data.add_argument("--csv", action="store_true", help="print the table as CSV with a header line, for scripts")
    p.set_defaults(func=cmd_compare)

    from speedrun.ablate import TRICKS

    p = sub.add_parser(
        "ablate", help="run a recipe with each trick turned off in turn, and report what each is worth",
        description="Runs RECIPE and, for each trick it uses, RECIPE with that trick off, --seeds times each, then "
        "reports each trick's time to target relative to the full recipe (mean and range over seeds), the compare "
        "table and plot. The same command again continues an interrupted ablation. What 'off' means: "
        + "; ".join(f"{t.name}: {t.off}" for t in TRICKS.values()) + ".",
    )
    p.add_argument("recipe", type=given, metavar="RECIPE", help="built-in recipe name or a .py file defining `recipe`")
    p.add_argument("--data", type=given, default=None, metavar="PATH", help="dataset location, as for train")
    p.add_argument("--only", default=None, metavar="TRICK,...", help=f"these tricks only ({', '.join(TRICKS)})")
    p.add_argument("--seeds", type=Bound(int, 1, 1000), default=1, metavar="N",
                   help="runs per variant, seeds 0..N-1 (default 1)")
    p.add_argument("--target", default=None, metavar="METRIC=VALUE", help="the target, as for train")
    p.add_argument("--epochs", type=EPOCHS, default=None, metavar="N", help="cut or stretch the recipe, as for train")
    p.add_argument("--out", type=given_path, default=None, metavar="DIR",
                   help="the ablation's directory (default: runs/ablate-<recipe>; on a job, under its run directory)")
    p.add_argument("--job", type=given, default=None, metavar="NAME", help="run on this job's hosts, in parallel")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="passed to every run")
    p.add_argument("--workers", type=WORKERS, default=None, metavar="N", help="passed to every run")
    p.add_argument("--track", action="append", default=None, metavar=TRACK_METAVAR,
                   help="every run logs to this tracker, as train --track, grouped under the ablation's name "
                   "(MLflow: children of one parent run; W&B: one group); repeatable")
    p.set_defaults(func=cmd_ablate)


def cmd_compare(args: argparse.Namespace) -> int:
    from speedrun.compare import compare

    notes = output_console(stderr=True)
    note = lambda line: notes.print(f"speedrun: {line}", style="yellow", soft_wrap=True, markup=False)  # noqa: E731
    runs, skipped = read_compare_args(args.runs, note)
    if not runs:
        raise SpeedrunError("nothing to compare: " + "; ".join(skipped))
    plot = args.plot / "compare.png" if args.plot.is_dir() else args.plot  # a folder: the plot goes in it
    result = compare(runs, plot, args.by)
    if args.json:
        print(to_json(result.records(), indent=1))
    elif args.csv:
        records = result.records()
        writer = csv.DictWriter(sys.stdout, fieldnames=list(records[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(records)
    else:
        console = output_console()
        print_table(console, result.rows())
        console.print(f"{len(runs)} runs" + (f"; plot: {result.plot}" if result.plot else ""),
                      soft_wrap=True, markup=False)
    if result.plot_error:
        note(result.plot_error)
    if skipped:
        note(f"left out {len(skipped)} of {len(skipped) + len(runs)}: " + "; ".join(skipped))
    return 0


def read_compare_args(args: list[str], note) -> tuple[list, list[str]]:
    """The runs that the arguments of `compare` name (run directories, directories holding runs,
    job names), and one line per argument or run that could not be read, saying why: one bad run
    does not hide the others."""
    from speedrun.compare import collect_job, find_runs, read_run

    runs, skipped = [], []
    for arg in args:
        path = Path(arg)
        try:
            if arg.startswith("mlflow://"):
                runs += read_mlflow_runs(arg.removeprefix("mlflow://"), skipped)
            elif path.is_dir():
                found = [path] if (path / "results.json").is_file() else find_runs(path)
                if not found:
                    raise SpeedrunError(f"{path} holds no run (no results.json at or under it)")
                for run in found:
                    try:
                        runs.append(read_run(run))
                    except SpeedrunError as e:
                        skipped.append(str(e))
            elif path.exists():
                raise SpeedrunError(f"{path} is a file: give run directories or job names")
            else:
                from speedrun.cluster import registry

                if not registry.exists(arg):
                    raise SpeedrunError(f"{arg} is neither a directory nor a job this machine knows "
                                        "(see `speedrun ls`; jobs are recorded in $SPEEDRUN_HOME, "
                                        "else ~/.config/speedrun)")
                job_runs = collect_job(arg, warn=note)
                if not job_runs:
                    raise SpeedrunError(f"job {arg} has no runs yet")
                runs += job_runs
        except SpeedrunError as e:
            skipped.append(str(e))
    return runs, skipped


def read_mlflow_runs(experiment: str, skipped: list[str]) -> list:
    """`compare mlflow://EXPERIMENT`: the experiment's runs, read as run directories from their
    results.json and metrics.jsonl artifacts; a line in `skipped` for each that cannot be."""
    import tempfile

    from speedrun.compare import read_run
    from speedrun.trackers.mlflow import download_runs

    runs = []
    with tempfile.TemporaryDirectory(prefix="speedrun-mlflow-") as into:
        found, left_out = download_runs(experiment, Path(into))
        skipped += left_out
        for name, folder in found:
            try:
                runs.append(read_run(folder, label=f"mlflow://{experiment}/{name}", live=False))
            except SpeedrunError as e:
                skipped.append(str(e))
    if not runs and not left_out:
        raise SpeedrunError(f"mlflow://{experiment} holds no speedrun run")
    return runs


def cmd_ablate(args: argparse.Namespace) -> int:
    from speedrun import ablate
    from speedrun.compare import compare, fetch_run_files
    from speedrun.recipe import Target

    recipe = recipe_for(args.recipe, args.data)
    if args.epochs is not None:
        recipe = recipe.with_epochs(args.epochs)
    if args.target is not None:
        recipe = dataclasses.replace(recipe,
                                     target=None if args.target.lower() == "none" else Target.parse(args.target))
    recipe.validate()
    only = None
    if args.only is not None:
        only = [t.strip() for t in args.only.split(",") if t.strip()]
        if not only:  # an empty list would mean "every trick", the opposite of what was asked
            raise SpeedrunError(f"--only {args.only!r} names no trick; give one or more of {', '.join(ablate.TRICKS)}")
    tricks = tuple(name for name in ablate.variants(recipe, only) if name != ablate.FULL)
    data = absolute_data(args.data)
    parse_tracks(args.track or ())  # a bad --track is bad input here, not in every run
    train_args = [*(["--device", args.device] if args.device else []),
                  *(["--workers", str(args.workers)] if args.workers else [])]
    plan = ablate.Plan(recipe, tricks, args.seeds, data, tuple(train_args))

    console = output_console()
    console.print(f"ablation of {recipe.name}: {len(tricks)} tricks x {args.seeds} seed(s) + the full recipe "
                  f"= {len(plan.runs())} runs", soft_wrap=True)
    print_table(console, [{"trick": t, "off means": ablate.TRICKS[t].off} for t in tricks])
    say = lambda line: console.print(line, soft_wrap=True)  # noqa: E731
    if args.job:
        from speedrun.cluster.reopen import open_job
        from speedrun.cluster.registry import speedrun_home

        job = open_job(args.job)
        remote = str(args.out or ablate.default_out(recipe).name)
        out = speedrun_home() / "ablate" / args.job / Path(remote).name
        ablate.prepare(out, plan)  # the local copy, where the results come back
        ablate.run_on_job(job, remote, plan, say, ablate.track_env(out, args.track or ()))
        fetch_run_files(job, f"{job.run_dir}/{remote}", out, per_task=False, warn=say)
        live = False
    else:
        out = args.out or ablate.default_out(recipe)
        ablate.prepare(out, plan)
        ablate.run_local(out, plan, say, ablate.track_env(out, args.track or ()))
        live = True

    runs = ablate.read_runs(out, plan, live)
    results = ablate.summarise(plan, runs)
    rows = ablate.table(results)
    print_table(console, rows, title=f"time to {recipe.target or 'the end'}, {args.seeds} seed(s)")
    (out / "ablation.json").write_text(to_json({"plan": plan.to_dict(), "rows": rows,
                                                "results": [dataclasses.asdict(r) for r in results]}, indent=2) + "\n")
    comparison = compare(list(runs.values()), out / "compare.png")
    print_table(console, comparison.rows())
    if comparison.plot_error:
        say(comparison.plot_error)
    console.print(f"written: {out / 'ablation.json'}, plot {comparison.plot}", soft_wrap=True)
    return 0
