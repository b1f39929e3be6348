"""The training loop: phases, precision, evaluation, target, checkpoints, results.

`train(config)` runs one process's share of a run (one process per device; see speedrun.dist).
Read `train` top to bottom for the whole story; the helpers below it each do one step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
import platform
import resource
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import speedrun
from speedrun import checkpoint, rundir
from speedrun.data import build_source
from speedrun.data.base import DataSource, TrainStream, normalize_on_device
from speedrun.dist import DistContext, all_reduce_sum, average_buffers, broadcast_object, init_distributed, pick_device, shutdown
from speedrun.errors import SpeedrunError, TrainingFailed
from speedrun.model import build_model
from speedrun.optim import build_optimizer, set_lr
from speedrun.recipe import PRECISIONS, Phase, Recipe
from speedrun.track import Tracker, read_jsonl


PEER_DIED = "another rank probably died"  # the launcher recognises collateral failures by this


@dataclass
class TrainConfig:
    """Everything `speedrun train` passes to the loop besides the recipe."""

    recipe: Recipe
    out: Path | None = None  # run directory; None = runs/<recipe>-<date>-<time>
    data: str | None = None  # data path; None = the source's default lookup
    device: str | None = None  # "cpu", "cuda", or None for cuda when available
    resume: bool = False
    compile: bool = False
    seed: int = 0
    deterministic: bool = False
    workers: int | None = None  # decode processes per device (image folders)
    copies: str | None = None  # where an image folder's resized copies are (None: <data>-sz)
    loader: str = "auto"  # image-folder training decode: "auto", "pil" or "dali" (data.build_source)
    log_every: int = 50  # steps between train-loss records
    checkpoint_every: int = 1  # epochs between checkpoints (0: never)
    sync_bn: bool = False  # synchronise BatchNorm statistics across ranks
    bucket_cap_mb: float = 25.0  # DDP gradient bucket size
    bf16_grads: bool = False  # compress gradients to bf16 for the all-reduce (CUDA only)
    precision: str = "auto"  # "auto" (see choose_precision), "bf16", "fp16" or "fp32"
    process_start: float = field(default_factory=time.time)  # wall clock when the process began


@dataclass
class RunState:
    """What a checkpoint carries besides weights and optimizer state."""

    epoch: int = 0  # next epoch to run (0-based), which is also the number of epochs done
    step: int = 0  # optimizer steps taken, all epochs
    startup_s: float = 0.0  # process start -> first step, in the run's first process
    train_s: float = 0.0  # first step -> now, summed over resumed sessions
    best: dict[str, float] = field(default_factory=dict)
    time_to_target_s: float | None = None
    time_to_target_from_first_step_s: float | None = None
    target_epoch: int | None = None  # the epoch (1-based, as printed) whose evaluation reached the target
    world_size: int | None = None  # processes the run trains on; a resume must use as many


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
        if source.num_classes < 2:
            raise SpeedrunError(f"{source.name} has {source.num_classes} class: every label would be the same; "
                                "a classifier needs at least 2 (one folder per class)")
        learner = build_learner(cfg, ctx, source)
        state = RunState(world_size=ctx.world_size)
        if cfg.resume:
            state = restore(cfg.out / "checkpoint.pt", learner, cfg, ctx.world_size)
        tracker = Tracker(cfg.out, enabled=ctx.is_main, resume_step=state.step if cfg.resume else None)
        if run_dir.note:
            tracker.print(run_dir.note)
        try:
            results = run_epochs(cfg, ctx, source, learner, state, tracker)
        finally:
            tracker.close()
            source.close()
        return results
    finally:
        if run_dir is not None:
            run_dir.release()
        restore_sigterm()
        shutdown(ctx)


def run_epochs(
    cfg: TrainConfig, ctx: DistContext, source: DataSource, learner: Learner, state: RunState, tracker: Tracker
) -> dict[str, Any]:
    recipe = cfg.recipe
    batches = DeviceBatches(source, ctx, learner.channels_last)
    evals = read_jsonl(cfg.out / "metrics.jsonl") if cfg.resume else []
    loader = getattr(source, "loader", None)  # image folders: what decodes training images
    scale = recipe.lr_scale(ctx.world_size)
    warmup = f" (ramped up over {recipe.scale_warmup_epochs:g} epochs)" if scale > 1 and recipe.scale_warmup_epochs else ""
    tracker.print(
        f"speedrun {speedrun.__version__}: recipe {recipe.name}, model {recipe.model}, "
        f"{source.num_train} train / {source.num_val} val images{f' ({loader} loader)' if loader else ''}, "
        f"{ctx.world_size} x {ctx.device.type}, {learner.precision}, LR x{scale:g}{warmup} for world size "
        f"{ctx.world_size}, target {recipe.target or 'none'}, out {cfg.out}"
    )
    clock = Clock(cfg.process_start, state)
    streams = PhaseStreams(source, ctx, cfg.seed)
    writer = checkpoint.CheckpointWriter()
    resumed_from = f"{cfg.out / 'checkpoint.pt'} (after epoch {state.epoch})" if cfg.resume else None
    status = "interrupted"
    # A resumed run that had reached its target is complete: nothing more to train.
    first_epoch = state.epoch if state.target_epoch is None else recipe.epochs
    try:
        for epoch in range(first_epoch, recipe.epochs):
            phase = recipe.phase_at(epoch)
            stream = streams.for_epoch(phase, epoch)
            tracker.start_epoch(epoch, recipe.epochs, len(stream), phase.size, phase.batch_size)
            speed = train_one_epoch(learner, stream, batches, recipe, epoch, state, clock, ctx, tracker, cfg.log_every)
            learner.average_buffers(ctx)
            tracker.log_epoch({"epoch": epoch + 1, "step": state.step, "size": phase.size,
                               "batch_size": phase.batch_size, **speed, "memory_mb": memory_mb(ctx.device)})
            state.epoch = epoch + 1
            last = epoch == recipe.epochs - 1
            if (epoch + 1) % recipe.eval_every == 0 or last:
                metrics = evaluate(learner.eval_net, source, phase.size, recipe.val_batch_size or phase.batch_size,
                                   phase.rect_val, batches, learner.precision, recipe.eval_flip)
                # Evaluation time counts towards time-to-target, as in the 2018 record's clock.
                state.train_s = clock.train_s()
                evals.append(note_evaluation(recipe, phase, epoch, metrics, speed, state, tracker))
            state.train_s = clock.train_s()
            if ctx.is_main and cfg.checkpoint_every and (
                state.epoch % cfg.checkpoint_every == 0 or last or state.target_epoch is not None
            ):
                # Written by a background thread: the next epoch starts while it is saved.
                save_checkpoint(writer, cfg.out / "checkpoint.pt", learner, state, cfg)
            if state.target_epoch is not None:
                break
        writer.wait()
        status = "target_reached" if state.time_to_target_s is not None else "finished"
    except TrainingFailed:
        status = "failed"
        raise
    except torch.distributed.DistError as e:
        status = "failed"
        raise TrainingFailed(f"a collective failed, {PEER_DIED}: {str(e).splitlines()[0]}") from None
    except OSError as e:
        status = "failed"
        in_run_dir = e.filename is None or Path(os.fsdecode(e.filename)).absolute().is_relative_to(cfg.out.absolute())
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ENOENT) or not in_run_dir:
            raise
        # The machine's fault, not speedrun's: one line, with what can be continued.
        where = f"{e.strerror}: {os.fsdecode(e.filename) if e.filename else 'checkpoint'}"
        if e.errno == errno.ENOENT:
            raise SpeedrunError(f"the run directory {cfg.out} (or part of it) was removed during the run ({where})") from None
        complete = writer.last_written or resumed_from  # a failed write left the previous file intact
        raise SpeedrunError(
            f"cannot write to the run directory {cfg.out} ({where}); "
            + (f"the last complete checkpoint is {complete}: free space and continue with --resume"
               if complete else "no checkpoint was completed: free space and start again")
        ) from None
    finally:
        streams.close()
        # Already failing or interrupted: let the last checkpoint reach the disk; the error that
        # ended the run is the one to report.
        with contextlib.suppress(Exception):
            writer.wait()
        state.train_s = clock.train_s()
        results = build_results(cfg, ctx, state, evals, status, clock.session_start, learner.precision)
        results["skipped_images"] = source.skipped_images()
        results["last_checkpoint"] = writer.last_written or resumed_from  # complete on disk; None: none
        results["loader"] = loader
        try:
            tracker.write_results(results)
            tracker.plot(evals, asdict(recipe.target) if recipe.target else None)
        except OSError as e:  # a full disk: the error above says so; the checkpoint is what counts
            tracker.print(f"results.json not written: {e.strerror}")
    return results


def train_one_epoch(
    learner: Learner,
    stream: TrainStream,
    batches: DeviceBatches,
    recipe: Recipe,
    epoch: int,
    state: RunState,
    clock: Clock,
    ctx: DistContext,
    tracker: Tracker,
    log_every: int,
) -> dict[str, float]:
    """One pass over this rank's share of the training set, the LR set before every step.
    Returns the epoch's speed: images_per_s (all ranks) and epoch_s."""
    learner.net.train()
    steps = len(stream)
    images_per_step = stream.batch_size * ctx.world_size
    start = time.time()
    for i, (images, labels) in enumerate(stream):
        clock.first_step()
        lr = recipe.lr_at(epoch, i, steps, ctx.world_size)
        set_lr(learner.optimizer, lr)
        state.step += 1
        loss = learner.step(*batches.to_device(images, labels), state.step)
        if state.step % log_every == 0 or i == steps - 1:
            log_train_loss(loss, lr, epoch, state.step, ctx, tracker)
        tracker.advance((i + 1) * images_per_step / max(time.time() - start, 1e-9))
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    epoch_s = time.time() - start
    return {"images_per_s": steps * images_per_step / epoch_s, "epoch_s": epoch_s}


def note_evaluation(recipe: Recipe, phase: Phase, epoch: int, metrics: dict, speed: dict, state: RunState, tracker: Tracker) -> dict:
    """Log an evaluation, keep the best metrics, and stop the clock at the target. Returns the record."""
    record = {"epoch": epoch + 1, "step": state.step, "size": phase.size, "rect_val": phase.rect_val,
              "wall_s": state.startup_s + state.train_s, "train_s": state.train_s, "epoch_s": speed["epoch_s"],
              **metrics}
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

    def for_epoch(self, phase: Phase, epoch: int) -> TrainStream:
        if phase.data_key != self.key:
            self.close()
            self.stream, self.key = self.source.train_stream(phase, self.ctx.shard, self.seed), phase.data_key
        self.stream.batch_size = phase.batch_size
        self.stream.set_epoch(epoch)
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


class DeviceBatches:
    """Moves uint8 batches to the device and normalises them there."""

    def __init__(self, source: DataSource, ctx: DistContext, channels_last: bool):
        self.ctx, self.device = ctx, ctx.device
        self.channels_last = channels_last
        self.mean = torch.tensor(source.mean, device=ctx.device).view(-1, 1, 1)
        self.std = torch.tensor(source.std, device=ctx.device).view(-1, 1, 1)

    def to_device(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = normalize_on_device(images, self.mean, self.std, self.device, self.channels_last)
        return x, labels.to(self.device, non_blocking=True)


def check_device_options(cfg: TrainConfig, device_kind: str) -> None:
    """Options that only work on GPUs, refused up front on the CPU (`device_kind`: pick_device's answer)."""
    if device_kind != "cuda":
        if cfg.sync_bn:
            raise SpeedrunError("--sync-bn needs CUDA: PyTorch's SyncBatchNorm runs on GPUs only")
        if cfg.bf16_grads:
            raise SpeedrunError("--bf16-grads compresses NCCL all-reduces and needs CUDA")


def stop_on_sigterm():
    """Treat SIGTERM (torchrun stopping the survivors when a rank died, a spot instance being
    reclaimed) like Ctrl-C, so results so far are written. Returns a function undoing this."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"stopped by signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, previous)


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


# -- one step at a time ------------------------------------------------------------------------


@dataclass
class Learner:
    """The model and everything that updates it: `model` is the plain module (checkpoints,
    buffers), `net` what runs the steps (DDP and/or compiled), `ema` an optional moving average
    of the weights that is evaluated and saved in the model's place."""

    model: nn.Module
    net: nn.Module
    optimizer: torch.optim.Optimizer
    criterion: nn.Module
    precision: str  # "bf16", "fp16" or "fp32" (choose_precision's answer)
    channels_last: bool
    ema: Any = None  # timm.utils.ModelEmaV3
    scaler: torch.amp.GradScaler | None = None  # fp16 only: scales the loss so gradients do not underflow
    compiled_model: nn.Module | None = None  # torch.compile(model), for evaluation

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        """One optimizer step on a normalised batch; `step` counts steps from the run's start."""
        loss = train_step(self.net, self.optimizer, self.criterion, x, y, self.precision, self.scaler)
        if self.ema is not None:
            self.ema.update(self.model, step=step)
        return loss

    @property
    def eval_net(self) -> nn.Module:
        """What evaluation runs: the EMA weights, else the model itself, never the DDP wrapper
        (see `evaluate`)."""
        if self.ema is not None:
            return self.ema.module
        return self.compiled_model if self.compiled_model is not None else self.model

    def average_buffers(self, ctx: DistContext) -> None:
        average_buffers(self.model, ctx)
        if self.ema is not None:
            average_buffers(self.ema.module, ctx)


def build_learner(cfg: TrainConfig, ctx: DistContext, source: DataSource) -> Learner:
    """The recipe's model on the device (channels_last for CNNs), its optimizer and loss, wrapped
    in DistributedDataParallel when there are several processes and compiled if asked."""
    recipe = cfg.recipe
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = build_model(recipe.model, source.num_classes, source.channels)
    # channels_last speeds up convolutions on both CUDA and oneDNN (CPU); measured 1.3x on the
    # demo ResNet with 2 CPU cores.
    channels_last = any(isinstance(m, nn.Conv2d) for m in model.modules())
    model = model.to(ctx.device, memory_format=torch.channels_last if channels_last else torch.preserve_format)
    if cfg.sync_bn and ctx.distributed:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = build_optimizer(model, recipe.optimizer, lr=recipe.lr_at(0, 0, 1, ctx.world_size))
    ema = None
    if recipe.ema_decay is not None:
        from timm.utils import ModelEmaV3

        # Warmup: the decay at step t is min(ema_decay, 1 - (1 + t)^(-2/3)), so early evaluations
        # are not dominated by the random initial weights; it reaches 0.998 after ~11,000 steps.
        ema = ModelEmaV3(model, decay=recipe.ema_decay, use_warmup=True)
    net = model
    if ctx.distributed:
        net = DDP(
            model,
            device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            bucket_cap_mb=cfg.bucket_cap_mb,
            gradient_as_bucket_view=True,
        )
        if cfg.bf16_grads:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            net.register_comm_hook(None, default_hooks.bf16_compress_hook)
    compiled_model = None
    if cfg.compile:
        # Sizes change between phases; each size compiles once, dynamic shapes would be slower.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        compiled_model = torch.compile(model, dynamic=False)  # evaluation runs the bare model
        net = compiled_model if net is model else torch.compile(net, dynamic=False)
    criterion = nn.CrossEntropyLoss(label_smoothing=recipe.optimizer.label_smoothing)
    precision = choose_precision(cfg.precision, ctx.device.type, device_capability(ctx.device))
    scaler = torch.amp.GradScaler(ctx.device.type) if precision == "fp16" else None
    return Learner(model, net, optimizer, criterion, precision, channels_last, ema, scaler, compiled_model)


def train_step(
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
) -> torch.Tensor:
    """One optimizer step on a normalised batch, under autocast to `precision`'s dtype (a
    GradScaler is needed for fp16); returns the loss (not synchronised)."""
    with autocast(x.device, precision):
        loss = criterion(net(x), y)
    optimizer.zero_grad(set_to_none=True)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return loss


def autocast(device: torch.device, precision: str) -> torch.autocast:
    """Mixed precision for `precision` ("bf16", "fp16"); disabled for "fp32"."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


@torch.no_grad()
def evaluate(
    net: nn.Module, source: DataSource, size: int, batch_size: int, rect: bool, batches: DeviceBatches,
    precision: str = "fp32", flip: bool = False,
) -> dict[str, float]:
    """Loss, top-1 and top-5 over the whole validation split at `size` pixels; each rank
    evaluates its share and the sums are reduced, so every sample counts exactly once whatever
    the world size. `flip`: the logits are the mean of the image's and its horizontal mirror's
    (twice the compute).

    A DistributedDataParallel `net` is evaluated through its module: DDP's forward broadcasts
    BatchNorm buffers, a collective that a rank with no validation batch would never join, so
    the ranks' collectives would stop lining up (a hang; the 2018 code avoided it the same way).
    """
    if isinstance(net, DDP):
        net = net.module
    net.eval()
    ctx = batches.ctx
    sums = torch.zeros(4, dtype=torch.float64, device=ctx.device)  # loss, correct@1, correct@5, count
    for images, labels in source.val_batches(size, batch_size, rect, ctx.shard):
        x, y = batches.to_device(images, labels)
        with autocast(ctx.device, precision):
            logits = net(x).float()
            if flip:
                logits = (logits + net(x.flip(3)).float()) / 2
        sums += count_correct(logits, y)
    all_reduce_sum(sums, ctx)
    loss, top1, top5, count = sums.tolist()
    if count == 0:
        raise SpeedrunError("the validation split is empty")
    return {"loss": loss / count, "top1": top1 / count, "top5": top5 / count, "count": int(count)}


def count_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[summed cross-entropy, correct@1, correct@5, count] for one batch, as float64."""
    k = min(5, logits.shape[1])
    top = logits.topk(k, dim=1).indices
    hits = top == labels[:, None]
    return torch.stack(
        [
            F.cross_entropy(logits, labels, reduction="sum").double(),
            hits[:, 0].sum().double(),
            hits.any(dim=1).sum().double(),
            torch.tensor(float(len(labels)), dtype=torch.float64, device=logits.device),
        ]
    )


def log_train_loss(loss: torch.Tensor, lr: float, epoch: int, step: int, ctx: DistContext, tracker: Tracker) -> None:
    """Record the mean loss over ranks; stop on a non-finite loss (it never recovers)."""
    value = all_reduce_sum(loss.detach().float().clone(), ctx).item() / ctx.world_size
    if not math.isfinite(value):
        raise TrainingFailed(f"loss became {value} at epoch {epoch + 1}, step {step} (lr {lr:.4g}); lower the LR")
    tracker.log_step({"step": step, "epoch": epoch + 1, "loss": value, "lr": lr})


def reached_target(recipe: Recipe, metrics: dict[str, float]) -> bool:
    return recipe.target is not None and metrics[recipe.target.metric] >= recipe.target.value


def configure_determinism(cfg: TrainConfig, ctx: DistContext) -> None:
    """Deterministic kernels when asked (same results run after run); fastest kernels otherwise."""
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    elif ctx.device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def choose_precision(requested: str, device_type: str, capability: tuple[int, int] | None) -> str:
    """"bf16", "fp16" or "fp32" for a run asking for `requested` on a `device_type` device of CUDA
    compute `capability`. auto: bf16 autocast on GPUs that have it (compute capability 8.0,
    Ampere, and later), fp16 with a gradient scaler on older ones (V100 7.0, T4 7.5: the record's
    hardware), fp32 on the CPU, where both are several times slower."""
    if requested not in PRECISIONS:
        raise SpeedrunError(f"unknown precision {requested!r} (use {', '.join(PRECISIONS)})")
    bf16_ok = device_type != "cuda" or (capability is not None and capability >= (8, 0))
    if requested == "bf16" and not bf16_ok:
        raise SpeedrunError(
            f"--precision bf16: this GPU (compute capability {capability[0]}.{capability[1]}) has no bf16; "
            "use --precision fp16 or auto"
        )
    if requested != "auto":
        return requested
    if device_type != "cuda":
        return "fp32"
    return "bf16" if bf16_ok else "fp16"


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """A CUDA device's compute capability (major, minor); None for other devices."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def memory_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocations on a GPU, resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# -- checkpoints and results -------------------------------------------------------------------


def save_checkpoint(writer: checkpoint.CheckpointWriter, path: Path, learner: Learner, state: RunState, cfg: TrainConfig) -> None:
    """Hand the run's state to `writer`, which copies it now and writes it in the background."""
    writer.save(
        {
            "model": learner.model.state_dict(),
            "ema": learner.ema.module.state_dict() if learner.ema is not None else None,
            "optimizer": learner.optimizer.state_dict(),
            "scaler": learner.scaler.state_dict() if learner.scaler is not None else None,
            "state": asdict(state),
            "recipe": cfg.recipe.to_dict(),
            "data": cfg.data,  # where `speedrun eval` finds the validation split
            "seed": cfg.seed,  # a resume must use the same, or it would not continue the same run
            "deterministic": cfg.deterministic,
            "rng": checkpoint.rng_state(),
            "speedrun": speedrun.__version__,
        },
        path,
        label=f"{path} (after epoch {state.epoch})",
    )


def restore(path: Path, learner: Learner, cfg: TrainConfig, world_size: int) -> RunState:
    """Load a checkpoint into the learner. The recipe, the number of processes, the seed and
    --deterministic must be the ones it was made with: another world size would change the global
    batch and the LR mid-run, another seed the data order; the run would not continue, it would
    become a different one."""
    try:
        saved = checkpoint.load(path)
    except SpeedrunError as e:
        raise SpeedrunError(f"--resume: {e}; it cannot be continued: start over in another --out") from None
    if not isinstance(saved, dict) or not {"recipe", "model", "optimizer", "state"} <= set(saved):
        raise SpeedrunError(f"--resume: {path} is not a speedrun checkpoint; start over in another --out")
    if Recipe.from_dict(saved["recipe"]) != cfg.recipe:
        raise SpeedrunError(f"--resume: {path} was made with a different recipe ({saved['recipe']['name']}); resume with the same one")
    state = RunState(**saved["state"])
    if state.world_size is not None and state.world_size != world_size:
        raise SpeedrunError(
            f"--resume: {path} was trained on {processes(state.world_size)} and this run has {processes(world_size)}: "
            f"the global batch and LR would change mid-run; resume on {processes(state.world_size)}"
        )
    for name, now in (("seed", cfg.seed), ("deterministic", cfg.deterministic)):
        if name in saved and saved[name] != now:
            flag = f"--seed {saved[name]}" if name == "seed" else ("--deterministic" if saved[name] else "no --deterministic")
            raise SpeedrunError(f"--resume: the run was made with {flag}; resume with the same (this run has {name} {now})")
    state.world_size = world_size  # checkpoints before this field: unknown, taken as this run's
    learner.model.load_state_dict(saved["model"])
    if learner.ema is not None:
        learner.ema.module.load_state_dict(saved["ema"])
    learner.optimizer.load_state_dict(saved["optimizer"])
    if learner.scaler is not None and saved.get("scaler"):
        learner.scaler.load_state_dict(saved["scaler"])
    checkpoint.set_rng_state(saved["rng"])
    return state


def processes(n: int | None) -> str:
    """"1 process", "8 processes"."""
    return f"{n} process" if n == 1 else f"{n} processes"


def build_results(
    cfg: TrainConfig, ctx: DistContext, state: RunState, evals: list[dict], status: str, session_start: float, precision: str
) -> dict[str, Any]:
    recipe = cfg.recipe
    final = evals[-1] if evals else None
    return {
        "status": status,  # target_reached, finished, interrupted or failed
        "recipe": recipe.to_dict(),
        "target": asdict(recipe.target) if recipe.target else None,
        "reached_target": state.time_to_target_s is not None,
        "time_to_target_s": state.time_to_target_s,
        "time_to_target_from_first_step_s": state.time_to_target_from_first_step_s,
        "target_epoch": state.target_epoch,
        "total_s": state.startup_s + state.train_s,
        "startup_s": state.startup_s,
        "epochs_run": state.epoch,
        "steps": state.step,
        "best": state.best,
        "final": final,
        "world_size": ctx.world_size,
        "device": device_name(ctx.device),
        "seed": cfg.seed,
        "deterministic": cfg.deterministic,
        "compile": cfg.compile,
        "precision": precision,
        "data": cfg.data,
        "versions": {"speedrun": speedrun.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "session_s": time.time() - session_start,
    }


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
