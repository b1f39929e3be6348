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
import math
import time
from typing import Any

import torch

from speedrun.checkpoint import CheckpointWriter, RunState, restore_run, save_run, where
from speedrun.config import TrainConfig
from speedrun.data import build_source
from speedrun.data.base import DataSource, TrainStream
from speedrun.dist import (DistContext, all_reduce_sum, collective_failed, init_distributed, job_share, peer_failure,
                           pick_device, shutdown)
from speedrun.errors import SpeedrunError, TrainingFailed, stop_on_sigterm, unwrapped
from speedrun.files import read_jsonl
from speedrun.learner import (DeviceBatches, EvalSettings, Learner, build_learner, check_device_options,
                              configure_determinism, evaluate)
from speedrun.optim import set_lr
from speedrun.recipe import Phase, Recipe
from speedrun.rundir import already_complete, claim_run_dir, complete, run_dir_error
from speedrun.stopping import StopRequests
from speedrun.track import (Clock, Tracker, build_results, interruption, memory_mb, open_run_trackers, recovery_costs,
                            run_header)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run the recipe to its end or its target; return the results (also in results.json)."""
    recipe = cfg.recipe
    device_kind = pick_device(cfg.device)
    check_device_options(cfg, device_kind)
    ctx = init_distributed(device_kind, cfg.dist_timeout_s)
    restore_sigterm = stop_on_sigterm()
    run_dir = None
    try:
        run_dir = claim_run_dir(cfg, ctx)
        cfg = dataclasses.replace(cfg, out=run_dir.path)
        configure_determinism(cfg, ctx)
        source = build_source(recipe, cfg.data, ctx.device, cfg.workers, cfg.copies, cfg.loader, job_share(ctx),
                              cfg.verify_index)
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
            if cfg.price is not None:  # a resume on other machines (a recovery) costs their price
                state.price = dataclasses.asdict(cfg.price)
            state.record_classes(source)  # for `speedrun eval` to check other data against
            tracker = Tracker(cfg.out, enabled=ctx.is_main, resume_step=state.step if cfg.resume else None,
                              trackers=open_run_trackers(cfg, ctx), track_checkpoints=cfg.track_checkpoints)
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
        # scheduler's second one) interrupts it, and does not kill the process in its middle;
        # once results.json holds the outcome, SIGTERM is ignored here (StopRequests.settle).
        try:
            if run_dir is not None:
                run_dir.release()
            shutdown(ctx)
        finally:
            restore_sigterm()


@dataclasses.dataclass
class Loop:
    """What the epoch loop's parts share: the run's pieces, and what it has done so far."""

    cfg: TrainConfig
    ctx: DistContext
    source: DataSource
    learner: Learner
    state: RunState  # where the run is (step, epoch, clock, best metrics): what a checkpoint holds
    tracker: Tracker
    batches: DeviceBatches
    clock: Clock
    streams: PhaseStreams
    writer: CheckpointWriter
    stops: StopRequests
    evals: list[dict]  # every evaluation's record (metrics.jsonl), a resumed run's earlier ones first
    last_save: float  # time.time() of the last checkpoint, from which --checkpoint-every minutes count


def run_epochs(
    cfg: TrainConfig, ctx: DistContext, source: DataSource, learner: Learner, state: RunState, tracker: Tracker
) -> dict[str, Any]:
    """The epochs, from `state` (a fresh run's or a resumed one's) to the end or the target; the
    results, written to results.json however the run ends."""
    tracker.print(run_header(cfg, ctx, source, learner.precision, learner.memory_format))
    loop = Loop(cfg, ctx, source, learner, state, tracker,
                batches=DeviceBatches(source, ctx.device, learner.channels_last),
                clock=Clock(cfg.process_start, state), streams=PhaseStreams(source, ctx, cfg.seed),
                writer=CheckpointWriter(
                    last_written=f"{cfg.out / 'checkpoint.pt'} ({where(state)})" if cfg.resume else None),
                stops=StopRequests(ctx, cfg.out, cfg.spot_notice_url),
                evals=read_jsonl(cfg.out / "metrics.jsonl") if cfg.resume else [], last_save=time.time())
    status, failure = "interrupted", None  # failure: why a "failed" run failed, one line
    # The stop handler stays until results.json is written: torchrun's SIGTERM, sent when a peer
    # died, reaches a survivor that may already be cleaning up, and must not cut that short.
    with loop.stops:
        try:
            status = train_epochs(loop)
        except TrainingFailed as e:
            status, failure = "failed", str(e)
            raise
        except SpeedrunError as e:  # the world changed under the run (its data removed, say): one line, exit 2
            error = unwrapped(e)
            status, failure = "failed", str(error)
            raise error from None
        except RuntimeError as e:
            if collective_failed(e, ctx):  # a peer died: `train` says which; anything else is a bug
                status, failure = "failed", peer_failure(e, ctx)
            raise
        except OSError as e:
            error = run_dir_error(e, cfg.out, loop.writer.last_written)
            status, failure = "failed", str(error)
            raise error from None
        finally:
            results = write_results(loop, status, failure)
    if status == "stopped":
        # No rank leaves before rank 0 has the checkpoint and results on disk: the launcher stops
        # the others as soon as one process exits.
        loop.stops.barrier()
    return results


def train_epochs(loop: Loop) -> str:
    """Train epoch after epoch until the recipe's end, its target, or a stop every rank agreed on;
    the run's status then ("finished", "target_reached" or "stopped")."""
    recipe, state = loop.cfg.recipe, loop.state
    first_epoch = state.epoch
    for epoch in range(first_epoch, recipe.epochs):
        phase = recipe.phase_at(epoch)
        skip = state.epoch_step if epoch == first_epoch else 0  # steps a resumed epoch already took
        speed = train_epoch(loop, epoch, phase, skip)
        if speed is None:  # every rank agreed to stop after the same step
            return stop_here(loop)
        after_epoch(loop, epoch, phase, speed)
        if state.target_epoch is not None:
            break
    loop.writer.wait()
    return "target_reached" if state.time_to_target_s is not None else "finished"


def train_epoch(loop: Loop, epoch: int, phase: Phase, skip: int) -> dict[str, float] | None:
    """One epoch's steps from step `skip` of it (a resumed epoch's first ones were taken): the LR set
    per step, the loss logged, a mid-epoch checkpoint when one is due. Its speed (images/s, epoch_s:
    seconds), or None when every rank agreed to stop after a step of it."""
    cfg, ctx, learner, state, tracker = loop.cfg, loop.ctx, loop.learner, loop.state, loop.tracker
    stream = loop.streams.for_epoch(phase, epoch, skip)
    steps, images_per_step = len(stream), stream.batch_size * ctx.world_size
    tracker.start_epoch(epoch, cfg.recipe.epochs, steps, phase.size, phase.batch_size)
    learner.net.train()
    start = time.time()
    for i, (images, labels) in enumerate(stream, start=skip):
        loop.clock.first_step()
        lr = cfg.recipe.lr_at(epoch, i, steps, ctx.world_size)  # per step: warmups and decays are smooth
        set_lr(learner.optimizer, lr)
        state.step += 1
        loss = learner.step(*loop.batches.to_device(images, labels), state.step)
        state.epoch_step = i + 1
        if state.step % cfg.log_every == 0 or i == steps - 1:
            log_train_loss(loss, lr, epoch, state.step, ctx, tracker)
        tracker.advance((i + 1 - skip) * images_per_step / max(time.time() - start, 1e-9))
        loop.writer.check()  # a checkpoint that failed stops the run now, not at the next save
        if loop.stops.agreed():  # every rank stops after this same step
            break
        if ctx.is_main and cfg.checkpoint_minutes and time.time() - loop.last_save >= 60 * cfg.checkpoint_minutes:
            loop.last_save = save(loop.writer, learner, state, loop.clock, cfg)  # mid-epoch, in the background
    if loop.stops.decided:  # what every rank agreed on, not this rank's own request
        return None
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    epoch_s = time.time() - start
    return {"images_per_s": (steps - skip) * images_per_step / epoch_s, "epoch_s": epoch_s}


def after_epoch(loop: Loop, epoch: int, phase: Phase, speed: dict[str, float]) -> None:
    """An epoch's end: its speed logged, an evaluation when one is due (it may reach the target),
    results.json brought up to date, and the checkpoint when one is due."""
    cfg, ctx, learner, state, tracker = loop.cfg, loop.ctx, loop.learner, loop.state, loop.tracker
    recipe = cfg.recipe
    learner.average_buffers(ctx)  # every rank evaluates (and rank 0 saves) the same model
    tracker.log_epoch({"epoch": epoch + 1, "step": state.step, "size": phase.size,
                       "batch_size": phase.batch_size, **speed, "memory_mb": memory_mb(ctx.device)})
    state.epoch, state.epoch_step = epoch + 1, 0
    last = epoch == recipe.epochs - 1
    if (epoch + 1) % recipe.eval_every == 0 or last:
        settings = EvalSettings(phase.size, recipe.val_batch_size or phase.batch_size, phase.rect_val,
                                recipe.eval_flip, learner.precision, phase.copy, phase.crop_pct)
        metrics = evaluate(learner.eval_net(settings.rect), loop.source, settings, loop.batches, ctx)
        # Evaluation time counts towards time-to-target, as in the 2018 record's clock.
        loop.clock.record()
        loop.evals.append(note_evaluation(recipe, phase, epoch, metrics, speed, state, tracker))
        # results.json so far, so that `speedrun compare` can show a run that is still going.
        tracker.write_results(build_results(cfg, ctx, loop.source, state, loop.evals, "running",
                                            loop.clock.session_start, learner.precision, learner.memory_format))
    if ctx.is_main and cfg.checkpoint_every and (
        state.epoch % cfg.checkpoint_every == 0 or last or state.target_epoch is not None
    ):
        loop.last_save = save(loop.writer, learner, state, loop.clock, cfg)  # written while the next epoch runs


def write_results(loop: Loop, status: str, failure: str | None) -> dict[str, Any]:
    """However the run ended (`status`; `failure`: why a failed one failed, one line): the data
    streams closed, the last checkpoint on disk, results.json and accuracy.png written."""
    cfg, learner, state, tracker = loop.cfg, loop.learner, loop.state, loop.tracker
    loop.streams.close()
    # Already failing or interrupted: let the last checkpoint reach the disk; the error that
    # ended the run is the one to report.
    with contextlib.suppress(Exception):
        loop.writer.wait()
    loop.clock.record()
    results = build_results(cfg, loop.ctx, loop.source, state, loop.evals, status, loop.clock.session_start,
                            learner.precision, learner.memory_format)
    results["last_checkpoint"] = loop.writer.last_written  # complete on disk; None: none
    results["failure"] = failure
    results.update(recovery_costs(cfg.out, results["lost_s"], state.price))
    try:
        tracker.write_results(results)
        loop.stops.settle()  # the outcome is on disk: a SIGTERM from here on changes nothing
        tracker.plot(loop.evals, dataclasses.asdict(cfg.recipe.target) if cfg.recipe.target else None)
    except OSError as e:  # a full disk: the error above says so; the checkpoint is what counts
        tracker.print(f"results.json not written: {e.strerror}")
    return results


def stop_here(loop: Loop) -> str:
    """Every rank agreed to stop after this step: rank 0 writes the checkpoint of this exact step
    and waits for it; returns the run's status, "stopped"."""
    stops, writer, cfg = loop.stops, loop.writer, loop.cfg
    if loop.ctx.is_main:
        save(writer, loop.learner, loop.state, loop.clock, cfg)
        writer.wait()
        stops.clear()
    notice = f" ({stops.notice})" if stops.notice else ""
    loop.tracker.print(f"stopped {where(loop.state)} on {stops.reason}{notice}; the checkpoint holds this step: "
                       f"continue with --resume --out {cfg.out}")
    return "stopped"


def save(writer: CheckpointWriter, learner: Learner, state: RunState, clock: Clock, cfg: TrainConfig) -> float:
    """The one place a run is saved (rank 0 only): the checkpoint of this step, the clock brought up
    to it, handed to the writer's thread (`writer.wait()` has it on disk). Returns the time of the
    save, from which --checkpoint-every minutes count."""
    clock.record()
    save_run(writer, cfg.out / "checkpoint.pt", learner, state, cfg)
    return time.time()


def note_evaluation(recipe: Recipe, phase: Phase, epoch: int, metrics: dict, speed: dict, state: RunState,
                    tracker: Tracker) -> dict:
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
        state.lost_s_at_target = sum(i["wall_s_lost"] for i in state.interruptions)
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
