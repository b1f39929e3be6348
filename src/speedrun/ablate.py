"""What each trick is worth: `speedrun ablate RECIPE` runs the recipe and, for each trick it uses,
the recipe with that trick turned off, N seeds each, and reports each trick's time to target
relative to the full recipe.

What "off" means is defined once, here, in `TRICKS`, and printed with the results. A variant
differs from the full recipe in its trick's fields only. Runs go one after another to local
processes (`speedrun train`, as a user runs it), or in parallel to a job's hosts. An ablation
lives in one directory (plan.json, one recipe file per variant, one run directory per variant and
seed); running the same command again continues it with the runs it lacks.
"""
from __future__ import annotations

import dataclasses
import posixpath
import shlex
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speedrun.compare import RunSummary, read_run
from speedrun.errors import EXIT_BAD_INPUT, SpeedrunError, stop_on_sigterm
from speedrun.files import to_json
from speedrun.recipe import Recipe
from speedrun.recipes import recipe_source
from speedrun.rundir import FINISHED, run_status

FULL = "full"  # the variant with every trick on


@dataclass(frozen=True)
class Trick:
    """One trick: what turning it off means (printed), whether a recipe uses it, and the recipe
    without it."""

    name: str
    off: str
    used: Callable[[Recipe], bool]
    turn_off: Callable[[Recipe], Recipe]


def _phases(recipe: Recipe, **changes) -> Recipe:
    return dataclasses.replace(recipe, phases=tuple(dataclasses.replace(p, **changes) for p in recipe.phases))


def _one_batch_size(recipe: Recipe) -> Recipe:
    # The linear scaling rule keeps each phase's LR per image: LR x (one batch / phase batch).
    b = recipe.phases[0].batch_size
    scale = lambda p: (lambda lr: lr * b / p.batch_size)  # noqa: E731
    return dataclasses.replace(recipe, phases=tuple(
        dataclasses.replace(p, batch_size=b,
                            lr=tuple(map(scale(p), p.lr)) if isinstance(p.lr, tuple) else scale(p)(p.lr))
        for p in recipe.phases))


def _rising(lr) -> bool:
    return isinstance(lr, tuple) and lr[0] < lr[1]


def _no_warmup(recipe: Recipe) -> Recipe:
    # The rising ramps at the start become their peak, held; no ramp of a scaled LR either.
    phases, warming = [], True
    for p in recipe.phases:
        warming = warming and _rising(p.lr)
        phases.append(dataclasses.replace(p, lr=p.lr[1]) if warming else p)
    return dataclasses.replace(recipe, phases=tuple(phases), scale_warmup_epochs=0.0)


TRICKS: dict[str, Trick] = {t.name: t for t in (
    Trick("progressive-resizing", "every phase at the final phase's size (and its data copy)",
          lambda r: len({p.size for p in r.phases}) > 1,
          lambda r: _phases(r, size=r.phases[-1].size, copy=r.phases[-1].copy)),
    Trick("dynamic-batch", "one batch size, the first phase's, each phase's LR scaled by the batch ratio",
          lambda r: len({p.batch_size for p in r.phases}) > 1, _one_batch_size),
    Trick("rect-val", "square centre-crop validation", lambda r: any(p.rect_val for p in r.phases),
          lambda r: _phases(r, rect_val=False)),
    Trick("no-wd-norm", "weight decay on every parameter, norms and biases too",
          lambda r: r.optimizer.no_decay != "none" and r.optimizer.weight_decay > 0,
          lambda r: dataclasses.replace(r, optimizer=dataclasses.replace(r.optimizer, no_decay="none"))),
    Trick("warmup", "no warmup: the first rising LR ramp held at its peak, no scaled-LR ramp",
          lambda r: _rising(r.phases[0].lr), _no_warmup),
    Trick("zero-init", "residual blocks' last norm starts at one (PyTorch's default), not zero",
          lambda r: r.zero_init, lambda r: dataclasses.replace(r, zero_init=False)),
    Trick("ema", "evaluate the raw weights, no moving average", lambda r: r.ema_decay is not None,
          lambda r: dataclasses.replace(r, ema_decay=None)),
    Trick("eval-flip", "evaluate each image once, not also mirrored", lambda r: r.eval_flip,
          lambda r: dataclasses.replace(r, eval_flip=False)),
)}


def variants(recipe: Recipe, only: Sequence[str] | None = None) -> dict[str, Recipe]:
    """The full recipe (FULL) and one recipe per trick it uses with that trick off, by trick name.
    `only`: those tricks (each must exist; one the recipe does not use is an error)."""
    unknown = [t for t in only or () if t not in TRICKS]
    if unknown:
        raise SpeedrunError(f"unknown trick {', '.join(unknown)} (tricks: {', '.join(TRICKS)})")
    unused = [t for t in only or () if not TRICKS[t].used(recipe)]
    if unused:
        raise SpeedrunError(f"recipe {recipe.name} does not use {', '.join(unused)}: nothing to turn off")
    chosen = [t for t in TRICKS.values() if (t.name in only if only else t.used(recipe))]
    out = {FULL: recipe}
    for t in chosen:
        out[t.name] = dataclasses.replace(t.turn_off(recipe), name=f"{recipe.name}-no-{t.name}").validate()
    return out


@dataclass(frozen=True)
class Plan:
    """An ablation: the recipe's variants, seeds, and what every run is given."""

    recipe: Recipe
    tricks: tuple[str, ...]
    seeds: int
    data: str | None
    train_args: tuple[str, ...] = ()  # more `speedrun train` options for every run (--device, --workers ...)

    def to_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe.to_dict(), "tricks": list(self.tricks), "seeds": self.seeds, "data": self.data,
                "train_args": list(self.train_args)}

    def runs(self) -> list[tuple[str, int]]:
        """(variant, seed) pairs, seed-major: with a run cut short, every variant has as many seeds."""
        return [(v, s) for s in range(self.seeds) for v in (FULL, *self.tricks)]


def plan_files(plan: Plan) -> dict[str, str]:
    """What an ablation directory holds besides its runs, by relative path: plan.json and one
    recipe file per variant."""
    files = {"plan.json": to_json(plan.to_dict(), indent=2) + "\n"}
    header = "# Written by speedrun ablate.\n"
    files.update({f"{name}/recipe.py": recipe_source(r, header)
                  for name, r in variants(plan.recipe, plan.tricks).items()})
    return files


def prepare(out: Path, plan: Plan) -> None:
    """Write `plan_files` in `out`, or check that `out` holds this very plan (an interrupted
    ablation continues; another plan there is refused). SpeedrunError when `out` is a file, holds
    anything else (a run directory, say: its files are never mixed with an ablation's) or cannot
    be written to."""
    files = plan_files(plan)
    saved = out / "plan.json"
    if out.exists() and not out.is_dir():
        raise SpeedrunError(f"--out {out} is a file, not a directory; choose another --out")
    if saved.exists():
        if saved.read_text() != files["plan.json"]:
            raise SpeedrunError(f"{out} holds another ablation (plan.json differs): choose another --out")
        return
    ours = {Path(rel).parts[0] for rel in files}  # what an ablation cut short before its plan.json may have left
    others = sorted(p.name for p in out.iterdir() if p.name not in ours) if out.is_dir() else []
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise SpeedrunError(f"--out {out} is not empty and holds no ablation ({shown}); "
                            "choose a new or empty directory")
    try:
        for rel, text in sorted(files.items(), key=lambda f: f[0] == "plan.json"):  # plan.json last: complete
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_text(text)
    except OSError as e:
        raise SpeedrunError(f"--out {out}: cannot write the ablation there ({e.strerror or e}); "
                            "choose another --out") from None


def train_argv(plan: Plan, variant: str, seed: int, resume: bool, python: str = sys.executable,
               env: Mapping[str, str] | None = None) -> list[str]:
    """The `speedrun train` command line of one run (paths relative to the ablation directory),
    under `env(1)` with `env`'s variables where given (the ablation's trackers: `track_env`)."""
    argv = [*(["env", *(f"{k}={v}" for k, v in env.items())] if env else []),
            python, "-m", "speedrun", "train", "--recipe", f"{variant}/recipe.py", "--seed", str(seed),
            "--out", f"{variant}/seed{seed}"]
    if plan.data:
        argv += ["--data", plan.data]
    return argv + list(plan.train_args) + (["--resume"] if resume else [])


def track_env(out: Path, track: Sequence[str] = ()) -> dict[str, str]:
    """What every run of the ablation in `out` is given for its experiment trackers: its --track
    values, where given, and the ablation as their group (an MLflow parent run, a W&B group)."""
    return {**({"SPEEDRUN_TRACK": ",".join(track)} if track else {}), "SPEEDRUN_TRACK_GROUP": out.name}


def run_local(out: Path, plan: Plan, say: Callable[[str], None] = print, env: Mapping[str, str] | None = None) -> None:
    """Every run the ablation lacks, one after another on this machine. A run that fails (a
    variant can diverge) is recorded as failed and the ablation goes on; bad input stops it, and
    Ctrl-C stops it with the interrupted run resumable."""
    todo = [(v, s) for v, s in plan.runs() if run_status(out / v / f"seed{s}") not in FINISHED]
    if len(todo) < len(plan.runs()):
        say(f"{len(plan.runs()) - len(todo)} of {len(plan.runs())} runs already done in {out}")
    restore_sigterm = stop_on_sigterm()  # `kill` stops the ablation as Ctrl-C does, run included
    try:
        _run_each(out, plan, todo, say, env)
    finally:
        restore_sigterm()


def _run_each(out: Path, plan: Plan, todo: list[tuple[str, int]], say: Callable[[str], None],
              env: Mapping[str, str] | None) -> None:
    for i, (variant, seed) in enumerate(todo, 1):
        run_dir = out / variant / f"seed{seed}"
        resume = (run_dir / "checkpoint.pt").is_file()
        say(f"[{i}/{len(todo)}] {variant}, seed {seed}{' (resumed)' if resume else ''}")
        # Its own session: a Ctrl-C reaches this process only, which stops the run with exactly one
        # SIGTERM (the trainer takes it as Ctrl-C; SIGINT may be ignored in a background job) and
        # waits, so the run writes its results and checkpoint undisturbed.
        proc = subprocess.Popen(train_argv(plan, variant, seed, resume, env=env), cwd=out, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        stopped = f"ablation stopped during {variant} seed {seed}; run the same command to continue"
        try:
            _, stderr = proc.communicate()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGTERM)
            proc.communicate()
            raise KeyboardInterrupt(stopped) from None
        last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {proc.returncode}"
        if proc.returncode == 130:
            raise KeyboardInterrupt(stopped)
        if proc.returncode == EXIT_BAD_INPUT:
            raise SpeedrunError(f"{variant} seed {seed}: {last}")
        if proc.returncode != 0:
            say(f"  {variant} seed {seed} failed: {last}")


def run_on_job(job, out: str, plan: Plan, say: Callable[[str], None] = print,
               env: Mapping[str, str] | None = None) -> None:
    """Every run the ablation lacks, on the job's machines at once (`job.run_each`: each task runs
    its share one after another; on Slurm, a job array), in `out` under the job's run directory;
    returns when all have ended."""
    remote = posixpath.join(job.run_dir, out)
    for rel, text in plan_files(plan).items():
        job.write(f"{remote}/{rel}", text)
    commands = []
    for variant, seed in plan.runs():
        # In the shell: skip a finished run, resume one with a checkpoint, go on after a failure.
        d = f"{variant}/seed{seed}"
        fresh, again = (shlex.join(train_argv(plan, variant, seed, r, job.python, env)) for r in (False, True))
        commands.append(f"if grep -qE '\"status\": \"({'|'.join(FINISHED)})\"' {d}/results.json 2>/dev/null; "
                        f"then :; elif [ -f {d}/checkpoint.pt ]; then {again}; else {fresh}; fi")
    job.run_each(commands, name="ablate", cwd=remote, say=say)


@dataclass
class TrickResult:
    """One trick's effect over the seeds: time to target relative to the full recipe's (per seed,
    where both reached it), how many seeds did not reach it, mean best top-1; and in dollars,
    where the runs know their machines' price."""

    trick: str
    off: str
    ratios: list[float]
    not_reached: int
    seeds: int
    mean_time_s: float | None
    mean_best_top1: float | None
    cost_ratios: list[float] = field(default_factory=list)  # $ to target / the full recipe's, per seed
    mean_cost_usd: float | None = None  # mean $ to target over the seeds that reached it with a price


def summarise(plan: Plan, runs: dict[tuple[str, int], RunSummary]) -> list[TrickResult]:
    """The full recipe first, then each trick, from the runs found (missing ones count as not
    reached: they have no time)."""
    out = []
    for name in (FULL, *plan.tricks):
        times, ratios, best, missed, costs, cost_ratios = [], [], [], 0, [], []
        for seed in range(plan.seeds):
            run, full = runs.get((name, seed)), runs.get((FULL, seed))
            t = run.time_to_target_s if run else None
            if run and run.best.get("top1") is not None:
                best.append(run.best["top1"])
            if t is None:
                missed += 1
                continue
            times.append(t)
            if full and full.time_to_target_s:
                ratios.append(t / full.time_to_target_s)
            if run.cost_to_target_usd is not None:
                costs.append(run.cost_to_target_usd)
                if full and full.cost_to_target_usd:
                    cost_ratios.append(run.cost_to_target_usd / full.cost_to_target_usd)
        out.append(TrickResult(name, "every trick on" if name == FULL else TRICKS[name].off, ratios, missed,
                               plan.seeds, statistics.mean(times) if times else None,
                               statistics.mean(best) if best else None, cost_ratios,
                               statistics.mean(costs) if costs else None))
    return out


def read_runs(out: Path, plan: Plan, live: bool = True) -> dict[tuple[str, int], RunSummary]:
    """The runs of the ablation in `out` that have results, by (variant, seed)."""
    found = {}
    for variant, seed in plan.runs():
        d = out / variant / f"seed{seed}"
        if (d / "results.json").is_file():
            found[(variant, seed)] = read_run(d, label=f"{variant}/seed{seed}", live=live)
    return found


def table(results: Sequence[TrickResult]) -> list[dict[str, str]]:
    """Printable rows: time to target relative to the full recipe as mean and range over seeds;
    the same in dollars when the runs have a price."""
    priced = any(r.mean_cost_usd is not None for r in results)
    rows = []
    for r in results:
        row = {"off": r.trick, "what off means": r.off,
               "time to target": f"{r.mean_time_s:.1f} s" if r.mean_time_s is not None else "-",
               "vs full": relative(r.trick, r.ratios), "not reached": f"{r.not_reached}/{r.seeds}",
               "best top1": f"{100 * r.mean_best_top1:.2f}%" if r.mean_best_top1 is not None else "-"}
        if priced:
            row["$ to target"] = f"${r.mean_cost_usd:.4g}" if r.mean_cost_usd is not None else "-"
            row["$ vs full"] = relative(r.trick, r.cost_ratios)
        rows.append(row)
    return rows


def relative(trick: str, ratios: list[float]) -> str:
    """A trick's ratios to the full recipe (per seed) as their mean and range."""
    if trick == FULL:
        return "1 (reference)"
    if not ratios:
        return "-"
    spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
    return f"{statistics.mean(ratios):.2f}x{spread}"


def default_out(recipe: Recipe) -> Path:
    """runs/ablate-<recipe>: the same command finds the same ablation again and continues it."""
    return Path("runs") / f"ablate-{recipe.name}"
