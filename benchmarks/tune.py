"""Does `speedrun tune` find a faster way to the target? The default recipe against the tuned one,
side by side in this one script, on two datasets:

    fmnist   Fashion-MNIST in memory, the `fashion-mnist` recipe and its target (92% top-1)
    folder   a generated image folder of another shape: Fashion-MNIST garments on 40 px colour
             squares, 12,000 train / 2,000 val JPEGs (`speedrun data synth fmnist-tree --side 40`),
             the `folder-small` recipe fitted to it, target --folder-target

For each: `speedrun tune` with the default search space (lr-find first), --parallel trials at a
time, stopped by --budget of wall time; then the default recipe and the search's best_recipe.py,
each retrained alone with --seeds seeds, alternating (default seed 0, tuned seed 0, default seed
1, ...), so that a drift of the machine's speed touches both alike. Reported: each retrain's time
to target (results.json's time_to_target_s, the search's objective), the mean ratio tuned /
default, and the search's own cost against a grid over the same space.

The grid is not run (it would take days here): its cost is estimated as its points (3 values per
range, every value of a choice) x the mean wall seconds of the search's trials that ran to their
end unpruned, at the same number of trials at a time. The search's cost is measured (its wall
time, lr-find included).

    python benchmarks/tune.py                       # both datasets, 30 minutes of search each
    python benchmarks/tune.py --datasets folder --budget 20m --seeds 2

Everything goes under --out (default /tmp/speedrun-bench-tune); the summary is printed and
written to benchmarks/results/tune-<datasets>-cpu.json.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from speedrun.recipes.fitting import recipe_for
from speedrun.recipe import Target
from speedrun.tune.space import Choice, default_space

REPO = Path(__file__).resolve().parents[1]
DATASETS = {
    "fmnist": {"recipe": "fashion-mnist", "data": None, "target": None},
    "folder": {"recipe": "folder-small", "data": "folder", "target": "folder"},
}


def speedrun(*args: str, log: Path) -> float:
    """Run `python -m speedrun ARGS`, its output to `log`; its wall seconds. Exits on failure."""
    start = time.monotonic()
    with open(log, "w") as f:
        code = subprocess.call([sys.executable, "-m", "speedrun", *args], stdout=f, stderr=subprocess.STDOUT)
    if code != 0:
        sys.exit(f"speedrun {' '.join(args)} failed with exit status {code}: see {log}")
    return time.monotonic() - start


def time_to_target(run: Path) -> float | None:
    """The run's time to its target, s (None: not reached)."""
    return json.loads((run / "results.json").read_text()).get("time_to_target_s")


def grid_points(recipe_name: str, data: str | None, out: Path) -> int:
    """Points of a grid over the search's default space: 3 values per range, every choice."""
    lr = json.loads((out / "lr_find.json").read_text())["recipe_lr"]
    space = default_space(recipe_for(recipe_name, data), lr)
    return math.prod(len(d.values) if isinstance(d, Choice) else 3 for d in space.values())


def full_trial_seconds(search: Path, summary: dict) -> list[float]:
    """Wall seconds of the trials that ran to their end or target unpruned (results.json's total_s)."""
    seconds = []
    for t in summary["trials"]:
        if t["state"] in ("complete", "not_reached") and t["dir"]:
            seconds.append(json.loads((search / t["dir"] / "results.json").read_text())["total_s"])
    return seconds


def bench(name: str, args: argparse.Namespace, out: Path) -> dict:
    spec = DATASETS[name]
    data = str(args.folder) if spec["data"] == "folder" else None
    target = args.folder_target if spec["target"] == "folder" else None
    common = [*(["--data", data] if data else []), "--device", "cpu"]
    recipe = recipe_for(spec["recipe"], data)
    target = target or f"{recipe.target.metric}={recipe.target.value}"
    search = out / f"tune-{name}"
    print(f"== {name}: tune {spec['recipe']} to {target}, {args.budget} of search, {args.parallel} at a time",
          flush=True)
    search_s = speedrun("tune", spec["recipe"], *common, "--target", target, "--trials", str(args.trials),
                        "--parallel", str(args.parallel), "--budget", args.budget, "--out", str(search), "--json",
                        log=out / f"tune-{name}.log")
    summary = json.loads((search / "tune.json").read_text())
    if summary["best"] is None:
        sys.exit(f"{name}: no trial reached {target}; see {search}")
    print(f"   best trial {summary['best']['number']}: {summary['best']['params']}", flush=True)
    runs = {"default": [], "tuned": []}
    for seed in range(args.seeds):
        for kind, recipe_arg in (("default", spec["recipe"]), ("tuned", str(search / "best_recipe.py"))):
            run = out / f"{name}-{kind}-seed{seed}"
            speedrun("train", "--recipe", recipe_arg, *common, "--target", target, "--seed", str(seed),
                     "--out", str(run), log=out / f"{run.name}.log")
            runs[kind].append(time_to_target(run))
            print(f"   {kind:<7} seed {seed}: time to {target} {runs[kind][-1]} s", flush=True)
    reached = [(d, t) for d, t in zip(runs["default"], runs["tuned"]) if d is not None and t is not None]
    full = full_trial_seconds(search, summary)
    points = grid_points(spec["recipe"], data, search)
    grid_s = points * statistics.mean(full) / args.parallel if full else None
    return {
        "dataset": name, "recipe": spec["recipe"], "target": target, "budget": args.budget,
        "parallel": args.parallel, "trials": len(summary["trials"]),
        "states": {s: sum(t["state"] == s for t in summary["trials"]) for s in {t["state"] for t in summary["trials"]}},
        "best": summary["best"], "time_to_target_s": runs,
        "ratio_tuned_default": statistics.mean(t / d for d, t in reached) if reached else None,
        "search_s": round(search_s, 1), "grid_points": points,
        "full_trial_s": [round(s, 1) for s in full], "grid_estimate_s": round(grid_s, 1) if grid_s else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", choices=list(DATASETS), default=list(DATASETS))
    parser.add_argument("--budget", default="30m", help="each search's wall time (default 30m)")
    parser.add_argument("--trials", type=int, default=200, help="at most this many trials (the budget ends it first)")
    parser.add_argument("--parallel", type=int, default=2, help="trials at a time (default 2: one core each)")
    parser.add_argument("--seeds", type=int, default=2, help="retrains of each recipe (default 2)")
    parser.add_argument("--folder-target", default="top1=0.88", help="the folder's target (default top1=0.88)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/speedrun-bench-tune"))
    args = parser.parse_args()
    Target.parse(args.folder_target)
    args.out.mkdir(parents=True, exist_ok=True)
    args.folder = args.out / "folder-40px"
    if "folder" in args.datasets and not (args.folder / "val").is_dir():
        speedrun("data", "synth", "fmnist-tree", str(args.folder), "--train", "12000", "--val", "2000", "--side", "40",
                 log=args.out / "synth.log")

    rows = [bench(name, args, args.out) for name in args.datasets]
    print("\ndataset  target      default (s)         tuned (s)           tuned/default  search   grid (est.)")
    for r in rows:
        fmt = lambda xs: ", ".join(f"{x:.0f}" if x is not None else "-" for x in xs)  # noqa: E731
        ratio = f"{r['ratio_tuned_default']:.2f}x" if r["ratio_tuned_default"] is not None else "-"
        grid = (f"{r['grid_estimate_s'] / 3600:.1f} h ({r['grid_points']} points)"
                if r["grid_estimate_s"] else f"- ({r['grid_points']} points)")
        print(f"{r['dataset']:<8} {r['target']:<11} {fmt(r['time_to_target_s']['default']):<19} "
              f"{fmt(r['time_to_target_s']['tuned']):<19} {ratio:<14} {r['search_s'] / 60:.0f} min   {grid}")
    result = REPO / "benchmarks" / "results" / f"tune-{'-'.join(args.datasets)}-cpu.json"
    result.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    print(f"written: {result}")


if __name__ == "__main__":
    main()
