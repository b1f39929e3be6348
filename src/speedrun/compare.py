"""Runs side by side: `speedrun compare RUN_DIR... | JOB` and `speedrun.compare(...)`.

A run directory says what ran and how it went in results.json (rewritten after every evaluation
while the run goes on, status "running") and metrics.jsonl (one record per evaluation). This
module reads them, lists the recipe fields that differ between the runs, sorts the runs by time to
target (or by $ to target: `by="cost"`), and overlays their accuracy against wall time (or
against $ spent) in one plot. A job's runs are read from its
hosts first (the two small files of each run, never the checkpoints).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speedrun import rundir
from speedrun.errors import SpeedrunError
from speedrun.files import read_jsonl

SUMMARY_FILES = ("results.json", "metrics.jsonl")  # what compare reads of a run
SKIPPED_FIELDS = ("name", "description")  # recipe fields that say nothing about what ran


@dataclass
class RunSummary:
    """One run as compare sees it. Times in seconds from process start, accuracies as fractions."""

    label: str  # how the table names it (a path, or task:path for a job's run)
    path: Path  # the local directory read
    status: str  # results.json's status; "stopped" when it says running but no process holds the run
    recipe: dict[str, Any]
    target: dict | None
    time_to_target_s: float | None
    best: dict[str, float]
    final: dict | None
    world_size: int | None
    device: str | None
    seed: int | None
    images_per_s: float | None  # mean over the evaluated epochs
    cost_usd: float | None  # $ to the end, where the run knows its machines' price (speedrun.money)
    cost_to_target_usd: float | None = None  # $ to the target, likewise
    usd_per_s: float | None = None  # what all its machines cost per second of wall time ($)
    evals: list[dict] = field(default_factory=list)


@dataclass
class Comparison:
    """The runs (sorted by time to target, then best top-1), the recipe fields that differ between
    them (dotted names: `optimizer.weight_decay`, `phases.size` for all phases), and the plot."""

    runs: list[RunSummary]
    differing: list[str]
    plot: Path | None = None  # where the plot was written
    plot_error: str | None = None  # why it was not, when one was asked for

    def rows(self) -> list[dict[str, Any]]:
        """The table: one dict per run, in order, with printable values."""
        out = []
        for r in self.runs:
            flat = flatten_recipe(r.recipe)
            row: dict[str, Any] = {"run": r.label, "recipe": r.recipe.get("name", "?")}
            row.update({key: flat.get(key, "-") for key in self.differing})
            row.update({
                "device": f"{r.world_size} x {r.device.split(' (')[0]}" if r.device else "-",
                "seed": r.seed if r.seed is not None else "-",
                "status": r.status,
                "time to target": (f"{r.time_to_target_s:.1f} s" if r.time_to_target_s is not None
                                   else "no target" if r.target is None
                                   else "not yet" if r.status == "running" else "not reached"),
                "best top1": _pct(r.best.get("top1")),
                "final top1": _pct(r.final["top1"] if r.final else None),
                "images/s": f"{r.images_per_s:,.0f}" if r.images_per_s else "-",
            })
            if any(run.cost_usd is not None for run in self.runs):
                row["$ to target"] = (_usd(r.cost_to_target_usd) if r.cost_to_target_usd is not None
                                      else row["time to target"] if r.time_to_target_s is None else "-")
                row["total $"] = _usd(r.cost_usd)
            out.append(row)
        return out


    def records(self) -> list[dict[str, Any]]:
        """The table for scripts (`compare --json`, `--csv`): the runs and columns of `rows`, with
        numbers as numbers and their units in the names (seconds, fractions, images/s, $); None
        where a run has no value."""
        out = []
        for r in self.runs:
            flat = flatten_recipe(r.recipe)
            record: dict[str, Any] = {"run": r.label, "recipe": r.recipe.get("name")}
            record.update({key: flat.get(key) for key in self.differing})
            record.update({
                "world_size": r.world_size, "device": r.device, "seed": r.seed, "status": r.status,
                "time_to_target_s": r.time_to_target_s, "best_top1": r.best.get("top1"),
                "final_top1": r.final.get("top1") if r.final else None, "images_per_s": r.images_per_s,
                "cost_to_target_usd": r.cost_to_target_usd, "cost_usd": r.cost_usd,
            })
            out.append(record)
        return out


def _pct(x: float | None) -> str:
    return f"{100 * x:.2f}%" if x is not None else "-"


def _usd(x: float | None) -> str:
    return "-" if x is None else f"${x:,.2f}" if x >= 0.995 else f"${x:.4f}"


def read_run(path: str | os.PathLike, label: str | None = None, live: bool = True) -> RunSummary:
    """The run in directory `path`. `live`: the directory is on this machine, so a run that says
    "running" can be checked for a process holding it (else it stopped without a word: "stopped").
    SpeedrunError (one line naming the file) when the directory holds no results.json, or one that
    is not JSON or not shaped as speedrun writes it."""
    path = Path(path)
    results_path, metrics_path = path / "results.json", path / "metrics.jsonl"
    if not results_path.is_file():
        what = ("is not a directory" if not path.is_dir()
                else "holds no results.json (not a run directory, or a run before its first evaluation)")
        raise SpeedrunError(f"{path} {what}")
    try:
        results = json.loads(results_path.read_text())
    except UnicodeDecodeError:
        raise SpeedrunError(f"{results_path} is not UTF-8 text: not a speedrun results.json") from None
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's json follows
        raise SpeedrunError(f"{results_path} is not JSON; was it cut short?") from None
    except OSError as e:
        raise SpeedrunError(f"{results_path} cannot be read ({e.strerror or e})") from None
    check_results(results, results_path)

    # Lines without the numbers compare uses (another tool's, a hand edit) are left out of the plot.
    evals = [e for e in read_jsonl(metrics_path) if isinstance(e, dict) and _is_number(e.get("wall_s"))
             and _is_number(e.get("top1"))]
    status = results.get("status") or "?"
    if status == "running" and live and not rundir.in_use(path):
        status = "stopped"
    speeds = [e["images_per_s"] for e in evals if _is_number(e.get("images_per_s"))]
    price = results.get("price")
    return RunSummary(
        label=label or str(path), path=path, status=status, recipe=results.get("recipe") or {},
        target=results.get("target"), time_to_target_s=results.get("time_to_target_s"),
        best=results.get("best") or {}, final=results.get("final"), world_size=results.get("world_size"),
        device=results.get("device"), seed=results.get("seed"),
        images_per_s=sum(speeds) / len(speeds) if speeds else None, cost_usd=results.get("cost_usd"),
        cost_to_target_usd=results.get("cost_to_target_usd"),
        usd_per_s=price["machines"] * price["usd_per_hour"] / 3600 if price else None, evals=evals,
    )


# results.json fields compare reads, and what each must be when present (None is always allowed).
RESULT_FIELDS: dict[str, tuple[type, ...]] = {
    "status": (str,), "recipe": (dict,), "target": (dict,), "time_to_target_s": (int, float), "best": (dict,),
    "final": (dict,), "world_size": (int,), "device": (str,), "seed": (int,), "cost_usd": (int, float),
    "cost_to_target_usd": (int, float), "price": (dict,),
}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_results(results: Any, where: Path) -> None:
    """SpeedrunError naming the first field of `results` (a parsed results.json) that is not what
    speedrun writes there: compare would otherwise fail on it half way through the table."""
    def bad(what: str, value: Any) -> SpeedrunError:
        return SpeedrunError(f"{where}: {what} is {json.dumps(value)[:40]}; not a speedrun results.json")

    if not isinstance(results, dict):
        raise bad("the whole file", results)
    for key, kinds in RESULT_FIELDS.items():
        value = results.get(key)
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)):
            raise bad(key, value)
    for key in ("best", "final"):
        for metric, value in (results.get(key) or {}).items():
            if metric in ("top1", "top5") and not _is_number(value):
                raise bad(f"{key}.{metric}", value)
    target = results.get("target")
    if target is not None and not (isinstance(target.get("metric"), str) and _is_number(target.get("value"))):
        raise bad("target", target)
    price = results.get("price")
    if price is not None and not (_is_number(price.get("machines")) and _is_number(price.get("usd_per_hour"))):
        raise bad("price", price)
    phases = (results.get("recipe") or {}).get("phases")
    if phases is not None and not (isinstance(phases, list) and all(isinstance(p, dict) for p in phases)):
        raise bad("recipe.phases", phases)


def flatten_recipe(recipe: dict[str, Any]) -> dict[str, str]:
    """A recipe dict as dotted keys with printable values; the phases' fields each become one key
    (`phases.size` = "20/20/24/28", or one value when every phase has it), plus `epochs`."""
    flat: dict[str, str] = {}
    for key, value in recipe.items():
        if key in SKIPPED_FIELDS:
            continue
        if key == "phases":
            flat["epochs"] = str(value[-1].get("end", "?") if value else 0)
            for name in dict.fromkeys(k for p in value for k in p):
                per_phase = [_short(p.get(name)) for p in value]
                flat[f"phases.{name}"] = per_phase[0] if len(set(per_phase)) == 1 else "/".join(per_phase)
        elif isinstance(value, dict):
            flat.update({f"{key}.{k}": _short(v) for k, v in value.items()})
        else:
            flat[key] = _short(value)
    return flat


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return "(" + ", ".join(_short(v) for v in value) + ")"
    return str(value)


def differing_fields(recipes: Sequence[dict[str, Any]]) -> list[str]:
    """The flattened recipe keys whose values are not the same in every recipe, in recipe order."""
    flats = [flatten_recipe(r) for r in recipes]
    keys = list(dict.fromkeys(k for f in flats for k in f))
    return [k for k in keys if len({f.get(k, "-") for f in flats}) > 1]


SORT_BY = ("time", "cost")


def compare(runs: Sequence[RunSummary], plot: str | os.PathLike | None = None, by: str = "time") -> Comparison:
    """The runs sorted (reached the target first, fastest first, or with by="cost" cheapest first,
    runs without a price after those with one; then by best top-1), the recipe fields that
    differ, and, with `plot`, a PNG of top-1 against wall time for all of them, or against $
    spent (by="cost": the runs with a price). A plot that cannot be written is `plot_error`, one
    line: the table does not depend on it."""
    if not runs:
        raise SpeedrunError("no runs to compare")
    if by not in SORT_BY:
        raise SpeedrunError(f"--by {by!r}: sort by {' or '.join(SORT_BY)}")
    if by == "cost":
        ordered = sorted(runs, key=lambda r: (r.time_to_target_s is None, r.cost_to_target_usd is None,
                                              r.cost_to_target_usd or 0.0, -r.best.get("top1", 0.0), r.label))
    else:
        ordered = sorted(runs, key=lambda r: (r.time_to_target_s is None, r.time_to_target_s or 0.0,
                                              -r.best.get("top1", 0.0), r.label))
    result = Comparison(ordered, differing_fields([r.recipe for r in ordered]))
    if plot is not None:
        try:
            result.plot = plot_runs(ordered, Path(plot), by)
        except OSError as e:
            result.plot_error = f"plot not written: {e.filename or plot}: {e.strerror or e}"
    return result


def plot_runs(runs: Sequence[RunSummary], path: Path, by: str = "time") -> Path:
    """Top-1 against wall time (minutes from process start), or by="cost" against $ spent by then
    (the runs with a price), one line per run. Nothing of matplotlib's reaches stderr (its
    warnings, a legend with nothing in it, say; its font-cache notes): the table says enough, and
    a failure to write is the caller's one line."""
    logging.getLogger("matplotlib").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return _plot(plt, runs, path, by)


def _plot(plt, runs: Sequence[RunSummary], path: Path, by: str) -> Path:
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in runs:
        if r.evals and (by == "time" or r.usd_per_s is not None):
            x = [e["wall_s"] / 60 if by == "time" else e["wall_s"] * r.usd_per_s for e in r.evals]
            ax.plot(x, [100 * e["top1"] for e in r.evals], marker="o", markersize=3, label=r.label)
    targets = {json.dumps(r.target, sort_keys=True) for r in runs if r.target}
    if len(targets) == 1:
        target = json.loads(targets.pop())
        if target["metric"] == "top1":
            ax.axhline(100 * target["value"], color="gray", linestyle="--", label="target")
    ax.set_xlabel("wall time since process start (min)" if by == "time"
                  else "machine cost since process start, $ (runs with a price; interruptions not counted)")
    ax.set_ylabel("validation top-1 (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def find_runs(root: str | os.PathLike) -> list[Path]:
    """Run directories at or under `root` (directories holding a results.json), sorted; never one
    inside another run's (its trackers' files: W&B keeps a copy of the run's results.json)."""
    root = Path(root)
    found = sorted(p.parent for p in root.rglob("results.json") if "abandoned-" not in p.parent.name)
    runs = set(found)
    return [p for p in found if not any(a in runs for a in p.parents)]


def fetch_run_files(job, remote_root: str, local_root: Path, per_task: bool, warn=print) -> None:
    """Copy the results.json and metrics.jsonl of every run under `remote_root` (relative to the
    job's tasks) from the job's hosts into `local_root`, keeping their layout; under
    `local_root/task<i>/` with `per_task`. A host that cannot be read is reported through `warn`
    and left out."""
    for task in job.one_per_destination(remote_root):
        base = local_root / f"task{task.index}" if per_task else local_root
        try:
            for remote in task.find(remote_root, SUMMARY_FILES):
                local = base / os.path.relpath(remote, task.path(remote_root))
                local.parent.mkdir(parents=True, exist_ok=True)
                local.write_text(task.read(remote))
        except SpeedrunError as e:
            warn(f"task {task.index} ({task.host.name}): {e}")


def collect_job(name: str, cache: str | os.PathLike | None = None, config_dir: str | os.PathLike | None = None,
                warn=print) -> list[RunSummary]:
    """The runs under job `name`'s run directory, read from its hosts into `cache` (default
    <speedrun home>/compare/<name>, ~/.speedrun by default) and labelled `<task>:<path in the run
    directory>`. A run that cannot be read is named through `warn` and left out."""
    from speedrun.cluster.reopen import open_job
    from speedrun.cluster.registry import speedrun_home

    job = open_job(name, config_dir)
    cache = Path(cache or speedrun_home(config_dir) / "compare" / name)
    shutil.rmtree(cache, ignore_errors=True)  # runs removed from the hosts leave no stale copies
    fetch_run_files(job, job.run_dir, cache, per_task=True, warn=warn)
    runs = []
    for task_dir in sorted(cache.glob("task*")):
        for run in find_runs(task_dir):
            try:
                runs.append(read_run(run, label=f"{task_dir.name.removeprefix('task')}:{run.relative_to(task_dir)}",
                                     live=False))
            except SpeedrunError as e:  # one bad run does not hide the others
                warn(f"left out: {e}")
    return runs
