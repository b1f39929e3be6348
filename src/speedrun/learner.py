"""The learner: the model and everything that updates and evaluates it.

`build_learner` makes the recipe's model on this process's device, its optimizer (parameter
groups, SGD or LARS), loss, optional EMA of the weights, mixed precision (`choose_precision`),
DistributedDataParallel for several processes and torch.compile when asked. `Learner.step` is
one optimizer step; `evaluate` scores a model on the validation split across all ranks.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from speedrun.config import TrainConfig
from speedrun.data.base import DataSource, normalize_on_device
from speedrun.dist import DistContext, all_reduce_sum, average_buffers
from speedrun.errors import SpeedrunError
from speedrun.memory_format import MemoryFormat, choose_memory_format
from speedrun.model import build_model
from speedrun.optim import build_optimizer
from speedrun.recipe import IMAGENET_CROP_PCT, PRECISIONS


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
    memory_format: MemoryFormat  # of the model and its batches, and why
    ema: Any = None  # timm.utils.ModelEmaV3
    scaler: torch.amp.GradScaler | None = None  # fp16 only: scales the loss so gradients do not underflow
    compiled_model: nn.Module | None = None  # torch.compile(model), for evaluation

    @property
    def channels_last(self) -> bool:
        return self.memory_format.channels_last

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        """One optimizer step on a normalised batch; `step` counts steps from the run's start."""
        loss = train_step(self.net, self.optimizer, self.criterion, x, y, self.precision, self.scaler)
        if self.ema is not None:
            self.ema.update(self.model, step=step)
        return loss

    def eval_net(self, rect: bool = False) -> nn.Module:
        """What evaluation runs: the EMA weights, else the model itself, never the DDP wrapper
        (see `evaluate`); compiled when training is, except for rectangular validation (`rect`),
        whose batches come in many shapes: each would be compiled anew (a minute or so for
        ResNet-50) until torch.compile's recompile limit, for one batch each."""
        if self.ema is not None:
            return self.ema.module
        return self.compiled_model if self.compiled_model is not None and not rect else self.model

    def average_buffers(self, ctx: DistContext) -> None:
        average_buffers(self.model, ctx)
        if self.ema is not None:
            average_buffers(self.ema.module, ctx)


def build_learner(cfg: TrainConfig, ctx: DistContext, source: DataSource) -> Learner:
    """The recipe's model on the device in its memory format (speedrun.memory_format), its optimizer
    and loss, wrapped in DistributedDataParallel when there are several processes and compiled if asked."""
    recipe = cfg.recipe
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = build_model(recipe.model, source.num_classes, source.channels, recipe.zero_init)
    memory_format = choose_memory_format(model, ctx.device.type, cfg.memory_format)
    if memory_format.warning and ctx.is_main:
        print(f"speedrun: warning: {memory_format.warning}", file=sys.stderr, flush=True)
    model = model.to(ctx.device, memory_format=memory_format.torch_format)
    if cfg.sync_bn and ctx.distributed:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # Fused SGD on GPUs: one kernel for the whole update (benchmarks/gpu_check.sh measures it against torch's default).
    optimizer = build_optimizer(model, recipe.optimizer, lr=recipe.lr_at(0, 0, 1, ctx.world_size),
                                fused=ctx.device.type == "cuda")
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
    return Learner(model, net, optimizer, criterion, precision, memory_format, ema, scaler, compiled_model)


def to_device(model: nn.Module, device: torch.device, memory_format: str = "auto") -> tuple[nn.Module, bool]:
    """`model` on `device` in the memory format `choose_memory_format` picks (`memory_format`:
    "auto", "channels_last" or "contiguous"); returns it and whether it is channels_last."""
    chosen = choose_memory_format(model, device.type, memory_format)
    return model.to(device, memory_format=chosen.torch_format), chosen.channels_last


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


@dataclass(frozen=True)
class EvalSettings:
    """How to evaluate: image size (pixels), images per device per batch, rectangular or square
    validation, test-time flips (each image's logits averaged with its mirror's), precision, the
    resized copy, and how much of the resized image is kept (`Phase.crop_pct`)."""

    size: int
    batch_size: int
    rect: bool = False
    flip: bool = False
    precision: str = "fp32"
    copy: int | None = None  # image folders: the resized copy to read (the phase's), None for full size
    crop_pct: float = IMAGENET_CROP_PCT


@torch.no_grad()
def evaluate(net: nn.Module, source: DataSource, settings: EvalSettings, batches: DeviceBatches,
             ctx: DistContext) -> dict[str, float]:
    """Loss, top-1 and top-5 over the whole validation split; each rank evaluates its share and
    the sums are reduced, so every sample counts exactly once whatever the world size. Flips
    cost twice the compute.

    A DistributedDataParallel `net` is evaluated through its module: DDP's forward broadcasts
    BatchNorm buffers, a collective that a rank with no validation batch would never join, so
    the ranks' collectives would stop lining up (a hang; the 2018 code avoided it the same way).
    """
    if isinstance(net, DDP):
        net = net.module
    net.eval()
    # cuDNN autotuning pays off over many steps of one shape; rectangular batches each have their own.
    autotune = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = autotune and not settings.rect
    try:
        return _evaluate(net, source, settings, batches, ctx)
    finally:
        torch.backends.cudnn.benchmark = autotune


def _evaluate(net: nn.Module, source: DataSource, settings: EvalSettings, batches: DeviceBatches,
              ctx: DistContext) -> dict[str, float]:
    sums = torch.zeros(4, dtype=torch.float64, device=ctx.device)  # loss, correct@1, correct@5, count
    for images, labels in source.val_batches(settings.size, settings.batch_size, settings.rect, ctx.shard,
                                             settings.copy, settings.crop_pct):
        x, y = batches.to_device(images, labels)
        with autocast(ctx.device, settings.precision):
            logits = net(x).float()
            if settings.flip:
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


class DeviceBatches:
    """Moves uint8 batches to the device and normalises them there."""

    def __init__(self, source: DataSource, device: torch.device, channels_last: bool):
        self.device = device
        self.channels_last = channels_last
        self.mean = torch.tensor(source.mean, device=device).view(-1, 1, 1)
        self.std = torch.tensor(source.std, device=device).view(-1, 1, 1)

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


def configure_determinism(cfg: TrainConfig, ctx: DistContext) -> None:
    """Deterministic kernels when asked (same results run after run); fastest kernels otherwise."""
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        # Deterministic mode also fills every new tensor, on the allocating stream. torchvision's
        # nvJPEG decoder writes its outputs from a stream of its own that does not wait for that
        # fill, which could land on decoded pixels (`data.gpu`). speedrun reads no memory it has
        # not written, so the fill only costs time.
        torch.utils.deterministic.fill_uninitialized_memory = False
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
