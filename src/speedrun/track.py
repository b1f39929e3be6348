"""What a run leaves behind, written by rank 0 only.

Run directory layout (`--out DIR`):
    tb/events.out.tfevents.*   TensorBoard: train/loss, train/lr, train/images_per_s, train/size,
                               train/batch_size, train/epoch_s, train/memory_mb, val/loss,
                               val/top1, val/top5 (x axis: training step, or epoch for epoch values)
    metrics.jsonl              one JSON line per evaluation
    steps.jsonl                one JSON line every --log-every training steps (loss, LR)
    checkpoint.pt              the latest checkpoint (atomic; see speedrun.checkpoint)
    results.json               the summary: recipe, versions, device, times, best metrics (build_results)
    accuracy.png               accuracy against wall time and against epoch

The times in results.json come from the run's Clock; what a resume cost (interruption) and what
`speedrun launch --recover` cost (recovery_costs) are worked out here too.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import platform
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from speedrun import files
from speedrun.version import __version__
from speedrun.files import read_jsonl  # noqa: F401 - its old home (tests and users read it here)
from speedrun.money import Price, cost_fields
from speedrun.trackers import Trackers, open_trackers, saved_tracks

if TYPE_CHECKING:  # types only: the loop hands these in
    from speedrun.checkpoint import RunState
    from speedrun.config import TrainConfig
    from speedrun.data.base import DataSource
    from speedrun.dist import DistContext
    from speedrun.memory_format import MemoryFormat


TB_FLUSH_S = 5  # seconds between TensorBoard's flushes to disk (see Tracker.__init__)
EPOCH_KEYS = ("size", "batch_size", "images_per_s", "epoch_s", "memory_mb")  # an epoch's speed record, as train/KEY
# results.json's figures that a tracker gets as metrics at the run's end (its last step).
SUMMARY = ("time_to_target_s", "time_to_target_from_first_step_s", "cost_to_target_usd", "cost_usd", "total_s",
           "startup_s", "lost_s", "epochs_run")


class Tracker:
    """Logs to TensorBoard, JSONL files, the console and a progress bar. With `enabled=False`
    (ranks other than 0) every method does nothing."""

    def __init__(self, run_dir: Path, enabled: bool = True, console: Console | None = None,
                 resume_step: int | None = None, trackers: Trackers | None = None, track_checkpoints: bool = False):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.console = console or Console(highlight=False)
        self.trackers = trackers or Trackers([])  # MLflow...: what this class logs goes there too
        self.track_checkpoints = track_checkpoints
        self._status = "interrupted"  # the run's, once results.json holds its end (write_results)
        self._tb = None
        self._progress: Progress | None = None
        self._task = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.run_dir.mkdir(parents=True, exist_ok=True)
            if resume_step is not None:
                # Records written after the checkpoint belong to work that will be redone.
                _truncate_jsonl(self.run_dir / "steps.jsonl", lambda r: r["step"] <= resume_step)
                _truncate_jsonl(self.run_dir / "metrics.jsonl", lambda r: r["step"] <= resume_step)
            # purge_step hides TensorBoard events past the checkpoint for the same reason.
            # flush_secs: TensorBoard's writer thread wakes at least this often (torch's default:
            # every 120 s). A Ctrl-C that lands while an event is queued can cost that thread its
            # wake-up (a stale waiter takes the notify), and closing waits until it wakes by itself:
            # seconds, not minutes. Events also reach a live TensorBoard sooner.
            self._tb = SummaryWriter(str(self.run_dir / "tb"), flush_secs=TB_FLUSH_S,
                                     purge_step=resume_step + 1 if resume_step is not None else None)

    # -- console ---------------------------------------------------------------------------
    def print(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, soft_wrap=True)  # a log line stays one line in a file

    def start_epoch(self, epoch: int, epochs: int, steps: int, size: int, batch_size: int) -> None:
        """A progress bar for one epoch (only drawn on a terminal)."""
        if not self.enabled:
            return
        if self._progress is None:
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]:>8.0f} img/s"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
                disable=not self.console.is_terminal,
            )
            self._progress.start()
        if self._task is not None:
            self._progress.remove_task(self._task)
        self._task = self._progress.add_task(
            f"epoch {epoch + 1}/{epochs} {size}px b{batch_size}", total=steps, rate=0.0
        )

    def advance(self, images_per_s: float) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=1, rate=images_per_s)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self.trackers:
            self.trackers.status(self._status)
            for line in self.trackers.close():
                self.print(line)
        if self._tb is not None:
            tb, self._tb = self._tb, None
            try:
                tb.close()
            except OSError:  # the run directory is gone or full: the run's own error says so
                pass

    # -- numbers ---------------------------------------------------------------------------
    def log_step(self, record: dict[str, Any]) -> None:
        """One training-step record: step, epoch, loss, lr."""
        if not self.enabled:
            return
        # The JSONL line first, on this thread: when the run directory has gone (or the disk is
        # full) the error is raised here, before TensorBoard's writer thread meets it.
        _append_jsonl(self.run_dir / "steps.jsonl", record)
        self._tb.add_scalar("train/loss", record["loss"], record["step"])
        self._tb.add_scalar("train/lr", record["lr"], record["step"])
        self.trackers.metrics(record["step"], {"train/loss": record["loss"], "train/lr": record["lr"]})

    def log_epoch(self, record: dict[str, Any]) -> None:
        """One epoch's speed record: step, epoch, size, batch_size, images_per_s, epoch_s, memory_mb."""
        if not self.enabled:
            return
        if not (self.run_dir / "tb").is_dir():  # as in log_step: fail here, not in TensorBoard's thread
            raise FileNotFoundError(errno.ENOENT, "the run directory's tb/ folder is gone", str(self.run_dir / "tb"))
        for key in EPOCH_KEYS:
            self._tb.add_scalar(f"train/{key}", record[key], record["step"])
        self.trackers.metrics(record["step"], {"epoch": record["epoch"], **{f"train/{key}": record[key]
                                                                            for key in EPOCH_KEYS}})

    def log_eval(self, record: dict[str, Any]) -> None:
        """One evaluation: epoch, step, loss, top1, top5, wall_s, size."""
        if not self.enabled:
            return
        _append_jsonl(self.run_dir / "metrics.jsonl", record)  # first: see log_step
        for key in ("loss", "top1", "top5"):
            self._tb.add_scalar(f"val/{key}", record[key], record["step"])
        self._tb.flush()
        self.trackers.metrics(record["step"], {f"val/{key}": record[key] for key in ("loss", "top1", "top5")})

    def write_results(self, results: dict[str, Any]) -> None:
        if not self.enabled:
            return
        write_json_atomic(self.run_dir / "results.json", results)
        if self.trackers and results["status"] != "running":  # the run's end: its figures and files
            self._status = results["status"]
            self.trackers.metrics(results["steps"], {**{key: results.get(key) for key in SUMMARY},
                                                     **{f"best/{k}": v for k, v in results["best"].items()}})
            self.trackers.tags({"speedrun.status": results["status"],
                                "speedrun.checkpoint": results.get("last_checkpoint") or "none"})
            self.trackers.artifact("results.json")
            self.trackers.artifact("metrics.jsonl")  # with results.json: what `compare mlflow://` reads
            if self.track_checkpoints and results.get("last_checkpoint"):
                self.trackers.artifact("checkpoint.pt")

    def plot(self, evals: list[dict[str, Any]], target: dict | None) -> Path | None:
        """accuracy.png: top-1 and top-5 against wall-clock minutes and against epoch."""
        if not self.enabled or not evals:
            return None
        path = plot_accuracy(evals, target, self.run_dir / "accuracy.png")
        self.trackers.artifact(path.name)
        return path


# The run's settings a tracker gets as parameters, beside the recipe's fields (TrainConfig's names).
SETTINGS = ("device", "seed", "deterministic", "compile", "precision", "memory_format", "data", "workers", "loader",
            "log_every", "checkpoint_every", "sync_bn", "bucket_cap_mb", "bf16_grads")


def open_run_trackers(cfg: TrainConfig, ctx: DistContext) -> Trackers:
    """Rank 0's experiment trackers (cfg.track), each run made (the recipe flattened and the
    settings as parameters; recipe, device, world size, job and host as tags) or found
    again on a resume, before the first step: a tracker that does not answer is SpeedrunError."""
    # A resumed run goes on with its trackers, asked for again or not.
    specs = {s.kind: s for s in (*(saved_tracks(cfg.out) if cfg.resume else ()), *cfg.track)}
    if not (specs and ctx.is_main):
        return Trackers([])
    from speedrun.compare import flatten_recipe

    params = {"recipe.name": cfg.recipe.name,
              **{f"recipe.{k}": v for k, v in flatten_recipe(cfg.recipe.to_dict()).items()}}
    params.update({k: getattr(cfg, k) for k in SETTINGS}, world_size=ctx.world_size)
    tags = {"speedrun.recipe": cfg.recipe.name, "speedrun.device": device_name(ctx.device),
            "speedrun.world_size": str(ctx.world_size), "speedrun.host": platform.node(),
            # Set by a launch job's provider (local, ssh, aws, slurm); a run started by hand: none.
            "speedrun.provider": os.environ.get("SPEEDRUN_PROVIDER", "none"),
            "speedrun.run_dir": str(cfg.out.absolute()), "speedrun.version": __version__,
            **({"speedrun.job": os.environ["SPEEDRUN_JOB"]} if os.environ.get("SPEEDRUN_JOB") else {}),
            **({"speedrun.group": cfg.track_group} if cfg.track_group else {})}
    # The tracker run's name: the run directory's; in a group, with the folder above it, as a
    # group's runs share names there (an ablation's VARIANT/seed0, a job's JOB/run.3).
    out = cfg.out.absolute()
    name = f"{out.parent.name}/{out.name}" if cfg.track_group else out.name
    return open_trackers(tuple(specs.values()), cfg.out, name, params, tags, cfg.track_group)


def plot_accuracy(evals: list[dict[str, Any]], target: dict | None, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    minutes = [e["wall_s"] / 60 for e in evals]
    epochs = [e["epoch"] for e in evals]  # 1-based, as printed
    for ax, xs, label in ((axes[0], minutes, "wall time since process start (min)"), (axes[1], epochs, "epoch")):
        ax.plot(xs, [100 * e["top1"] for e in evals], marker="o", label="top-1")
        ax.plot(xs, [100 * e["top5"] for e in evals], marker="s", label="top-5")
        if target:
            ax.axhline(100 * target["value"], color="gray", linestyle="--", label=f"target {target['metric']}")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation accuracy (%)")
    axes[1].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(files.to_json(record) + "\n")


def _truncate_jsonl(path: Path, keep) -> None:
    if path.exists():
        files.write_text(path, "".join(files.to_json(r) + "\n" for r in read_jsonl(path) if keep(r)))


def write_json_atomic(path: Path, data: Any) -> None:
    files.write_text(path, files.to_json(data, indent=2) + "\n")


def build_results(
    cfg: TrainConfig, ctx: DistContext, source: DataSource, state: RunState, evals: list[dict], status: str,
    session_start: float, precision: str, memory_format: MemoryFormat,
) -> dict[str, Any]:
    """results.json: what ran, where, how fast, how well (docs/training.md lists the fields)."""
    recipe = cfg.recipe
    final = evals[-1] if evals else None
    total_s, lost_s = state.startup_s + state.train_s, sum(i["wall_s_lost"] for i in state.interruptions)
    return {
        # running (written after each evaluation), target_reached, finished, stopped, interrupted or failed
        "status": status,
        "recipe": recipe.to_dict(),
        "target": dataclasses.asdict(recipe.target) if recipe.target else None,
        "reached_target": state.time_to_target_s is not None,
        "time_to_target_s": state.time_to_target_s,
        "time_to_target_from_first_step_s": state.time_to_target_from_first_step_s,
        "target_epoch": state.target_epoch,
        "total_s": total_s,
        "startup_s": state.startup_s,
        "epochs_run": state.epoch,
        "steps": state.step,
        "interruptions": state.interruptions,  # one per resume: steps redone, seconds lost
        "lost_s": lost_s,
        "best": state.best,
        "final": final,
        "world_size": ctx.world_size,
        "device": device_name(ctx.device),
        "seed": cfg.seed,
        "deterministic": cfg.deterministic,
        "compile": cfg.compile,
        "precision": precision,
        "memory_format": memory_format.name,
        "memory_format_why": memory_format.why,
        "data": cfg.data,
        "loader": source.loader,
        "skipped_images": source.skipped_images(),
        "cpu_fallbacks": source.cpu_fallbacks(),  # --loader gpu: images decoded on the CPU instead
        "versions": {"speedrun": __version__, "torch": torch.__version__, "python": platform.python_version()},
        "session_s": time.time() - session_start,
        # What it cost: the run's time and what interruptions lost, at the machines' price.
        **cost_fields(Price.from_dict(state.price) if state.price else None, total_s + lost_s,
                      state.time_to_target_s + (state.lost_s_at_target or 0.0)
                      if state.time_to_target_s is not None else None),
    }


def recovery_costs(out: Path, lost_s: float, price: dict[str, Any] | None = None) -> dict[str, Any]:
    """The final results' `recoveries` and `lost_usd`: what `speedrun launch --recover` did to
    keep the run going (speedrun.cluster.recovery), and what the time lost (`lost_s`) cost at
    the run's `price` (a speedrun.money.Price as a dict), else at the machines' price when the
    watcher knew it."""
    recoveries = out / "recoveries.jsonl"
    done = read_jsonl(recoveries) if recoveries.exists() else []
    if price is not None:
        return {"recoveries": done, "lost_usd": Price.from_dict(price).cost(lost_s)}
    prices = [r["price_per_hour"] for r in done if r.get("price_per_hour") is not None]
    return {"recoveries": done, "lost_usd": lost_s * prices[-1] / 3600 if prices else None}


def interruption(out: Path, state: RunState, process_start: float) -> dict:
    """What resuming from `state` costs: the steps logged after its checkpoint (trained again, at
    the run's mean seconds per step, evaluations included) and the wall time between the last
    step logged and this process's start (s)."""
    steps = out / "steps.jsonl"
    logged = read_jsonl(steps) if steps.exists() else []
    last = max((r["step"] for r in logged), default=state.step)
    per_step = state.train_s / state.step if state.step else 0.0
    redone = max(last - state.step, 0)
    between = max(process_start - steps.stat().st_mtime, 0.0) if steps.exists() else 0.0
    return {"resumed_at_step": state.step, "last_step_logged": last, "steps_redone": redone,
            "training_s_lost": redone * per_step, "seconds_between_sessions": between,
            "wall_s_lost": redone * per_step + between}


def run_header(cfg: TrainConfig, ctx: DistContext, source: DataSource, precision: str,
               memory_format: MemoryFormat) -> str:
    """The first line a run prints: what trains on what (in which memory format, and why), and the
    LR factor for this world size."""
    recipe = cfg.recipe
    scale = recipe.lr_scale(ctx.world_size)
    warmup = (f" (ramped up over {recipe.scale_warmup_epochs:g} epochs)"
              if scale > 1 and recipe.scale_warmup_epochs else "")
    loader = f" ({source.loader} loader)" if source.loader else ""
    return (
        f"speedrun {__version__}: recipe {recipe.name}, model {recipe.model}, "
        f"{source.num_train} train / {source.num_val} val images{loader}, "
        f"{ctx.world_size} x {ctx.device.type}, {precision}, {memory_format.name} ({memory_format.why}), "
        f"LR x{scale:g}{warmup} for world size "
        f"{ctx.world_size}, target {recipe.target or 'none'}, out {cfg.out}"
    )


class Clock:
    """Wall-clock accounting that survives resumes: startup (process start -> first step, from
    the run's first session) plus training time (first step -> now, summed over sessions). The
    one writer of `state.startup_s` and `state.train_s` while the run goes on."""

    def __init__(self, process_start: float, state: RunState):
        self.process_start = process_start
        self.session_start = time.time()
        self.state = state
        self.train_s_before = state.train_s
        self.first_step_at: float | None = None

    def first_step(self) -> None:
        """Call at every step; only the first call of a session starts the clock."""
        if self.first_step_at is None:
            self.first_step_at = time.time()
            if self.state.step == 0:
                self.state.startup_s = self.first_step_at - self.process_start

    def record(self) -> None:
        """Bring `state.train_s` up to now: before the state is logged, saved or put in the results."""
        if self.first_step_at is None:
            self.state.train_s = self.train_s_before
        else:
            self.state.train_s = self.train_s_before + time.time() - self.first_step_at


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"

def memory_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocations on a GPU, resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
