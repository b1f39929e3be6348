"""`speedrun lr-find` and `speedrun tune`: recipes that fit themselves to the user's data and machines."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from pathlib import Path

from speedrun.config import absolute_data
from speedrun.console import output_console, print_table
from speedrun.errors import SpeedrunError, stop_on_sigterm
from speedrun.files import to_json
from speedrun.inputs import SEED, USD_PER_HOUR, WORKERS, Bound, given, given_path, parse_env
from speedrun.recipe import EPOCHS

STEPS = Bound(int, 2, 100_000)
LR = Bound(float, 1e-12, 1e6)
TRIALS = Bound(int, 1, 100_000)
PARALLEL = Bound(int, 1, 1024)
# What a search's directory may hold besides nothing: a directory holding anything else is not one.
SEARCH_FILES = {"study.db", "lr_find.json", "lr_find.png", "trials", "recipes", "logs", "best_recipe.py", "tune.png",
                "tune.json"}


def register(sub: argparse._SubParsersAction) -> None:
    """Add `lr-find` and `tune` to the top-level parser."""
    p = sub.add_parser(
        "lr-find", help="the LR range test: the loss against an exponentially growing LR, and a suggested peak LR",
        description="Trains a fresh model on the recipe's first phase (its image size, batch size and data) for "
        "--steps steps while the LR grows exponentially from --start to --end, stops once the smoothed loss "
        "passes 4x its minimum, and suggests a peak LR: a tenth of the LR at the smoothed loss's minimum "
        "(fastai's lr_min). Writes lr_find.json and lr_find.png in --out; no run is started or changed.",
    )
    p.add_argument("--recipe", type=given, default=None, metavar="NAME|FILE", help="as for train (default: the demo)")
    p.add_argument("--data", type=given, default=None, metavar="PATH", help="dataset location, as for train")
    p.add_argument("--start", type=LR, default=1e-6, metavar="LR", help="the first step's LR (default 1e-6)")
    p.add_argument("--end", type=LR, default=10.0, metavar="LR", help="the last step's LR (default 10)")
    p.add_argument("--steps", type=STEPS, default=100, metavar="N", help="steps of the ramp (default 100)")
    p.add_argument("--out", type=given_path, default=None, metavar="DIR",
                   help="where lr_find.json and lr_find.png go (default: runs/lr-find-<recipe>-<date>-<time>)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available, else cpu")
    p.add_argument("--seed", type=SEED, default=0, help="random seed (default 0)")
    p.add_argument("--workers", type=WORKERS, default=None, metavar="N", help="decode processes, as for train")
    p.add_argument("--json", action="store_true", help="print the finding as JSON, for scripts")
    p.set_defaults(func=cmd_lr_find)

    p = sub.add_parser(
        "tune", help="search for the recipe that reaches the target in the least time (or $) on your data and machine",
        description="Optuna's TPE sampler (seeded) proposes recipes from a search space (the LR around lr-find's "
        "suggestion, weight decay, batch size, schedule length, label smoothing, first image size, EMA; or "
        "--space FILE.py); each trial is an ordinary run in OUT/trials/NNN, --parallel at a time. Its value is its "
        "time (or $) to the target. A trial behind the others at a rung of wall time (--first-rung x --eta^k "
        "seconds) is stopped at a step (asynchronous successive halving); one that fails is recorded with its "
        "reason. The same command again continues an interrupted search. Writes the trials' table, "
        "best_recipe.py and tune.png in OUT (docs/tuning.md).",
    )
    p.add_argument("recipe", type=given, metavar="RECIPE", help="built-in recipe name or a .py file defining `recipe`")
    p.add_argument("--data", type=given, default=None, metavar="PATH", help="dataset location, as for train")
    p.add_argument("--target", default=None, metavar="METRIC=VALUE",
                   help="what each trial must reach (default: the recipe's target)")
    p.add_argument("--epochs", type=EPOCHS, default=None, metavar="N", help="cut or stretch the recipe first")
    p.add_argument("--trials", type=TRIALS, required=True, metavar="N", help="trials in all, continued ones counted")
    p.add_argument("--parallel", type=PARALLEL, default=None, metavar="K",
                   help="trials at a time (default 1; with --job, one per task): on this machine each gets its "
                   "share of the cores, or its own GPU")
    p.add_argument("--job", type=given, default=None, metavar="NAME",
                   help="run the trials on this job's tasks, one per task at a time (any provider's job; on Slurm "
                   "each trial is a one-node Slurm job of its own); the study stays on this machine")
    p.add_argument("--objective", choices=("time", "cost"), default="time",
                   help="minimise the time to target (default) or the $ to target (needs --price-per-hour)")
    p.add_argument("--budget", default=None, metavar="DURATION|$USD",
                   help="stop the search after this much wall time (2h, 90m, 600s) or $ (with a price); "
                   "running trials stop at a step")
    p.add_argument("--price-per-hour", type=USD_PER_HOUR, default=None, metavar="USD",
                   help="what this machine costs, $ per hour: trials record their $ to target")
    p.add_argument("--space", type=given_path, default=None, metavar="FILE.py",
                   help="a file defining `space`, a dict of field -> Range or Choice, instead of the default")
    p.add_argument("--no-lr-find", dest="lr_find", action="store_false",
                   help="centre the default LR range on the recipe's own LR, without running lr-find first")
    p.add_argument("--first-rung", type=Bound(float, 1, 86_400), default=60.0, metavar="SECONDS",
                   help="a trial's wall time at the first rung, where it is first compared (default 60)")
    p.add_argument("--eta", type=Bound(int, 2, 100), default=3, metavar="N",
                   help="rungs lie at first-rung x eta^k s; a trial goes on if in the best 1/eta there (default 3)")
    p.add_argument("--seed", type=SEED, default=0,
                   help="the sampler's seed and every trial's (default 0)")
    p.add_argument("--out", type=given_path, default=None, metavar="DIR",
                   help="the search's directory (default: runs/tune-<recipe>)")
    p.add_argument("--storage", default=None, metavar="URL",
                   help="the Optuna study's database (default: sqlite in --out; e.g. postgresql://user@host/db)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="passed to every trial")
    p.add_argument("--workers", type=WORKERS, default=None, metavar="N", help="passed to every trial")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="set a variable for every trial, here or on the job's machines (repeatable; as launch's)")
    p.add_argument("--json", action="store_true", help="print the trials as JSON, for scripts")
    p.set_defaults(func=cmd_tune)


def cmd_lr_find(args: argparse.Namespace) -> int:
    from speedrun.recipes import DEFAULT
    from speedrun.recipes.fitting import recipe_for
    from speedrun.rundir import default_run_dir
    from speedrun.tune.lr_find import lr_find, lr_ramp, write_finding

    lr_ramp(args.start, args.end, args.steps)  # a range that does not grow: one line before anything loads
    recipe = recipe_for(args.recipe or DEFAULT, args.data, args.workers)
    out: Path = args.out or default_run_dir(f"lr-find-{recipe.name}")
    console = output_console(stderr=args.json)
    say = lambda line: console.print(line, soft_wrap=True, markup=False)  # noqa: E731
    phase = recipe.phases[0]
    say(f"LR range test: {recipe.name}, first phase ({phase.size} px, batch {phase.batch_size}), "
        f"LR {args.start:g} -> {args.end:g} over {args.steps} steps")
    finding = lr_find(recipe, absolute_data(args.data), start=args.start, end=args.end, steps=args.steps,
                      device=args.device, seed=args.seed, workers=args.workers, say=say)
    json_path, png_path = write_finding(finding, out)
    stopped = (f"diverged at LR {finding.diverged_lr:.3g} after {len(finding.losses)} steps"
               if finding.diverged_lr is not None else f"no divergence in {len(finding.losses)} steps")
    say(f"{stopped}; lowest smoothed loss at LR {finding.min_loss_lr:.3g}, steepest fall at {finding.steepest_lr:.3g}")
    say(f"suggested peak LR: {finding.suggested_lr:.3g} on one device with batch {finding.batch_size} "
        f"({finding.rule})")
    if finding.world_size != 1:
        say(f"in the recipe's terms (its LRs are for {finding.world_size} devices): {finding.recipe_lr:.3g}")
    say(f"written: {json_path}, {png_path}")
    if args.json:
        print(to_json(finding.to_dict(), indent=1))
    return 0


def parse_budget(text: str | None) -> tuple[float | None, float | None]:
    """--budget as (seconds, None) for a duration (2h, 90m, 600s, 600) or (None, $) for "$30"."""
    if text is None:
        return None, None
    m = re.fullmatch(r"\s*(\$)?\s*([0-9]*\.?[0-9]+)\s*([hms]?)\s*", text)
    if not m or (m.group(1) and m.group(3)) or float(m.group(2)) <= 0:
        raise SpeedrunError(f"--budget {text!r}: give a duration (2h, 90m, 600s) or dollars ($30)")
    value = float(m.group(2))
    if m.group(1):
        return None, value
    return value * {"h": 3600, "m": 60, "s": 1, "": 1}[m.group(3)], None


def check_parallel(parallel: int, device: str | None) -> None:
    """--parallel within what this machine has: a core per trial, or a GPU per trial on CUDA."""
    cores = os.cpu_count() or 1
    if device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if parallel > gpus:
            raise SpeedrunError(f"--parallel {parallel}: this machine has {gpus} GPU(s), one per trial")
    elif parallel > cores:
        raise SpeedrunError(f"--parallel {parallel}: this machine has {cores} core(s); give at most {cores}")


def check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise SpeedrunError(f"--out {out} is a file, not a directory; choose another --out")
    others = sorted(p.name for p in out.iterdir() if p.name not in SEARCH_FILES) if out.is_dir() else []
    if others:
        raise SpeedrunError(f"--out {out} holds other things than a search ({', '.join(others[:3])}): "
                            "choose a new or empty directory")


def cmd_tune(args: argparse.Namespace) -> int:
    from speedrun.money import PRICE_ENV, Price, price_from_env
    from speedrun.recipe import Target
    from speedrun.recipes.fitting import recipe_for
    from speedrun.tune import report
    from speedrun.tune.space import apply, check_space, corners, default_space, describe, load_space
    from speedrun.tune.study import Controller, Search, open_study, shown, storage_url
    from speedrun.tune.trials import JobTrials, LocalTrials, trial_env

    user_env = parse_env(args.env, "--env")
    recipe = recipe_for(args.recipe, args.data, args.workers)
    if args.epochs is not None:
        recipe = recipe.with_epochs(args.epochs)
    if args.target is not None:
        recipe = dataclasses.replace(recipe, target=Target.parse(args.target))
    if recipe.target is None:
        raise SpeedrunError(f"recipe {recipe.name} has no target, and a search needs one: give --target top1=0.9")
    recipe.validate()
    job = open_trial_job(args.job) if args.job else None
    parallel = args.parallel or (len(job.tasks) if job else 1)
    if job and parallel > len(job.tasks):
        raise SpeedrunError(f"--parallel {parallel}: job {job.name} has {len(job.tasks)} task(s), one trial per task")
    if not job:
        check_parallel(parallel, args.device)
    price = job.price() if job else price_from_env()
    if args.price_per_hour is not None:
        price = Price(f"job {job.name}'s machine" if job else "this machine", "given", 1, args.price_per_hour,
                      "--price-per-hour")
    if price is not None:
        price = dataclasses.replace(price, machines=1)  # a trial holds one machine (one of the job's tasks)
    budget_s, budget_usd = parse_budget(args.budget)
    if (args.objective == "cost" or budget_usd is not None) and price is None:
        raise SpeedrunError("--objective cost and a $ budget need the machine's price: give --price-per-hour")
    if budget_usd is not None:
        budget_s = budget_usd / price.cost(3600) * 3600
    if budget_s is not None and budget_s < args.first_rung:
        raise SpeedrunError(f"--budget {args.budget} cannot hold one trial: the first rung, where a trial is first "
                            f"judged, is at {args.first_rung:g} s (--first-rung)")
    space = load_space(args.space) if args.space else None
    if job:  # the trials under the job's run directory; the study and the report here
        from speedrun.cluster.registry import speedrun_home

        remote = str(args.out or f"tune-{recipe.name}")
        out = speedrun_home() / "tune" / job.name / Path(remote).name
    else:
        out = args.out or Path("runs") / f"tune-{recipe.name}"
    check_out(out)

    console = output_console(stderr=args.json)
    say = lambda line: console.print(line, soft_wrap=True, markup=False)  # noqa: E731
    if space is None:
        space = default_space(recipe, suggested_lr(recipe, args, out, say) if args.lr_find else None)
    check_space(space)
    for corner in corners(space):
        try:
            apply(recipe, corner, recipe.name)
        except SpeedrunError as e:
            raise SpeedrunError(f"the search space reaches a recipe that cannot run: {e}") from None
    train_args = [*(["--device", args.device] if args.device else []),
                  *(["--workers", str(args.workers)] if args.workers else [])]
    search = Search(recipe, space, args.trials, parallel, args.objective, budget_s, args.seed,
                    absolute_data(args.data), tuple(train_args), args.first_rung, args.eta, price)
    url = storage_url(out, args.storage)
    out.mkdir(parents=True, exist_ok=True)
    study = open_study(url, search)
    where = f"on job {job.name}'s tasks" if job else "on this machine"
    say(f"tune {recipe.name} to {recipe.target}: {args.trials} trials, {parallel} at a time {where}, objective "
        f"{args.objective}; study in {shown(url)}")
    print_table(console, [{"field": k, "searched over": v} for k, v in describe(space).items()])
    restore_sigterm = stop_on_sigterm()  # `kill` stops the search as Ctrl-C does, trials at a step
    extra = {**user_env, **({PRICE_ENV: price.to_env()} if price else {})}
    if job:
        trials, env = JobTrials(job, remote, parallel, out), extra
    else:
        trials, env = LocalTrials(out, parallel), trial_env(parallel, extra)
    try:
        Controller(out, search, study, say, trials, env).run()
    finally:
        restore_sigterm()
        trials.bring_back(say)

    found = report.records(study)
    print_table(console, report.rows(found, args.objective), title=f"trials, by {args.objective} to {recipe.target}")
    best = next((r for r in found if r.value is not None), None)
    written = [report.plot(out, found, args.objective, recipe.target.metric, recipe.target.value)]
    if best is not None:
        written.insert(0, report.write_best_recipe(out, search, best, len(found)))
    else:
        say(f"no trial reached {recipe.target}: no best recipe")
    summary = {"objective": args.objective, "target": str(recipe.target), "storage": shown(url),
               "best": best.to_dict() if best else None, "trials": [r.to_dict() for r in found]}
    (out / "tune.json").write_text(to_json(summary, indent=1) + "\n")
    say("written: " + ", ".join(str(p) for p in [*written, out / "tune.json"]))
    if args.json:
        print(to_json(summary, indent=1))
    return 0


def suggested_lr(recipe, args: argparse.Namespace, out: Path, say) -> float:
    """lr-find's suggestion in the recipe's terms: from OUT/lr_find.json (a continued search keeps
    the space it began with), else measured now and written there."""
    from speedrun.tune.lr_find import lr_find, write_finding

    saved = out / "lr_find.json"
    if saved.is_file():
        return float(json.loads(saved.read_text())["recipe_lr"])
    say(f"lr-find first, to centre the LR range: {recipe.name}'s first phase, 100 steps")
    finding = lr_find(recipe, absolute_data(args.data), device=args.device, seed=args.seed, workers=args.workers)
    write_finding(finding, out)
    say(f"lr-find suggests {finding.recipe_lr:.3g} in the recipe's terms ({finding.rule})")
    return finding.recipe_lr


def open_trial_job(name: str):
    """The job NAME, which must be able to start one command on one task (a trial)."""
    from speedrun.cluster.reopen import open_job

    job = open_job(name)
    if not job.single_commands:
        raise SpeedrunError(f"--job {name}: a {job.provider.kind} job cannot run one trial per task; tune runs "
                            "trials on jobs of tmux tasks (local, ssh, aws) and on Slurm jobs")
    return job
