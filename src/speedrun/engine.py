"""The training loop: `train(config)` runs one process's share of a run (one process per device;
see speedrun.dist). Read `train` top to bottom for the whole story: claim the run directory,
build the data source and the learner, then for every epoch set the LR per step, train, evaluate,
checkpoint, and stop at the target; the results go to results.json whatever happens. Asked to
stop (SIGTERM, a spot notice, a stop file: speedrun.stopping), every rank stops after the same
step and the checkpoint holds that step, so that `--resume` continues exactly there.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

import speedrun
from speedrun import rundir
from speedrun.checkpoint import CheckpointWriter, RunState, restore_run, save_run, where
from speedrun.config import TrainConfig
from speedrun.data import build_source
from speedrun.data.base import DataSource, TrainStream
from speedrun.dist import (DistContext, all_reduce_sum, broadcast_object, collective_failed, init_distributed,
                           peer_failure, pick_device, shutdown)
from speedrun.errors import SpeedrunError, TrainingFailed, stop_on_sigterm
from speedrun.learner import (DeviceBatches, EvalSettings, Learner, build_learner, check_device_options,
                              configure_determinism, evaluate)
from speedrun.optim import set_lr
from speedrun.recipe import Phase, Recipe
from speedrun.stopping import StopRequests
from speedrun.track import Tracker, build_results, memory_mb, read_jsonl

PEER_DIED = "probably died"  # in dist.peer_failure's line: the launcher recognises collateral failures by it


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run the recipe to its end or its target; return the results (also in results.json)."""
    recipe = cfg.recipe
    device_kind = pick_device(cfg.device)
    check_device_options(cfg, device_kind)
    ctx = init_distributed(device_kind)
    restore_sigterm = stop_on_sigterm()
    run_dir = None
    try:
        run_dir = claim_run_dir(cfg, ctx)
        cfg = dataclasses.replace(cfg, out=run_dir.path)
        configure_determinism(cfg, ctx)
        source = build_source(recipe, cfg.data, ctx.device, cfg.workers, cfg.copies, cfg.loader)
        try:
            if source.num_classes < 2:
                raise SpeedrunError(f"{source.name} has {source.num_classes} class: every label would be the same; "
                                    "a classifier needs at least 2 (one folder per class)")
            learner = build_learner(cfg, ctx, source)
            state = RunState(world_size=ctx.world_size)
            if cfg.resume:
                state = restore_run(cfg.out / "checkpoint.pt", learner, cfg, ctx.world_size)
                if complete(state, recipe):
                    return already_complete(cfg.out, state, ctx)
                if ctx.is_main:  # before the tracker cuts the log back to the checkpoint
                    state.interruptions.append(interruption(cfg.out, state, cfg.process_start))
            state.record_classes(source)  # for `speedrun eval` to check other data against
            tracker = Tracker(cfg.out, enabled=ctx.is_main, resume_step=state.step if cfg.resume else None)
            try:
                if run_dir.note:
                    tracker.print(run_dir.note)
                return run_epochs(cfg, ctx, source, learner, state, tracker)
            finally:
                tracker.close()
        finally:
            source.close()
    except RuntimeError as e:
        if not collective_failed(e, ctx):
            raise
        raise TrainingFailed(peer_failure(e, ctx)) from None
    finally:
        # The handler stays until the clean-up is done: a SIGTERM until then (torchrun's or a
        # scheduler's second one) interrupts it, and does not kill the process in its middle.
        try:
            if run_dir is not None:
                run_dir.release()
            shutdown(ctx)
        finally:
            restore_sigterm()


def run_epochs(
    cfg: TrainConfig, ctx: DistContext, source: DataSource, learner: Learner, state: RunState, tracker: Tracker
) -> dict[str, Any]:
    """The epochs, from `state` (a fresh run's or a resumed one's) to the end or the target."""
    recipe, out = cfg.recipe, cfg.out
    tracker.print(run_header(cfg, ctx, source, learner.precision))
    batches = DeviceBatches(source, ctx.device, learner.channels_last)
    evals = read_jsonl(out / "metrics.jsonl") if cfg.resume else []
    clock = Clock(cfg.process_start, state)
    streams = PhaseStreams(source, ctx, cfg.seed)
    writer = CheckpointWriter(last_written=f"{out / 'checkpoint.pt'} ({where(state)})" if cfg.resume else None)
    status = "interrupted"
    first_epoch = state.epoch
    stops = StopRequests(ctx, out, cfg.spot_notice_url)
    last_save = time.time()
    # The stop handler stays until results.json is written: torchrun's SIGTERM, sent when a peer
    # died, reaches a survivor that may already be cleaning up, and must not cut that short.
    with stops:
        try:
            for epoch in range(first_epoch, recipe.epochs):
                phase = recipe.phase_at(epoch)
                skip = state.epoch_step if epoch == first_epoch else 0  # steps a resumed epoch already took
                stream = streams.for_epoch(phase, epoch, skip)
                steps, images_per_step = len(stream), stream.batch_size * ctx.world_size
                tracker.start_epoch(epoch, recipe.epochs, steps, phase.size, phase.batch_size)

                learner.net.train()
                start = time.time()
                for i, (images, labels) in enumerate(stream, start=skip):
                    clock.first_step()
                    lr = recipe.lr_at(epoch, i, steps, ctx.world_size)  # per step: warmups and decays are smooth
                    set_lr(learner.optimizer, lr)
                    state.step += 1
                    loss = learner.step(*batches.to_device(images, labels), state.step)
                    state.epoch_step = i + 1
                    if state.step % cfg.log_every == 0 or i == steps - 1:
                        log_train_loss(loss, lr, epoch, state.step, ctx, tracker)
                    tracker.advance((i + 1 - skip) * images_per_step / max(time.time() - start, 1e-9))
                    writer.check()  # a checkpoint that failed stops the run now, not at the next save
                    if stops.agreed():  # every rank stops after this same step
                        break
                    if ctx.is_main and cfg.checkpoint_minutes and time.time() - last_save >= 60 * cfg.checkpoint_minutes:
                        state.train_s = clock.train_s()
                        save_run(writer, out / "checkpoint.pt", learner, state, cfg)  # mid-epoch, in the background
                        last_save = time.time()
                if stops.code:
                    status = stop_here(stops, writer, out, learner, state, clock, cfg, ctx, tracker)
                    break
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize()
                epoch_s = time.time() - start
                speed = {"images_per_s": (steps - skip) * images_per_step / epoch_s, "epoch_s": epoch_s}
                learner.average_buffers(ctx)  # every rank evaluates (and rank 0 saves) the same model
                tracker.log_epoch({"epoch": epoch + 1, "step": state.step, "size": phase.size,
                                   "batch_size": phase.batch_size, **speed, "memory_mb": memory_mb(ctx.device)})
                state.epoch, state.epoch_step = epoch + 1, 0

                last = epoch == recipe.epochs - 1
                if (epoch + 1) % recipe.eval_every == 0 or last:
                    settings = EvalSettings(phase.size, recipe.val_batch_size or phase.batch_size, phase.rect_val,
                                            recipe.eval_flip, learner.precision, phase.copy, phase.crop_pct)
                    metrics = evaluate(learner.eval_net(settings.rect), source, settings, batches, ctx)
                    # Evaluation time counts towards time-to-target, as in the 2018 record's clock.
                    state.train_s = clock.train_s()
                    evals.append(note_evaluation(recipe, phase, epoch, metrics, speed, state, tracker))
                    # results.json so far, so that `speedrun compare` can show a run that is still going.
                    tracker.write_results(build_results(cfg, ctx, source, state, evals, "running", clock.session_start,
                                                        learner.precision))
                state.train_s = clock.train_s()
                if ctx.is_main and cfg.checkpoint_every and (
                    state.epoch % cfg.checkpoint_every == 0 or last or state.target_epoch is not None
                ):
                    save_run(writer, out / "checkpoint.pt", learner, state, cfg)  # written while the next epoch runs
                    last_save = time.time()
                if state.target_epoch is not None:
                    break
            writer.wait()
            if status != "stopped":
                status = "target_reached" if state.time_to_target_s is not None else "finished"
        except TrainingFailed:
            status = "failed"
            raise
        except RuntimeError as e:
            if collective_failed(e, ctx):  # a peer died: `train` says which; anything else is a bug
                status = "failed"
            raise
        except OSError as e:
            status = "failed"
            raise run_dir_error(e, out, writer.last_written) from None
        finally:
            streams.close()
            # Already failing or interrupted: let the last checkpoint reach the disk; the error that
            # ended the run is the one to report.
            with contextlib.suppress(Exception):
                writer.wait()
            state.train_s = clock.train_s()
            results = build_results(cfg, ctx, source, state, evals, status, clock.session_start, learner.precision)
            results["last_checkpoint"] = writer.last_written  # complete on disk; None: none
            # What `speedrun launch --recover` did to keep the run going (speedrun.cluster.recovery),
            # and what the time lost cost at the machines' price when the watcher knew it.
            recoveries = out / "recoveries.jsonl"
            results["recoveries"] = read_jsonl(recoveries) if recoveries.exists() else []
            prices = [r["price_per_hour"] for r in results["recoveries"] if r.get("price_per_hour") is not None]
            results["lost_usd"] = results["lost_s"] * prices[-1] / 3600 if prices else None
            try:
                tracker.write_results(results)
                tracker.plot(evals, dataclasses.asdict(recipe.target) if recipe.target else None)
            except OSError as e:  # a full disk: the error above says so; the checkpoint is what counts
                tracker.print(f"results.json not written: {e.strerror}")
    if status == "stopped":
        # No rank leaves before rank 0 has the checkpoint and results on disk: the launcher stops
        # the others as soon as one process exits.
        stops.barrier()
    return results


def complete(state: RunState, recipe: Recipe) -> bool:
    """Whether a checkpoint's run has nothing left to train: it reached its target or ran every epoch."""
    return state.target_epoch is not None or state.epoch >= recipe.epochs


def already_complete(out: Path, state: RunState, ctx: DistContext) -> dict[str, Any]:
    """`--resume` of a complete run: say so and change nothing (no interruption is recorded: no
    time was lost). Returns the run's results as results.json holds them."""
    how = (f"reached its target at epoch {state.target_epoch}" if state.target_epoch is not None
           else f"ran all {state.epoch} epochs")
    if ctx.is_main:
        print(f"{out} is complete (it {how}): nothing to resume; nothing was changed", flush=True)
    status = "target_reached" if state.target_epoch is not None else "finished"
    try:
        results = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):  # removed, damaged, or on rank 0's host only: the checkpoint says how it ended
        results = {}
    return {**results, "status": status}


def stop_here(stops: StopRequests, writer: CheckpointWriter, out: Path, learner: Learner, state: RunState,
              clock: Clock, cfg: TrainConfig, ctx: DistContext, tracker: Tracker) -> str:
    """Every rank agreed to stop after this step: rank 0 writes the checkpoint of this exact step
    and waits for it; returns the run's status, "stopped"."""
    state.train_s = clock.train_s()
    if ctx.is_main:
        save_run(writer, out / "checkpoint.pt", learner, state, cfg)
        writer.wait()
        stops.clear()
    notice = f" ({stops.notice})" if stops.notice else ""
    tracker.print(f"stopped {where(state)} on {stops.reason}{notice}; the checkpoint holds this step: "
                  f"continue with --resume --out {out}")
    return "stopped"


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


def run_header(cfg: TrainConfig, ctx: DistContext, source: DataSource, precision: str) -> str:
    """The first line a run prints: what trains on what, and the LR factor for this world size."""
    recipe = cfg.recipe
    scale = recipe.lr_scale(ctx.world_size)
    warmup = f" (ramped up over {recipe.scale_warmup_epochs:g} epochs)" if scale > 1 and recipe.scale_warmup_epochs else ""
    loader = f" ({source.loader} loader)" if source.loader else ""
    return (
        f"speedrun {speedrun.__version__}: recipe {recipe.name}, model {recipe.model}, "
        f"{source.num_train} train / {source.num_val} val images{loader}, "
        f"{ctx.world_size} x {ctx.device.type}, {precision}, LR x{scale:g}{warmup} for world size "
        f"{ctx.world_size}, target {recipe.target or 'none'}, out {cfg.out}"
    )


def run_dir_error(e: OSError, out: Path, complete: str | None) -> BaseException:
    """A write to the run directory failed: the disk is full, it became read-only or it was
    removed. That is the machine's fault, not speedrun's: one line (SpeedrunError) with what can
    be continued (`complete`: the last checkpoint on disk). Any other OSError is returned as is."""
    in_run_dir = e.filename is None or Path(os.fsdecode(e.filename)).absolute().is_relative_to(out.absolute())
    if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ENOENT) or not in_run_dir:
        return e
    where = f"{e.strerror}: {os.fsdecode(e.filename) if e.filename else 'checkpoint'}"
    if e.errno == errno.ENOENT:
        return SpeedrunError(f"the run directory {out} (or part of it) was removed during the run ({where})")
    return SpeedrunError(
        f"cannot write to the run directory {out} ({where}); "
        + (f"the last complete checkpoint is {complete}: free space and continue with --resume"
           if complete else "no checkpoint was completed: free space and start again")
    )


def note_evaluation(recipe: Recipe, phase: Phase, epoch: int, metrics: dict, speed: dict, state: RunState, tracker: Tracker) -> dict:
    """Log an evaluation, keep the best metrics, and stop the clock at the target. Returns the record."""
    record = {"epoch": epoch + 1, "step": state.step, "size": phase.size, "rect_val": phase.rect_val,
              "crop_pct": phase.crop_pct,
              "wall_s": state.startup_s + state.train_s, "train_s": state.train_s, "epoch_s": speed["epoch_s"],
              "images_per_s": speed["images_per_s"], **metrics}
    tracker.log_eval(record)
    tracker.print(
        f"epoch {epoch + 1:>3}/{recipe.epochs} {phase.size}px  loss {metrics['loss']:.4f}  "
        f"top1 {100 * metrics['top1']:.2f}%  top5 {100 * metrics['top5']:.2f}%  "
        f"{speed['images_per_s']:,.0f} img/s  wall {record['wall_s']:.1f}s"
    )
    for key in ("top1", "top5"):
        state.best[key] = max(state.best.get(key, 0.0), metrics[key])
    if reached_target(recipe, metrics) and state.time_to_target_s is None:
        state.time_to_target_s = state.startup_s + state.train_s
        state.time_to_target_from_first_step_s = state.train_s
        state.target_epoch = epoch + 1
        tracker.print(
            f"target {recipe.target} reached at epoch {epoch + 1}: {state.time_to_target_s:.1f}s from process "
            f"start, {state.time_to_target_from_first_step_s:.1f}s from the first step"
        )
    return record


def log_train_loss(loss: torch.Tensor, lr: float, epoch: int, step: int, ctx: DistContext, tracker: Tracker) -> None:
    """Record the mean loss over ranks; stop on a non-finite loss (it never recovers)."""
    value = all_reduce_sum(loss.detach().float().clone(), ctx).item() / ctx.world_size
    if not math.isfinite(value):
        raise TrainingFailed(f"loss became {value} at epoch {epoch + 1}, step {step} (lr {lr:.4g}); lower the LR")
    tracker.log_step({"step": step, "epoch": epoch + 1, "loss": value, "lr": lr})


def reached_target(recipe: Recipe, metrics: dict[str, float]) -> bool:
    return recipe.target is not None and metrics[recipe.target.metric] >= recipe.target.value


class Clock:
    """Wall-clock accounting that survives resumes: startup (process start -> first step, from
    the run's first session) plus training time (first step -> now, summed over sessions)."""

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

    def train_s(self) -> float:
        if self.first_step_at is None:
            return self.train_s_before
        return self.train_s_before + time.time() - self.first_step_at


class PhaseStreams:
    """The training stream for each epoch: a new one when the data setting changes, the same
    one re-batched when only the batch size does (no new dataset, no new loader workers)."""

    def __init__(self, source: DataSource, ctx: DistContext, seed: int):
        self.source, self.ctx, self.seed = source, ctx, seed
        self.stream: TrainStream | None = None
        self.key = None

    def for_epoch(self, phase: Phase, epoch: int, start_step: int = 0) -> TrainStream:
        if phase.data_key != self.key:
            self.close()
            self.stream, self.key = self.source.train_stream(phase, self.ctx.shard, self.seed), phase.data_key
        else:  # the same data setting: only the batch size may differ
            self.stream.batch_size = phase.batch_size
        self.stream.set_epoch(epoch, start_step)
        if len(self.stream) == 0:
            raise SpeedrunError(
                f"epoch {epoch}: {self.source.num_train} training images cannot fill one batch of "
                f"{phase.batch_size} x {self.ctx.world_size} devices; lower the batch size"
            )
        return self.stream

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream, self.key = None, None


def default_run_dir(recipe_name: str) -> Path:
    """runs/<recipe>-<date>-<time>, in the current directory."""
    return Path("runs") / f"{recipe_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def claim_run_dir(cfg: TrainConfig, ctx: DistContext) -> rundir.RunDir:
    """The run directory, claimed (checked, locked, cleared of a dead run's leftovers) on rank 0
    and shared, so that every rank writes to the same place; see speedrun.rundir."""
    claimed, decision = None, None
    if ctx.is_main:
        out = cfg.out or default_run_dir(cfg.recipe.name)
        try:
            claimed = rundir.claim(out, cfg.resume)
            decision = (str(out), None)
        except SpeedrunError as e:
            decision = (str(out), str(e))
    out, problem = broadcast_object(decision, ctx)
    if problem:
        raise SpeedrunError(problem)
    return claimed or rundir.RunDir(Path(out), lock=None)
