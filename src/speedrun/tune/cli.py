"""`speedrun lr-find` (and `speedrun tune`): recipes that fit themselves to the user's data and machines."""
from __future__ import annotations

import argparse
from pathlib import Path

from speedrun.config import absolute_data
from speedrun.console import output_console
from speedrun.files import to_json
from speedrun.inputs import WORKERS, Bound, given, given_path

STEPS = Bound(int, 2, 100_000)
LR = Bound(float, 1e-12, 1e6)


def register(sub: argparse._SubParsersAction) -> None:
    """Add `lr-find` to the top-level parser."""
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
    p.add_argument("--seed", type=Bound(int, 0, 2**32 - 1), default=0, help="random seed (default 0)")
    p.add_argument("--workers", type=WORKERS, default=None, metavar="N", help="decode processes, as for train")
    p.add_argument("--json", action="store_true", help="print the finding as JSON, for scripts")
    p.set_defaults(func=cmd_lr_find)


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
